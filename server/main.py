"""Deployable entry point of the parameter server: ``python server/main.py [flags]``.

The same as ``asyncdiloco server [flags]``; kept as a file so a process manager or a
container can start the server without relying on the console-script shim. See
``docs/operations.md`` for the operator's notes.
"""

import re
import sys

from asyncdiloco.cli.app import main

#: Flags of the ``asyncdiloco`` command itself, which must come before the subcommand.
_GLOBAL = re.compile(r"^(-q|--quiet|--verbose|-v+)$")

if __name__ == "__main__":
    argv = sys.argv[1:]
    main([*(a for a in argv if _GLOBAL.match(a)), "server", *(a for a in argv if not _GLOBAL.match(a))])
