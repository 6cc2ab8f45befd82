"""The ``asyncdiloco`` command: one module per subcommand on top of every other layer."""

from asyncdiloco.cli.app import main

__all__ = ["main"]
