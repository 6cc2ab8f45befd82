"""``asyncdiloco bench``: the sync-vs-async suite (virtual or real clock), the perf
micro-benchmarks, or the scale simulation; prints the suite's markdown report. The library's INFO lines are kept
out of the progress bar unless -v (``QUIET_LOGGERS``)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import pathlib
import subprocess
import sys
from collections.abc import Iterator, Sequence


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="run a benchmark suite (JSON lines + markdown summary)",
        description="Sync vs async DiLoCo on speed profiles (in a virtual-clock simulator, or real processes "
        "on 127.0.0.1), the transport and server micro-benchmarks, or --workers simulated workers against the "
        "server's state code (scale); writes JSON lines and a markdown report.",
    )
    p.add_argument(
        "--suite",
        choices=["quick", "full", "tier", "perf", "scale"],
        default="quick",
        help="quick: the outer η, μ of each compared method tuned on one grid, then sync vs async methods on "
        "the uneven, jittery, slow_link and non_iid profiles, 3 seeds; full: every profile, more methods, and a "
        "flat server vs the hierarchical tier on two regions; tier: only the latter; "
        "perf: transport, server and overlap micro-benchmarks; "
        "scale: --workers simulated workers on the virtual clock against the server's state code, "
        "with the shards they need (default %(default)s)",
    )
    p.add_argument(
        "--clock",
        choices=["virtual", "real"],
        default="virtual",
        help="virtual: deterministic one-process simulator (same server code, virtual time); "
        "real: server and worker processes on 127.0.0.1 (default %(default)s)",
    )
    p.add_argument("--out", default="", help="output folder (default bench-SUITE-CLOCK, or perf-out)")
    p.add_argument("--sizes", default="4,64,256", help="perf: model sizes in MiB (default 4,64,256)")
    p.add_argument("--workers", type=int, default=1000, help="scale: simulated workers (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="scale: seed of speeds, churn and noise (default %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


#: Loggers of the parts a benchmark runs in this process (servers, workers, the demo's
#: processes): their INFO lines would break the progress bar, so they log at WARNING
#: unless -v is given.
QUIET_LOGGERS = ("asyncdiloco.ps", "asyncdiloco.worker", "asyncdiloco.bench")


@contextlib.contextmanager
def quiet_logs(names: Sequence[str], verbose: int) -> Iterator[None]:
    """The loggers ``names`` at WARNING or above unless -v (``verbose`` ≥ 1); their levels
    are put back afterwards, as an in-process caller (a test) had them."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [lg.level for lg in loggers]
    if verbose < 1:
        for lg in loggers:
            lg.setLevel(max(logging.WARNING, lg.getEffectiveLevel()))
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


@contextlib.contextmanager
def _library_logs(verbose: int) -> Iterator[None]:
    """During the bench: the library's INFO lines only with -v, and every log line
    written through tqdm (``logging_redirect_tqdm``) so none tears the progress bar."""
    from tqdm.contrib.logging import logging_redirect_tqdm

    with quiet_logs(QUIET_LOGGERS, verbose), logging_redirect_tqdm():
        yield


def run(args: argparse.Namespace) -> int:
    with _library_logs(getattr(args, "verbose", 0)):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    if args.suite == "perf":
        cmd = [sys.executable, "-m", "asyncdiloco.bench.perf.perf_suite", "--out", args.out or "perf-out"]
        return subprocess.run([*cmd, "--sizes", args.sizes], check=False).returncode
    out = args.out or f"bench-{args.suite}-{args.clock}"
    if args.suite == "scale":
        from asyncdiloco._malloc import keep_large_blocks
        from asyncdiloco.bench.scale_report import run_scale
        from asyncdiloco.bench.sim_scale import ScaleConfig

        keep_large_blocks()  # as the server process: the apply cost is timed as a server pays it
        run_scale(ScaleConfig(workers=args.workers, seed=args.seed), out, progress=not args.no_progress)
    elif args.clock == "real":
        from asyncdiloco.bench.suite import run_suite
        from asyncdiloco.bench.suite_config import REAL_SUITES

        if args.suite not in REAL_SUITES:
            from asyncdiloco.errors import ConfigError

            raise ConfigError(
                f"--suite {args.suite} runs on the virtual clock only (its links are simulated): "
                f"drop --clock real, or choose --suite {' or '.join(REAL_SUITES)}"
            )

        run_suite(REAL_SUITES[args.suite], out, progress=not args.no_progress, clock="real")
    else:
        from asyncdiloco.bench.suite import run_suite
        from asyncdiloco.bench.suite_config import SUITES

        run_suite(SUITES[args.suite], out, progress=not args.no_progress)
    print((pathlib.Path(out) / "report.md").read_text(), flush=True)
    return 0
