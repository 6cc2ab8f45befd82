"""The ``asyncdiloco`` command: ``server``, ``worker`` and ``demo`` subcommands.

Thin: parses flags into the config dataclasses, configures logging, and calls the
library. Errors from the library are printed as one line and exit with status 2
(bad configuration) or 1 (could not run).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time

from asyncdiloco.algo.config import ASYNC_OUTER, OUTER_OPTIMIZERS, STALENESS_WEIGHTINGS, SYNC_OUTER, OuterConfig
from asyncdiloco.algo.lr_schedule import LR_SCHEDULES
from asyncdiloco.algo.schedule import GROUPINGS
from asyncdiloco.errors import AsyncDiLoCoError, ConfigError
from asyncdiloco.ps.config import MODES, SYNC_WEIGHTINGS, DurabilityConfig, ServerConfig, SyncConfig
from asyncdiloco.wire.codec import WIRE_CODECS
from asyncdiloco.wire.security import ClientSecurityConfig, ServerSecurityConfig
from asyncdiloco.worker.config import SyncWorkerConfig, WorkerConfig

log = logging.getLogger("asyncdiloco.cli.app")


def _setup_logging(verbose: int) -> None:
    level = logging.WARNING if verbose < 0 else logging.INFO if verbose == 0 else logging.DEBUG
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def _add_server_args(p: argparse.ArgumentParser) -> None:
    d, o, sc = ServerConfig(), OuterConfig(), SyncConfig()
    p.add_argument(
        "--mode",
        choices=MODES,
        default=d.mode,
        help="async: apply pushes on arrival; sync: quorum rounds with an allreduce (default %(default)s)",
    )
    p.add_argument(
        "--min-workers", type=int, default=sc.min_workers, help="sync: workers a quorum needs (default %(default)s)"
    )
    p.add_argument(
        "--join-timeout-s",
        type=float,
        default=sc.join_timeout_s,
        help="sync: seconds after a round's first request after which a quorum forms without missing "
        "members (default %(default)s)",
    )
    p.add_argument(
        "--round-timeout-s",
        type=float,
        default=sc.round_timeout_s,
        help="sync: seconds from a quorum's formation by which every member must vote (default %(default)s)",
    )
    p.add_argument(
        "--sync-weighting",
        choices=SYNC_WEIGHTINGS,
        default=sc.weighting,
        help="sync: mean or token-weighted mean of the pseudo-gradients (default %(default)s)",
    )
    p.add_argument(
        "--store-port",
        type=int,
        default=sc.store_port,
        help="sync: port of the rendezvous store (default %(default)s = a free one)",
    )
    p.add_argument(
        "--local-steps",
        "-H",
        type=int,
        default=d.local_steps,
        help="H, inner steps between pushes (default %(default)s)",
    )
    p.add_argument(
        "--outer-optimizer",
        choices=OUTER_OPTIMIZERS,
        default=None,
        help=f"outer optimizer (default: async {ASYNC_OUTER.optimizer}, sync {SYNC_OUTER.optimizer})",
    )
    p.add_argument(
        "--outer-lr",
        type=float,
        default=None,
        help=f"outer learning rate η (default: async {ASYNC_OUTER.lr:g}, sync {SYNC_OUTER.lr:g})",
    )
    p.add_argument(
        "--outer-momentum",
        type=float,
        default=None,
        help=f"outer momentum μ (default: async {ASYNC_OUTER.momentum:g}, sync {SYNC_OUTER.momentum:g})",
    )
    p.add_argument(
        "--staleness",
        choices=STALENESS_WEIGHTINGS,
        default=None,
        help=f"staleness weighting s(τ) (default {ASYNC_OUTER.staleness})",
    )
    p.add_argument(
        "--staleness-a",
        type=float,
        default=o.staleness_a,
        help="a: polynomial exponent / hinge slope (default %(default)s)",
    )
    p.add_argument(
        "--staleness-b", type=int, default=o.staleness_b, help="b: hinge grace, versions (default %(default)s)"
    )
    p.add_argument(
        "--max-staleness",
        type=int,
        default=o.max_staleness,
        help="refuse pushes staler than this many versions (default %(default)s)",
    )
    p.add_argument(
        "--dn-buffer",
        type=int,
        default=o.dn_buffer,
        help="delayed_nesterov: N arrivals per momentum update (0 = number of workers)",
    )
    p.add_argument("--dn-c", type=float, default=o.dn_c, help="delayed_nesterov: c in [0, 1/N] (default %(default)s)")
    p.add_argument(
        "--outer-lr-schedule",
        choices=LR_SCHEDULES,
        default=o.lr_schedule,
        help="schedule of η by version (updates applied so far): constant, or cosine decay to "
        "--outer-min-lr-ratio·η at --outer-total-versions; both after a linear warmup (default %(default)s)",
    )
    p.add_argument(
        "--outer-warmup-versions",
        type=int,
        default=o.lr_warmup_versions,
        help="versions of linear warmup of η, 0 = none (default %(default)s)",
    )
    p.add_argument(
        "--outer-total-versions",
        type=int,
        default=o.lr_total_versions,
        help="cosine: the version from which η stays at its floor; must exceed the warmup (default %(default)s)",
    )
    p.add_argument(
        "--outer-min-lr-ratio",
        type=float,
        default=o.lr_min_ratio,
        help="cosine: η's floor as a fraction of --outer-lr (default %(default)s)",
    )
    p.add_argument(
        "--chunk-bytes", type=int, default=d.chunk_bytes, help="payload chunk size in bytes (default %(default)s)"
    )
    p.add_argument(
        "--lease-s",
        type=float,
        default=d.lease_s,
        help="seconds of silence before a worker is dropped (default %(default)s)",
    )
    p.add_argument(
        "--max-payload-bytes",
        type=int,
        default=d.max_payload_bytes,
        help="largest model accepted, bytes (default %(default)s)",
    )
    p.add_argument(
        "--max-abs-value",
        type=float,
        default=d.max_abs_value,
        help="refuse pushed values larger in magnitude (default %(default)g)",
    )
    p.add_argument(
        "--receive-buffer-mib",
        type=float,
        default=d.receive_buffer_bytes / 2**20,
        help="MiB of push receive buffers in use at once; more pushes wait (default %(default)g)",
    )
    p.add_argument(
        "--pull-snapshots",
        type=int,
        default=d.pull_snapshots,
        help="most model versions encoded for pulls at once, one payload of memory each (default %(default)s)",
    )
    p.add_argument(
        "--dylu",
        action=argparse.BooleanOptionalAction,
        default=d.dylu,
        help="Dynamic Local Updates: H_w = floor(v_w / max v * H) per worker, from the rates the workers "
        "report from their first round on (default: on)",
    )
    p.add_argument(
        "--grouping",
        choices=GROUPINGS,
        default=d.grouping,
        help="hold push replies until every expected worker pushed or the window ends (window), until the "
        "Delayed Nesterov buffer is complete (barrier), or not at all (off) (default %(default)s)",
    )
    p.add_argument(
        "--grace-s",
        type=_seconds_or_auto,
        default=d.grace_s,
        help="grouping window in seconds from a group's first push, or auto: one round of the fastest "
        "worker, at least 1.5 inner steps of the slowest (default auto)",
    )
    p.add_argument(
        "--group-max-wait-s",
        type=_seconds_or_auto,
        default=d.group_max_wait_s,
        help="barrier: the longest a push reply is held, seconds, or auto: the longest round (default auto)",
    )
    p.add_argument(
        "--block-check",
        action="store_true",
        help="delayed_nesterov: damp each tensor of a pseudo-gradient that opposes the outer momentum",
    )
    p.add_argument(
        "--wire-codec",
        choices=WIRE_CODECS,
        default=d.wire_codec,
        help="encoding of pushes and pulls: raw, bf16 (half the bytes, relative error <= 2^-8) or int8 "
        "(block-wise absmax, ~a quarter, error <= block absmax/254); async only (default %(default)s)",
    )
    p.add_argument(
        "--codec-block-size",
        type=int,
        default=d.codec_block_size,
        help="int8: elements per absmax block (default %(default)s)",
    )


def _seconds_or_auto(text: str) -> float | None:
    """A number of seconds, or "auto" (None)."""
    if text.strip().lower() == "auto":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds or 'auto'") from None


#: The demo runs the server's own defaults (the async default is what the benchmark suite
#: shows to win); only the sync join timeout differs, per mode, where the flag is not
#: given: a sync round waits for its slowest member, and the demo's workers run up to 3x
#: slower than the fastest, so the join timeout must exceed ~2 H slow steps (measured:
#: with 10 s the 3x worker was cut out of rounds on 2 cores, its steps discarded).
DEMO_JOIN_TIMEOUT_S = {"async": 10.0, "sync": 30.0}


def _server_config(args: argparse.Namespace, host: str, port: int) -> ServerConfig:
    base = ASYNC_OUTER if args.mode == "async" else SYNC_OUTER  # the mode's default, where a flag is not given
    outer = OuterConfig(
        optimizer=base.optimizer if args.outer_optimizer is None else args.outer_optimizer,
        lr=base.lr if args.outer_lr is None else args.outer_lr,
        momentum=base.momentum if args.outer_momentum is None else args.outer_momentum,
        staleness=base.staleness if args.staleness is None else args.staleness,
        staleness_a=args.staleness_a,
        staleness_b=args.staleness_b,
        max_staleness=args.max_staleness,
        dn_buffer=args.dn_buffer,
        dn_c=args.dn_c,
        block_check=args.block_check,
        lr_schedule=args.outer_lr_schedule,
        lr_warmup_versions=args.outer_warmup_versions,
        lr_total_versions=args.outer_total_versions,
        lr_min_ratio=args.outer_min_lr_ratio,
    )
    durability = security = None
    if getattr(args, "checkpoint_dir", None):
        durability = DurabilityConfig(
            checkpoint_dir=args.checkpoint_dir,
            checkpoint_every=args.checkpoint_every,
            fallback_to_previous=args.fallback_to_previous,
            fsync=not args.no_fsync,
        )
    elif getattr(args, "fallback_to_previous", False):
        raise ConfigError("--fallback-to-previous needs --checkpoint-dir DIR")
    if any(getattr(args, n, None) for n in ("token_file", "tls_cert", "tls_key", "tls_client_ca")):
        security = ServerSecurityConfig(
            token_file=args.token_file, tls_cert=args.tls_cert, tls_key=args.tls_key, tls_client_ca=args.tls_client_ca
        )
    sync = SyncConfig(
        min_workers=args.min_workers,
        join_timeout_s=args.join_timeout_s,
        round_timeout_s=args.round_timeout_s,
        weighting=args.sync_weighting,
        store_port=args.store_port,
    )
    return ServerConfig(
        host=host,
        port=port,
        outer=outer,
        local_steps=args.local_steps,
        chunk_bytes=args.chunk_bytes,
        lease_s=args.lease_s,
        dylu=args.dylu,
        grouping=args.grouping,
        grace_s=args.grace_s,
        group_max_wait_s=args.group_max_wait_s,
        max_payload_bytes=args.max_payload_bytes,
        max_abs_value=args.max_abs_value,
        receive_buffer_bytes=int(args.receive_buffer_mib * 2**20),
        pull_snapshots=args.pull_snapshots,
        durability=durability,
        security=security,
        mode=args.mode,
        sync=sync,
        wire_codec=args.wire_codec,
        codec_block_size=args.codec_block_size,
        bulk_port=getattr(args, "bulk_port", None),
    )


def _add_server_ops_args(p: argparse.ArgumentParser) -> None:
    """Durability and security flags of ``asyncdiloco server`` (see server/README.md)."""
    d = DurabilityConfig(checkpoint_dir="unused")
    p.add_argument("--checkpoint-dir", help="keep checkpoints and a write-ahead log here; resume from them on start")
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=d.checkpoint_every,
        help="applied pushes between checkpoints (default %(default)s)",
    )
    p.add_argument(
        "--fallback-to-previous",
        action="store_true",
        help="if the newest checkpoint is corrupt, resume from the previous one instead of refusing to start",
    )
    p.add_argument(
        "--no-fsync",
        action="store_true",
        help="do not fsync the log before acknowledging (survives a killed process, not a power loss)",
    )
    p.add_argument("--token-file", help="require the token in this file's first line on every call")
    p.add_argument("--tls-cert", help="PEM certificate chain of the server (with --tls-key: serve TLS)")
    p.add_argument("--tls-key", help="PEM private key of the server")
    p.add_argument("--tls-client-ca", help="PEM CA that client certificates must chain to (mutual TLS)")


def _add_client_security_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--token-file", help="send the token in this file's first line (the server's --token-file)")
    p.add_argument("--tls-ca", help="PEM CA to verify the server's certificate with (connect over TLS)")
    p.add_argument("--tls-cert", help="PEM client certificate, for a server with --tls-client-ca")
    p.add_argument("--tls-key", help="PEM private key of the client certificate")
    p.add_argument("--tls-server-name", help="name expected in the server's certificate, if not the host in --server")


def _client_security(args: argparse.Namespace) -> ClientSecurityConfig | None:
    if not any((args.token_file, args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)):
        return None
    return ClientSecurityConfig(
        token_file=args.token_file,
        tls_ca=args.tls_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_server_name=args.tls_server_name,
    )


def _add_job_args(p: argparse.ArgumentParser) -> None:
    from asyncdiloco.job.config import JobConfig

    d = JobConfig()
    p.add_argument(
        "--batch-size", type=int, default=d.batch_size, help=f"sequences per inner step (default {d.batch_size})"
    )
    p.add_argument(
        "--context-len", type=int, default=d.context_len, help=f"characters per sequence (default {d.context_len})"
    )
    p.add_argument("--n-layer", type=int, default=d.n_layer, help=f"transformer blocks (default {d.n_layer})")
    p.add_argument("--n-embd", type=int, default=d.n_embd, help=f"model width (default {d.n_embd})")
    p.add_argument("--n-head", type=int, default=d.n_head, help=f"attention heads (default {d.n_head})")
    p.add_argument("--inner-lr", type=float, default=d.inner_lr, help=f"AdamW learning rate (default {d.inner_lr})")
    p.add_argument("--seed", type=int, default=d.seed, help="model init and data order seed (default %(default)s)")


def _add_inner_schedule_args(p: argparse.ArgumentParser) -> None:
    """The inner lr's schedule, keyed by this worker's own inner step (worker only)."""
    from asyncdiloco.job.config import JobConfig

    d = JobConfig()
    p.add_argument(
        "--inner-lr-schedule",
        choices=LR_SCHEDULES,
        default=d.inner_lr_schedule,
        help="schedule of --inner-lr by inner step: constant, or cosine decay to --inner-min-lr-ratio·lr "
        "at --inner-total-steps; both after a linear warmup (default %(default)s)",
    )
    p.add_argument(
        "--inner-warmup-steps",
        type=int,
        default=d.inner_warmup_steps,
        help="inner steps of linear warmup, 0 = none (default %(default)s)",
    )
    p.add_argument(
        "--inner-total-steps",
        type=int,
        default=d.inner_total_steps,
        help="cosine: the inner step from which the lr stays at its floor; must exceed the warmup "
        "(default %(default)s)",
    )
    p.add_argument(
        "--inner-min-lr-ratio",
        type=float,
        default=d.inner_min_ratio,
        help="cosine: the floor as a fraction of --inner-lr (default %(default)s)",
    )


def _job_config(args: argparse.Namespace):
    from asyncdiloco.job.config import JobConfig

    return JobConfig(
        batch_size=args.batch_size,
        context_len=args.context_len,
        n_layer=args.n_layer,
        n_embd=args.n_embd,
        n_head=args.n_head,
        inner_lr=args.inner_lr,
        seed=args.seed,
    )


# ------------------------------------------------------------------ server
def cmd_server(args: argparse.Namespace) -> int:
    import torch

    from asyncdiloco._malloc import keep_large_blocks
    from asyncdiloco.ps import ParameterServer

    torch.set_num_threads(1)  # PERF-NOTES: avoids stalls when the cores are shared
    keep_large_blocks()  # PERF-NOTES: reuse payload-sized memory instead of faulting it in again
    server = ParameterServer(_server_config(args, args.host, args.port)).start()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # before announcing: a caller may signal right after
        signal.signal(sig, lambda *_: stop.set())
    if args.port_file:  # written before the "listening" line, which tells watchers it is ready
        tmp = f"{args.port_file}.tmp"
        with open(tmp, "w") as f:
            f.write(f"{server.port}\n")
        os.replace(tmp, args.port_file)
    print(f"asyncdiloco server listening on {server.address}", flush=True)
    if server.config.mode == "sync":
        print(f"asyncdiloco server (mode sync) hosts the rendezvous store on port {server.store_port}", flush=True)
    if server.bulk_port:
        print(f"asyncdiloco server: bulk data channel on port {server.bulk_port}", flush=True)
    stop.wait()
    server.stop(grace_s=2.0)  # then the final checkpoint, when --checkpoint-dir is set
    st = server.state.status()
    rounds = (
        f", {st.rounds_committed} rounds committed, {st.rounds_failed} aborted" if server.config.mode == "sync" else ""
    )
    print(
        f"asyncdiloco server stopped at version {st.version}: {st.applied_pushes} pushes applied, "
        f"{st.rejected_pushes} refused, {st.pulls} pulls{rounds}",
        flush=True,
    )
    return 0


# ------------------------------------------------------------------ worker
def cmd_worker(args: argparse.Namespace) -> int:
    import torch

    from asyncdiloco._malloc import keep_large_blocks
    from asyncdiloco.cli.train import run_worker
    from asyncdiloco.job.slowdown import parse_slowdown_changes

    if args.threads < 1:
        raise ConfigError(f"--threads {args.threads} is invalid: give 1 or more torch intra-op threads")
    began: list[float] = []  # when training began (wall clock), once it has
    stop = threading.Event()

    def on_sigterm(*_: object) -> None:
        # The first SIGTERM ends training after the current inner step (an interrupt in the
        # middle of a push or pull could leave the client half-way; it hung close() after
        # Leave); the worker then pushes its last Δ and leaves. A second one interrupts.
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    signal.signal(signal.SIGTERM, on_sigterm)

    def wait_for_file() -> bool:  # started early, its start-up done: join once the file appears
        while not os.path.exists(args.join_when_file) and not stop.is_set():
            time.sleep(0.05)
        return not stop.is_set()

    torch.set_num_threads(args.threads)
    keep_large_blocks()
    wcfg = WorkerConfig(
        server=args.server,
        worker_name=args.name or f"worker-{args.worker_index}@{os.uname().nodename}",
        join_timeout_s=args.join_timeout,
        security=_client_security(args),
        overlap=args.overlap,
        bulk_channel=not args.no_bulk_channel,
    )
    if args.max_steps is None and args.max_seconds is None:
        raise ConfigError("give --max-steps N or --max-seconds S (or both) so the worker stops")
    sync = None
    if args.mode == "sync":
        if args.overlap:
            raise ConfigError("--overlap is invalid with --mode sync: a sync round is a barrier; drop --overlap")
        sync = SyncWorkerConfig(
            allreduce_timeout_s=args.allreduce_timeout_s,
            quorum_timeout_s=args.quorum_timeout_s,
            collective_host=args.collective_host,
        )
    job = dataclasses.replace(
        _job_config(args), inner_lr_schedule=args.inner_lr_schedule, inner_warmup_steps=args.inner_warmup_steps,
        inner_total_steps=args.inner_total_steps, inner_min_ratio=args.inner_min_lr_ratio,
    )  # fmt: skip
    stats = run_worker(
        worker_config=wcfg,
        job=job,
        worker_index=args.worker_index,
        slowdown=args.slowdown,
        slowdown_changes=parse_slowdown_changes(args.slowdown_changes),
        max_steps=args.max_steps,
        max_seconds=args.max_seconds,
        sync=sync,
        on_start=lambda: began.append(time.time()),
        stop=stop,
        wait_to_join=wait_for_file if args.join_when_file else None,
    )
    summary = dataclasses.asdict(stats)
    summary.update(
        worker_index=args.worker_index,
        slowdown=args.slowdown,
        slowdown_changes=args.slowdown_changes,
        name=wcfg.worker_name,
    )
    if began:  # when it began training, on the wall clock (the demo's report aligns processes by it)
        summary["train_started_unix_s"] = began[0]
    if args.stats_file:
        with open(args.stats_file, "w") as f:
            json.dump(summary, f)
    if sync is not None:
        print(
            f"{wcfg.worker_name}: {stats.inner_steps} inner steps, {stats.rounds_committed} rounds committed, "
            f"{stats.rounds_failed} aborted, {stats.heals} heals, idle {stats.idle_s:.1f} s",
            flush=True,
        )
        return 0
    print(
        f"{wcfg.worker_name}: {stats.inner_steps} inner steps, {stats.pushes_applied} pushes applied, "
        f"{stats.pushes_refused} refused, {stats.sync_failures} failed syncs, blocked {stats.blocked_s:.1f} s "
        f"of {stats.wall_s:.1f} s",
        flush=True,
    )
    return 0


# -------------------------------------------------------------------- demo
def cmd_demo(args: argparse.Namespace) -> int:
    from asyncdiloco.bench.demo import DemoConfig, run_demo

    try:
        slowdowns = [float(s) for s in args.slowdowns.split(",")] if args.slowdowns else None
    except ValueError:
        raise ConfigError(
            f"--slowdowns {args.slowdowns!r} is invalid: give numbers >= 1 separated by commas, e.g. 1,2,4"
        ) from None
    if args.join_timeout_s is None:
        args.join_timeout_s = DEMO_JOIN_TIMEOUT_S[args.mode]
    _server_config(args, "127.0.0.1", 0)  # a bad server flag is refused here, naming the value
    if args.overlap and args.mode == "sync":
        raise ConfigError("--overlap is invalid with --mode sync: a sync round is a barrier; drop --overlap")
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)  # SIGTERM reaps the children like Ctrl-C
    cfg = DemoConfig(
        mode=args.mode,
        num_workers=args.workers,
        max_seconds=args.max_seconds,
        out_dir=args.out,
        slowdowns=tuple(slowdowns) if slowdowns else None,
        server_args=_server_flags(args),
        job=_job_config(args),
        eval_every_s=args.eval_every,
        worker_args=("--overlap",) if args.overlap else (),
    )
    report = run_demo(cfg, progress=not args.no_progress)
    return 0 if report["final_eval_loss"] < report["initial_eval_loss"] else 1


def _raise_keyboard_interrupt(*_: object) -> None:
    raise KeyboardInterrupt


# ------------------------------------------------------------------- bench
def cmd_bench(args: argparse.Namespace) -> int:
    import pathlib
    import subprocess

    if args.suite in ("quick", "full"):
        out = args.out or f"bench-{args.suite}-{args.clock}"
        if args.clock == "real":
            from asyncdiloco.bench.suite_real import REAL_SUITES, run_real_suite

            run_real_suite(REAL_SUITES[args.suite], out, progress=not args.no_progress)
        else:
            from asyncdiloco.bench.suite import SUITES, run_suite

            run_suite(SUITES[args.suite], out, progress=not args.no_progress)
        print((pathlib.Path(out) / "report.md").read_text(), flush=True)
        return 0
    cmd = [
        sys.executable,
        "-m",
        "asyncdiloco.bench.perf.perf_suite",
        "--out",
        args.out or "perf-out",
        "--sizes",
        args.sizes,
    ]
    return subprocess.run(cmd, check=False).returncode


def _server_flags(args: argparse.Namespace) -> tuple[str, ...]:
    given = [(flag, getattr(args, name)) for flag, name in (("--outer-optimizer", "outer_optimizer"),
             ("--outer-lr", "outer_lr"), ("--outer-momentum", "outer_momentum"), ("--staleness", "staleness"),
             ("--grace-s", "grace_s"), ("--group-max-wait-s", "group_max_wait_s"))]  # fmt: skip
    return (
        *(x for flag, value in given if value is not None for x in (flag, str(value))),
        "--local-steps", str(args.local_steps),
        "--staleness-a", str(args.staleness_a),
        "--staleness-b", str(args.staleness_b),
        "--max-staleness", str(args.max_staleness),
        "--dn-buffer", str(args.dn_buffer),
        "--dn-c", str(args.dn_c),
        "--outer-lr-schedule", args.outer_lr_schedule,
        "--outer-warmup-versions", str(args.outer_warmup_versions),
        "--outer-total-versions", str(args.outer_total_versions),
        "--outer-min-lr-ratio", str(args.outer_min_lr_ratio),
        "--chunk-bytes", str(args.chunk_bytes),
        "--lease-s", str(args.lease_s),
        "--grouping", args.grouping,
        "--max-payload-bytes", str(args.max_payload_bytes),
        "--max-abs-value", str(args.max_abs_value),
        "--receive-buffer-mib", str(args.receive_buffer_mib),
        "--pull-snapshots", str(args.pull_snapshots),
        "--dylu" if args.dylu else "--no-dylu",
        *(("--block-check",) if args.block_check else ()),
        "--mode", args.mode,
        "--min-workers", str(args.min_workers),
        "--join-timeout-s", str(args.join_timeout_s),
        "--round-timeout-s", str(args.round_timeout_s),
        "--sync-weighting", args.sync_weighting,
        "--wire-codec", args.wire_codec,
        "--codec-block-size", str(args.codec_block_size),
    )  # fmt: skip


# -------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asyncdiloco", description="Asynchronous DiLoCo parameter server and workers."
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    parser.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only")
    sub = parser.add_subparsers(dest="command", required=True)

    ps = sub.add_parser("server", help="run the parameter server")
    ps.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1; 0.0.0.0 = all)")
    ps.add_argument("--port", type=int, default=29500, help="TCP port (default 29500; 0 = pick a free one)")
    ps.add_argument("--port-file", help="write the bound port to this file once listening")
    ps.add_argument(
        "--bulk-port",
        type=int,
        default=None,
        help="also serve push/pull payloads as raw bytes on this TCP port (same host, token and TLS; "
        "0 = pick a free one; default: off, gRPC only). Workers learn the port on Join",
    )
    _add_server_args(ps)
    _add_server_ops_args(ps)
    ps.set_defaults(func=cmd_server)

    pw = sub.add_parser(
        "worker",
        help="run one worker training the default model on the default data",
        description="One asynchronous DiLoCo worker. H and the outer optimizer are the server's (set them on "
        "`asyncdiloco server`); the flags here choose the worker's model, data order, speed and run length.",
    )
    pw.add_argument("--server", required=True, help="HOST:PORT of the parameter server")
    pw.add_argument(
        "--worker-index", type=int, default=0, help="selects this worker's data order (default %(default)s)"
    )
    pw.add_argument("--name", default="", help="name in the server's status (default worker-I@host)")
    pw.add_argument(
        "--slowdown",
        type=float,
        default=1.0,
        help="run F times slower, to emulate a weaker machine (default %(default)s)",
    )
    pw.add_argument(
        "--slowdown-changes",
        default="",
        metavar="T1:F1,T2:F2",
        help="from T seconds of training on, run F times slower instead (times increasing, F >= 1); "
        "emulates a machine whose speed changes (default: none)",
    )
    pw.add_argument(
        "--join-when-file",
        default=None,
        metavar="PATH",
        help="start up, then wait until PATH exists before joining (the demo starts a rejoining "
        "worker early this way, so its start-up is not part of the time away)",
    )
    pw.add_argument("--max-steps", type=int, help="stop after N inner steps")
    pw.add_argument("--max-seconds", type=float, help="stop after S seconds of training")
    pw.add_argument("--join-timeout", type=float, default=30.0, help="seconds to keep trying to join (default 30)")
    pw.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    pw.add_argument("--stats-file", help="write the worker's final counters as JSON here")
    pw.add_argument(
        "--overlap",
        action="store_true",
        help="push and pull in the background while the next inner steps run, then merge (async only)",
    )
    pw.add_argument(
        "--no-bulk-channel",
        action="store_true",
        help="push and pull over gRPC even when the server offers a bulk data channel",
    )
    _add_client_security_args(pw)
    sw = SyncWorkerConfig()
    pw.add_argument("--mode", choices=MODES, default="async", help="must match the server's --mode (default async)")
    pw.add_argument(
        "--allreduce-timeout-s",
        type=float,
        default=sw.allreduce_timeout_s,
        help="sync: seconds a process-group build or allreduce may take (default %(default)s)",
    )
    pw.add_argument(
        "--quorum-timeout-s",
        type=float,
        default=sw.quorum_timeout_s,
        help="sync: seconds to wait for a quorum before training on locally (default %(default)s)",
    )
    pw.add_argument(
        "--collective-host",
        default=None,
        help="sync: address the gloo device binds (default 127.0.0.1 for a loopback server, else torch's)",
    )
    _add_job_args(pw)
    _add_inner_schedule_args(pw)
    pw.set_defaults(func=cmd_worker)

    pd = sub.add_parser("demo", help="server + N workers of different speeds on loopback, with a report")
    pd.add_argument("--workers", type=int, default=4, help="number of worker processes (default 4)")
    pd.add_argument("--max-seconds", type=float, default=120.0, help="training time per worker (default 120)")
    pd.add_argument(
        "--out", default="demo-out", help="folder for report.json, loss_curve.png and logs (default %(default)s)"
    )
    pd.add_argument(
        "--slowdowns", default="", help="comma-separated speed factors, one per worker (default: cycles 1,1.5,2,3)"
    )
    pd.add_argument(
        "--eval-every", type=float, default=5.0, help="seconds between held-out evaluations (default %(default)s)"
    )
    pd.add_argument("--no-progress", action="store_true", help="no progress bar")
    pd.add_argument(
        "--overlap", action="store_true", help="workers push and pull in the background while training on (async only)"
    )
    _add_server_args(pd)
    _add_job_args(pd)
    pd.set_defaults(func=cmd_demo, join_timeout_s=None)
    pb_ = sub.add_parser("bench", help="run a benchmark suite (JSON lines + markdown summary)")
    pb_.add_argument(
        "--suite",
        choices=["quick", "full", "perf"],
        default="quick",
        help="quick/full: sync vs async methods on speed profiles; perf: transport, server and overlap micro-benchmarks",
    )
    pb_.add_argument(
        "--clock",
        choices=["virtual", "real"],
        default="virtual",
        help="virtual: deterministic one-process simulator (same server code, virtual time); "
        "real: server and worker processes on 127.0.0.1",
    )
    pb_.add_argument("--out", default="", help="output folder (default bench-SUITE-CLOCK, or perf-out)")
    pb_.add_argument("--sizes", default="4,64,256", help="perf: model sizes in MiB (default 4,64,256)")
    pb_.add_argument("--no-progress", action="store_true", help="no progress bar")
    pb_.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
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
    sys.exit(code)
