"""The user-facing tools on top of the library: the status view (``asyncdiloco status``),
the evaluator (``asyncdiloco eval``) and the export of the global model
(``asyncdiloco export``). Each is a library call the CLI wraps in a few lines."""
