"""The ``asyncdiloco`` command (app.py ``main``): one module per subcommand, on top of
every other layer (docs/operations.md)."""
