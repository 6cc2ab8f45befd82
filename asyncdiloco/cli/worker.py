"""``asyncdiloco worker``: one worker process training the default job (train.py).

Every flag is checked and turned into the configs (and the PEM files loaded) before
anything process-wide is set (signal handler, torch threads, allocator), so a refused flag
leaves the process as it was. The first SIGTERM ends training after the current inner
step; the worker then pushes its last steps and leaves.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from asyncdiloco.cli.train_log import TENSORBOARD_FIX, TrainLogConfig, check_writable_folder
from asyncdiloco.errors import ConfigError
from asyncdiloco.flags.settings import SYNC_WORKER, WORKER, WORKER_JOB
from asyncdiloco.job.config import JobConfig
from asyncdiloco.ps.config import MODES
from asyncdiloco.wire.security import check_pem_files
from asyncdiloco.worker.config import SyncWorkerConfig, WorkerConfig


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "worker",
        help="run one worker training the default model on the default data",
        description="One DiLoCo worker, asynchronous (--mode async, the default) or synchronous (--mode sync, "
        "for a server started with --mode sync). H and the outer optimizer are the server's (set them on "
        "`asyncdiloco server`); the flags here choose the worker's model, data order, device, speed, run length "
        "and training logs.",
    )
    WORKER.add_to(p)
    _add_run_args(p)
    SYNC_WORKER.add_to(p)
    WORKER_JOB.add_to(p)
    _add_log_args(p)
    p.set_defaults(func=run)


def _add_run_args(p: argparse.ArgumentParser) -> None:
    """What ``run_worker`` takes besides the configs: data order, speed, bounds, outputs."""
    g = p.add_argument_group("this run")
    g.add_argument("--mode", choices=MODES, default="async", help="must match the server's --mode (default async)")
    g.add_argument(
        "--shard-map",
        default="",
        metavar="FILE",
        help='a sharded parameter server: JSON {"shards": ["host:port", ...]} (asyncdiloco server --shards S '
        "--shard-map FILE writes it); --server must be its shard 0 (default: none: --server is one server, "
        "or HOST:PORT,HOST:PORT,... shard 0 first)",
    )
    g.add_argument("--worker-index", type=int, default=0, help="selects this worker's data order (default %(default)s)")
    _add_pace_args(g)
    g.add_argument(
        "--join-when-file",
        default=None,
        metavar="PATH",
        help="start up, then wait until PATH exists before joining (the demo starts a rejoining "
        "worker early this way, so its start-up is not part of the time away) (default: join at once)",
    )
    g.add_argument("--max-steps", type=int, help="stop after N inner steps (default: no bound; this or --max-seconds)")
    g.add_argument("--max-seconds", type=float, help="stop after S seconds of training (default: no bound)")
    g.add_argument(
        "--device",
        default="cpu",
        metavar="{cpu,cuda,cuda:N,auto}",
        help="where the model, its inner optimizer state and the batches live; auto = cuda when torch sees a GPU, "
        "else cpu (default %(default)s)",
    )
    g.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    g.add_argument("--stats-file", help="write the worker's final counters as JSON here (default: none)")


def _add_pace_args(g: argparse._ArgumentGroup) -> None:
    """How fast the worker trains: an emulated weaker, changing or larger machine."""
    g.add_argument(
        "--slowdown",
        type=float,
        default=1.0,
        help="run F times slower, to emulate a weaker machine (default %(default)s)",
    )
    g.add_argument(
        "--step-s",
        type=float,
        default=0.0,
        metavar="S",
        help="every inner step lasts at least S seconds at full speed (a sleep inside the step, then "
        "--slowdown): emulates a larger model, so rounds last as long against their push and pull as "
        "they would (default %(default)s: the job's own step time)",
    )
    g.add_argument(
        "--slowdown-changes",
        default="",
        metavar="T1:F1,T2:F2",
        help="from T seconds of training on, run F times slower instead (times increasing, F >= 1); "
        "emulates a machine whose speed changes (default: none)",
    )


def _add_log_args(p: argparse.ArgumentParser) -> None:
    """The training log's outputs (train_log.py)."""
    g = p.add_argument_group("training logs")
    g.add_argument(
        "--log-every",
        type=int,
        default=TrainLogConfig.every,
        metavar="N",
        help="inner steps between two log points: a line in the process log (stderr), in --train-log and "
        "in --tensorboard-dir (default %(default)s)",
    )
    g.add_argument(
        "--train-log",
        metavar="FILE",
        help="append JSON lines here: one per log point (step, loss_nats, tokens_per_s, local_steps, "
        "staleness_versions, pushes, bytes, blocked_s, elapsed_s) and one per event (join, first_sync, leave); "
        "flushed per line (default: none)",
    )
    g.add_argument(
        "--tensorboard-dir",
        metavar="DIR",
        help=f"write the same scalars as TensorBoard events here (needs {TENSORBOARD_FIX}) (default: none)",
    )


