"""``asyncdiloco demo``: a server and N workers of different speeds on loopback, with a
held-out loss curve and a report (bench/demo.py runs it).

The server flags are the server's own (flags.SERVER_RUN), checked here before any
process starts and handed to the demo's server process as the flags that rebuild the
same configuration; the model flags go to every worker the same way.
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import signal
import time

from asyncdiloco.errors import ConfigError
from asyncdiloco.flags.settings import JOB, SERVER_RUN
from asyncdiloco.ps.config import ServerConfig

log = logging.getLogger(__name__)

#: The demo runs the server's own defaults (the async default is what the benchmark suite
#: shows to win); only the sync join timeout differs, per mode, where the flag is not
#: given: a sync round waits for its slowest member, and the demo's workers run up to 3x
#: slower than the fastest, so the join timeout must exceed about 2 H steps of the slowest,
#: or a loaded machine cuts that worker out of rounds and its steps are discarded.
DEMO_JOIN_TIMEOUT_S = {"async": 10.0, "sync": 30.0}


def add_parser(sub: argparse._SubParsersAction) -> None:
    from asyncdiloco.bench.demo import DemoConfig

    d = DemoConfig()
    p = sub.add_parser(
        "demo",
        help="server + N workers of different speeds on loopback, with a report",
        description="A server and N worker processes of different speeds on 127.0.0.1 train the default job "
        "until the server has applied --max-tokens (or --max-seconds of training passed, whichever first); "
        "the held-out loss before, at the stop and after the workers' closing pushes, a report and its plots "
        "are written to --out.",
    )
    g = p.add_argument_group("the demo")
    g.add_argument(
        "--workers", type=int, default=d.num_workers, help="number of worker processes (default %(default)s)"
    )
    g.add_argument(
        "--max-tokens",
        "--token-budget",
        dest="max_tokens",
        type=int,
        default=d.token_budget,
        metavar="TOKENS",
        help="stop the workers once the server has applied this many tokens, so the result does not depend on "
        "the machine's speed; 0: no budget, only --max-seconds (default %(default)s: about 2 minutes of "
        "training on a quiet 2-core machine)",
    )
    g.add_argument(
        "--max-seconds",
        type=float,
        default=d.max_seconds,
        help="the cap: stop the workers after this many seconds of training if the token budget is not spent "
        "(default %(default)g)",
    )
    g.add_argument(
        "--out", default=d.out_dir, help="folder for report.json, loss_curve.png and logs (default %(default)s)"
    )
    g.add_argument(
        "--slowdowns", default="", help="comma-separated speed factors, one per worker (default: cycles 1,1.5,2,3)"
    )
    g.add_argument(
        "--eval-every",
        type=float,
        default=d.eval_every_s,
        help="seconds between held-out evaluations (default %(default)g)",
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument(
        "--overlap", action="store_true", help="workers push and pull in the background while training on (async only)"
    )
    g.add_argument(
        "--shards",
        type=int,
        default=d.shards,
        metavar="S",
        help="run the server as S parameter-server shards (asyncdiloco server --shards S; async only); "
        "the evaluator assembles the model from every shard (default %(default)s: one unsharded server)",
    )
    join = ", ".join(f"{mode} {s:g}" for mode, s in DEMO_JOIN_TIMEOUT_S.items())
    SERVER_RUN.add_to(p, default_means={"--quorum-wait-s": f"the demo's own: {join}"})
    JOB.add_to(p)
    p.set_defaults(func=run)


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The demo server's configuration (on 127.0.0.1, a free port) from the parsed flags."""
    given = SERVER_RUN.given(args)
    given.setdefault("sync.join_timeout_s", DEMO_JOIN_TIMEOUT_S[given.get("mode", ServerConfig.mode)])
    return SERVER_RUN.build(given, host="127.0.0.1", port=0)


def _token_budget(tokens: int | None) -> int | None:
    """``--max-tokens``: 0 (or none) means no budget.

    Raises:
        ConfigError: a negative number of tokens.
    """
    if tokens is not None and tokens < 0:
        raise ConfigError(f"--max-tokens {tokens} is invalid: give tokens >= 1, or 0 for no budget (--max-seconds)")
    return tokens or None


def _slowdowns(text: str) -> tuple[float, ...] | None:
    try:
        return tuple(float(s) for s in text.split(",")) if text else None
    except ValueError:
        raise ConfigError(
            f"--slowdowns {text!r} is invalid: give numbers >= 1 separated by commas, e.g. 1,2,4"
        ) from None


def run(args: argparse.Namespace) -> int:
    from asyncdiloco.bench.demo import DemoConfig, run_demo

    slowdowns = _slowdowns(args.slowdowns)
    server = server_config(args)  # a bad server flag is refused here, naming the value
    if args.overlap and server.mode == "sync":
        raise ConfigError("--overlap is invalid with --mode sync: a sync round is a barrier; drop --overlap")
    cfg = DemoConfig(
        mode=server.mode,
        num_workers=args.workers,
        max_seconds=args.max_seconds,
        out_dir=args.out,
        slowdowns=slowdowns,
        server_args=SERVER_RUN.argv(server),
        job=JOB.build(JOB.given(args)),
        eval_every_s=args.eval_every,
        worker_args=("--overlap",) if args.overlap else (),
        shards=args.shards,
        token_budget=_token_budget(args.max_tokens),
    )
    _warn_if_overwriting(cfg.out_dir)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM reaps the children like Ctrl-C
    report = run_demo(cfg, progress=not args.no_progress)
    return 0 if report["final_eval_loss"] < report["initial_eval_loss"] else 1


def _warn_if_overwriting(out_dir: str) -> None:
    """Say so when ``out_dir`` holds an earlier run: its report, plot and logs are replaced."""
    report = pathlib.Path(out_dir) / "report.json"
    if report.exists():
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(report.stat().st_mtime))
        log.warning(
            "%s holds an earlier demo run (report.json of %s); this run overwrites its report, plot and logs "
            "(give --out DIR to keep it)",
            out_dir,
            when,
        )
