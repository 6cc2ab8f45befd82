"""The ``asyncdiloco`` command: the parser built from the subcommands (one module each),
logging, and the one-line error report: a library error exits with status 2 (bad
configuration) or 1 (could not run), a closed stdout pipe (``| head``) with 1 and no traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from asyncdiloco.cli import bench, demo, export, launch, server, status, worker
from asyncdiloco.cli import eval as evaluate
from asyncdiloco.errors import AsyncDiLoCoError, ConfigError

#: The subcommands, in the order --help lists them.
SUBCOMMANDS = (server, worker, demo, bench, status, evaluate, export, launch)

#: Subcommands whose process, run from the command line, ends with ``os._exit`` once the
#: command returned and the logs and standard streams are flushed: their ``run`` closes
#: every file it wrote (stats file, training log, TensorBoard, state folder; the server's
#: final checkpoint and store) and leaves no thread with work to finish, so the
#: interpreter's teardown (torch's, 1.5-2 s of CPU on a loaded 2-core machine, per
#: process; docs/performance.md, "Sync mode end to end") only delays the exit.
FAST_EXIT = ("server", "worker")


def _setup_logging(verbose: int) -> None:
    level = logging.WARNING if verbose < 0 else logging.INFO if verbose == 0 else logging.DEBUG
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: global flags, then one subparser per subcommand."""
    parser = argparse.ArgumentParser(
        prog="asyncdiloco", description="Asynchronous DiLoCo parameter server and workers."
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    parser.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in SUBCOMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    """Run ``asyncdiloco ARGV`` (default: ``sys.argv[1:]``) and exit with its status."""
    command = None
    try:
        code, command = _run(argv)
    except BrokenPipeError:
        code = _reader_went_away()
    if argv is None and command in FAST_EXIT:  # the process's own command line, not a caller's
        _exit_now(code)
    sys.exit(code)


def _exit_now(code: int) -> None:
    """Flush the logs and the standard streams, then end the process without the
    interpreter's teardown (``FAST_EXIT``)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or its reader went away
            pass
    os._exit(code)


def _reader_went_away() -> int:
    """stdout's reader closed the pipe (``asyncdiloco status | head -5``): exit 1 without a
    traceback, the Python docs' recipe (library/signal.html, "Note on SIGPIPE"): stdout
    goes to /dev/null, so the interpreter's last flush at exit does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # a stdout without a descriptor (an embedding caller's)
        pass
    return 1


def _run(argv: list[str] | None) -> tuple[int, str]:
    """(exit status, subcommand) of ``asyncdiloco ARGV``."""
    args = build_parser().parse_args(argv)
    _setup_logging(-1 if args.quiet else args.verbose)
    try:
        code = args.func(args)
    except ConfigError as exc:
        print(f"asyncdiloco {args.command}: error: {exc}", file=sys.stderr)
        code = 2
    except AsyncDiLoCoError as exc:
        print(f"asyncdiloco {args.command}: error: {exc}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        code = 130
    return code, args.command