# ------------------------------------------------------------------- the command
@dataclasses.dataclass(frozen=True)
class _Configs:
    worker: WorkerConfig
    job: JobConfig
    sync: SyncWorkerConfig | None
    train_log: TrainLogConfig = TrainLogConfig()
    #: The torch device ("cpu", "cuda", "cuda:N"), "auto" resolved.
    device: str = "cpu"


def configs(args: argparse.Namespace) -> _Configs:
    """The worker's configs from the parsed flags; every refusal of a flag happens here.

    Raises:
        ConfigError: a flag's value is invalid, or a combination is.
    """
    if args.threads < 1:
        raise ConfigError(f"--threads {args.threads} is invalid: give 1 or more torch intra-op threads")
    given = WORKER.given(args)
    given["worker_name"] = _worker_name(given.get("worker_name") or "", given.get("state_dir"))
    if args.shard_map:
        given["server"] = _shard_servers(args.shard_map, given["server"])
    wcfg = WORKER.build(given)
    if args.max_steps is None and args.max_seconds is None:
        raise ConfigError("give --max-steps N or --max-seconds S (or both) so the worker stops")
    if args.stats_file:
        check_writable_folder("--stats-file", args.stats_file)
    sync = None
    if args.mode == "sync":
        if wcfg.overlap:
            raise ConfigError("--overlap is invalid with --mode sync: a sync round is a barrier; drop --overlap")
        sync = SYNC_WORKER.build(SYNC_WORKER.given(args))
    train_log = TrainLogConfig(every=args.log_every, jsonl_path=args.train_log, tensorboard_dir=args.tensorboard_dir)
    job = WORKER_JOB.build(WORKER_JOB.given(args))
    return _Configs(wcfg, job, sync, train_log, resolve_device(args.device))


def resolve_device(text: str) -> str:
    """The torch device of ``--device``: "cpu", "cuda" or "cuda:N" (checked against the
    GPUs torch sees), or "auto" (cuda when torch sees one, else cpu; cuda:LOCAL_RANK in a
    torchrun rank).

    Raises:
        ConfigError: another value, or a CUDA device torch does not see.
    """
    import torch

    value = text.strip().lower()
    if value == "auto":  # under torchrun each rank takes the GPU of its LOCAL_RANK
        local_rank = os.environ.get("LOCAL_RANK", "")
        if torch.cuda.is_available() and local_rank.isdigit() and int(local_rank) < torch.cuda.device_count():
            return f"cuda:{local_rank}"
        return "cuda" if torch.cuda.is_available() else "cpu"
    kind, _, index = value.partition(":")
    if value == "cpu" or (kind == "cuda" and (not index or index.isdigit())):
        if kind == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if int(index or 0) >= count:
                seen = f"{count} CUDA device(s)" if count else "no CUDA device (torch.cuda.is_available() is False)"
                raise ConfigError(
                    f"--device {text} is invalid: torch {torch.__version__} here sees {seen}; use --device cpu "
                    f"(or auto), or run on a machine with a GPU and a CUDA build of torch"
                )
        return value
    raise ConfigError(f"--device {text!r} is invalid: choose cpu, cuda, cuda:N (N a GPU index) or auto")


def _worker_name(given: str, state_dir: str | None) -> str:
    """--worker-name, else the name saved in --state-dir, else a new unique one (saved
    there by the worker): never a name another worker process may also take, since a
    Join under a known name takes over that worker's id.

    Raises:
        ConfigError: --worker-name differs from the name saved in --state-dir.
    """
    from asyncdiloco.worker.state_dir import resolve_worker_name, saved_worker_name

    saved = saved_worker_name(state_dir) if state_dir else None
    return resolve_worker_name(given, saved, state_dir or "")


def _shard_servers(path: str, server: str) -> str:
    """``--server`` for the shards of ``--shard-map``: every address, shard 0 first.

    Raises:
        ConfigError: the file is unusable, or ``--server`` is not its shard 0.
    """
    from asyncdiloco.wire.shards import load_shard_addresses

    addresses = load_shard_addresses(path)
    if server.split(",")[0].strip() != addresses[0]:
        raise ConfigError(
            f"--server {server} is not shard 0 of --shard-map {path} ({addresses[0]}); give --server {addresses[0]}"
        )
    return ",".join(addresses)


