"""``python -m asyncdiloco`` is the ``asyncdiloco`` command."""

from asyncdiloco.cli.app import main

if __name__ == "__main__":
    main()
