"""The ``asyncdiloco`` command: one module per subcommand on top of every other layer.

``main`` loads the subcommands on first call, so that importing ``asyncdiloco.flags.settings``
(the flag table the demo's processes are started with) does not load them all.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> None:
    """``asyncdiloco ARGV``: see ``asyncdiloco.cli.app.main``."""
    from asyncdiloco.cli.app import main as run

    run(argv)


__all__ = ["main"]
