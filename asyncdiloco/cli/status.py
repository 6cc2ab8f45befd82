"""``asyncdiloco status``: the run at a glance from the server's ``Status``, once or with
``--watch`` (tools/status_view.py; docs/operations.md, "Status from the command line").
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from asyncdiloco.errors import ConfigError, ServerUnavailableError, unreachable_message
from asyncdiloco.flags.settings import STATUS

#: Seconds between refreshes of ``--watch`` without a number.
WATCH_S = 2.0
#: Deadline of one Status call, seconds.
RPC_TIMEOUT_S = 5.0
_CLEAR = "\x1b[H\x1b[2J"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "status",
        help="show a running server's version, throughput, staleness and workers",
        description="The run at a glance: version, mode, outer settings, pushes/s, staleness, the newest "
        "held-out loss and one row per live worker.",
    )
    STATUS.add_to(p)
    g = p.add_argument_group("output")
    g.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=WATCH_S,
        default=None,
        metavar="S",
        help=f"refresh every S seconds until Ctrl-C (default when given without S: {WATCH_S:g}; default: once)",
    )
    g.add_argument("--json", action="store_true", help="print one JSON object (with --watch: one line per refresh)")
    g.add_argument("--all", action="store_true", help="also list workers that left or expired (default: live ones)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from asyncdiloco.tools.status_view import render, status_dict
    from asyncdiloco.worker.client import ParameterServerClient

    if args.watch is not None and not args.watch > 0:
        raise ConfigError(f"--watch {args.watch:g} is invalid: give seconds > 0 between refreshes, e.g. --watch 2")
    cfg = STATUS.build(STATUS.given(args))
    tty, tls = sys.stdout.isatty(), getattr(cfg.security, "tls_ca", None) is not None

    def show(client: ParameterServerClient) -> None:
        d = status_dict(client.status(), address=cfg.server, all_workers=args.all)
        if args.json:
            print(json.dumps(d) if args.watch else json.dumps(d, indent=2), flush=True)
        else:
            before, after = (_CLEAR, "") if tty else ("", "\n")  # a log of refreshes, one blank line apart
            print(before + render(d) + after if args.watch else render(d), flush=True)

    with ParameterServerClient(cfg.server, rpc_timeout_s=RPC_TIMEOUT_S, security=cfg.security) as client:
        try:
            show(client)
        except ServerUnavailableError as exc:
            raise ServerUnavailableError(unreachable_message(cfg.server, exc, tls=tls)) from None
        if args.watch is None:
            return 0
        try:
            while True:
                _sleep(args.watch)
                try:
                    show(client)
                except ServerUnavailableError as exc:
                    line = unreachable_message(cfg.server, exc, tls=tls)
                    print(f"asyncdiloco status: {line}; still watching", file=sys.stderr)
        except KeyboardInterrupt:
            pass
    return 0


def _sleep(seconds: float) -> None:
    """The pause between two refreshes (Ctrl-C ends it)."""
    time.sleep(seconds)
