"""Deployable entry point of the parameter server: ``python server/main.py [flags]``.

The same as ``asyncdiloco server [flags]``; kept as a file so a process manager or a
container can start the server without relying on the console-script shim. See
``server/README.md`` for the operator's notes.
"""

import sys

from asyncdiloco.cli import main

if __name__ == "__main__":
    main(["server", *sys.argv[1:]])