def run(args: argparse.Namespace) -> int:
    import torch

    from asyncdiloco._malloc import keep_large_blocks
    from asyncdiloco.cli import train
    from asyncdiloco.job.slowdown import parse_slowdown_changes

    cfg = configs(args)
    check_pem_files(cfg.worker.security)  # a garbage PEM file is refused now, not at the handshake
    slowdown_changes = parse_slowdown_changes(args.slowdown_changes)
    group = torchrun_group(cfg.device)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, _on_sigterm(stop, group is not None))
    if group is not None:  # torchrun forwards a Ctrl-C as SIGINT and SIGTERM: both end training in order
        signal.signal(signal.SIGINT, _on_sigterm(stop, True))
    torch.set_num_threads(args.threads)
    keep_large_blocks()
    began: list[float] = []  # when training began (wall clock), once it has
    marks: dict[str, float] = {}  # join_started / train_ended, wall clock
    ordered = False
    try:
        stats = train.run_worker(
            worker_config=cfg.worker,
            job=cfg.job,
            worker_index=args.worker_index,
            slowdown=args.slowdown,
            slowdown_changes=slowdown_changes,
            step_s=args.step_s,
            max_steps=args.max_steps,
            max_seconds=args.max_seconds,
            sync=cfg.sync,
            train_log=cfg.train_log,
            device=group.device if group is not None else cfg.device,
            on_start=lambda: began.append(time.time()),
            on_join=lambda: _mark(marks, "join_started_unix_s"),
            on_end=lambda: _mark(marks, "train_ended_unix_s"),
            stop=stop,
            wait_to_join=_wait_for_file(args.join_when_file, stop) if args.join_when_file else None,
        )
        ordered = True
    finally:
        if group is not None:
            group.close(ordered)
    if group is not None and group.rank != 0:
        return 0  # rank 0 writes the group's stats file and final line
    if args.stats_file:
        with open(args.stats_file, "w") as f:
            json.dump(_summary(args, stats, cfg.worker.worker_name, began) | marks, f)
    print(_final_line(cfg.worker.worker_name, stats), flush=True)
    return 0


def _mark(marks: dict[str, float], name: str) -> None:
    """The wall-clock time of ``name`` in the stats file (the first time only)."""
    marks.setdefault(name, time.time())


def _on_sigterm(stop: threading.Event, in_group: bool = False) -> Callable[..., None]:
    def on_sigterm(*_: object) -> None:
        # The first SIGTERM ends training after the current inner step (an interrupt in the
        # middle of a push or pull could leave the client half-way; it hung close() after
        # Leave); the worker then pushes its last Δ and leaves. A second one interrupts,
        # except in a torchrun group: an interrupt there would leave the other ranks in a
        # collective (torchrun itself SIGKILLs the ranks 30 s after its SIGTERM).
        if stop.is_set() and not in_group:
            raise KeyboardInterrupt
        stop.set()

    return on_sigterm


@dataclasses.dataclass(frozen=True)
class _TorchrunGroup:
    """The process group this command set up from torchrun's environment."""

    rank: int
    world_size: int
    #: This rank's torch device: the --device, with CUDA's index = LOCAL_RANK.
    device: str

    def close(self, ordered: bool) -> None:
        """Destroy the group; after a run that ended in order on this rank, first wait
        for every rank (a rank tearing its group down while another still uses it can
        abort the other at exit)."""
        import torch.distributed as dist

        if dist.is_initialized():
            if ordered:
                dist.barrier()
            dist.destroy_process_group()


#: The environment torchrun sets for every rank (torch.distributed's env:// rendezvous).
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def torchrun_group(device: str) -> _TorchrunGroup | None:
    """Under torchrun with more than one rank: initialize torch.distributed's default
    group (gloo for --device cpu, NCCL for cuda, each rank on cuda:LOCAL_RANK), so the
    ranks train as one worker (worker/group.py). None when not under torchrun.

    Raises:
        ConfigError: --device cuda:N under torchrun (every rank takes cuda:LOCAL_RANK).
    """
    if not all(name in os.environ for name in TORCHRUN_ENV) or int(os.environ["WORLD_SIZE"]) <= 1:
        return None
    import torch
    import torch.distributed as dist

    local_rank = int(os.environ["LOCAL_RANK"])
    if device.startswith("cuda"):
        if ":" in device:
            raise ConfigError(
                f"--device {device} is invalid under torchrun: every rank takes cuda:LOCAL_RANK; give --device cuda"
            )
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return _TorchrunGroup(dist.get_rank(), dist.get_world_size(), device)


def _wait_for_file(path: str, stop: threading.Event) -> Callable[[], bool]:
    def wait_for_file() -> bool:  # started early, its start-up done: join once the file appears
        while not os.path.exists(path) and not stop.is_set():
            time.sleep(0.05)
        return not stop.is_set()

    return wait_for_file


def _summary(args: argparse.Namespace, stats: Any, name: str, began: list[float]) -> dict:
    """The stats file: the worker's counters and what it ran with."""
    summary = dataclasses.asdict(stats)
    summary.update(
        worker_index=args.worker_index, slowdown=args.slowdown, slowdown_changes=args.slowdown_changes, name=name
    )
    if began:  # when it began training, on the wall clock (the demo's report aligns processes by it)
        summary["train_started_unix_s"] = began[0]
    return summary


def _final_line(name: str, stats: Any) -> str:
    from asyncdiloco.worker.stats import SyncWorkerStats

    if isinstance(stats, SyncWorkerStats):
        return (
            f"{name}: {stats.inner_steps} inner steps, {stats.rounds_committed} rounds committed, "
            f"{stats.rounds_failed} aborted, {stats.heals} heals, idle {stats.idle_s:.1f} s"
        )
    final = f", final push {stats.final_push}" if stats.final_push else ""
    return (
        f"{name}: {stats.inner_steps} inner steps, {stats.pushes_applied} pushes applied, "
        f"{stats.pushes_refused} refused, {stats.sync_failures} failed syncs, blocked {stats.blocked_s:.1f} s "
        f"of {stats.wall_s:.1f} s{final}"
    )
