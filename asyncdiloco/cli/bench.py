"""``asyncdiloco bench``: the sync-vs-async suite (virtual or real clock) or the perf
micro-benchmarks; prints the suite's markdown report."""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run a benchmark suite (JSON lines + markdown summary)")
    p.add_argument(
        "--suite",
        choices=["quick", "full", "perf"],
        default="quick",
        help="quick/full: sync vs async methods on speed profiles; "
        "perf: transport, server and overlap micro-benchmarks",
    )
    p.add_argument(
        "--clock",
        choices=["virtual", "real"],
        default="virtual",
        help="virtual: deterministic one-process simulator (same server code, virtual time); "
        "real: server and worker processes on 127.0.0.1",
    )
    p.add_argument("--out", default="", help="output folder (default bench-SUITE-CLOCK, or perf-out)")
    p.add_argument("--sizes", default="4,64,256", help="perf: model sizes in MiB (default 4,64,256)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.suite == "perf":
        cmd = [sys.executable, "-m", "asyncdiloco.bench.perf.perf_suite", "--out", args.out or "perf-out"]
        return subprocess.run([*cmd, "--sizes", args.sizes], check=False).returncode
    out = args.out or f"bench-{args.suite}-{args.clock}"
    if args.clock == "real":
        from asyncdiloco.bench.suite_real import REAL_SUITES, run_real_suite

        run_real_suite(REAL_SUITES[args.suite], out, progress=not args.no_progress)
    else:
        from asyncdiloco.bench.suite import SUITES, run_suite

        run_suite(SUITES[args.suite], out, progress=not args.no_progress)
    print((pathlib.Path(out) / "report.md").read_text(), flush=True)
    return 0
