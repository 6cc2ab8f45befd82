"""One rank of a torch.distributed group trained as one worker, for tests/test_group.py.

``python _group_worker.py RANK WORLD INIT_FILE SERVER OUT [options]``: joins a gloo group
through the FileStore INIT_FILE, wraps a small regression model in DDP and trains it with
an AsyncDiLoCoWorker (or, with ``--mode sync``, a SyncDiLoCoWorker) on this rank's own
data. After every inner step it records the CRC-32 of its parameters (and on rank 0 the
worker's H_w and sync counters); it writes them as JSON to OUT once the worker closed.
With ``--expect-join-error`` the join must raise: the exception's class name is written.
With ``--group-timeout-s T`` the worker trains in a group of the same ranks whose
collective timeout is T (``dist.new_group``; DDP keeps the default group).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import zlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from asyncdiloco import AsyncDiLoCoWorker, SyncDiLoCoWorker, SyncWorkerConfig, WorkerConfig


def crc(model: nn.Module) -> int:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return zlib.crc32(flat.numpy().tobytes()) & 0xFFFFFFFF


def opt_crc(opt: torch.optim.Optimizer) -> int:
    """CRC-32 of the inner optimizer's state tensors (Adam's moments), in order."""
    value = 0
    for state in opt.state_dict()["state"].values():
        for key in sorted(state):
            value = zlib.crc32(state[key].detach().float().numpy().tobytes(), value)
    return value


def opt_steps(opt: torch.optim.Optimizer) -> int:
    """Adam's step count of the first parameter (0 before its first step)."""
    state = opt.state_dict()["state"].get(0)
    return int(state["step"]) if state else 0


def main() -> None:
    p = argparse.ArgumentParser()
    for name in ("rank", "world"):
        p.add_argument(name, type=int)
    for name in ("init_file", "server", "out"):
        p.add_argument(name)
    p.add_argument("--mode", default="async")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--overlap", action="store_true")
    p.add_argument("--step-sleep-s", type=float, default=0.0)
    p.add_argument("--name", default="group")
    p.add_argument("--expect-join-error", action="store_true")
    p.add_argument("--stop-at", type=int, default=-1, help="the last rank requests a stop before this step (0-based)")
    p.add_argument("--last-rank-raises", action="store_true", help="the last rank leaves its with block raising")
    p.add_argument("--state-dir", default="", help="the worker's state folder (rank 0 keeps it)")
    p.add_argument("--quorum-timeout-s", type=float, default=60.0, help="sync mode: the wait for a quorum")
    p.add_argument(
        "--group-timeout-s",
        type=float,
        default=0.0,
        help="train in a group of the same ranks with this collective timeout (0: the default group)",
    )
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{args.init_file}", rank=args.rank, world_size=args.world)
    torch.manual_seed(args.rank)  # different initial parameters: the join must make them rank 0's (DDP does too)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    group: object = "auto"
    if args.group_timeout_s:  # built after DDP's broadcast: the ranks reach it together
        group = dist.new_group(timeout=datetime.timedelta(seconds=args.group_timeout_s))
    cfg = WorkerConfig(
        server=args.server,
        worker_name=args.name,
        heartbeat_s=0.2,
        overlap=args.overlap,
        join_timeout_s=0.5,
        rpc_timeout_s=2.0,
        state_dir=args.state_dir or None,
    )
    tokens = 16 * (args.rank + 1)  # distinct per rank: the server must count the sum
    if args.mode == "sync":
        sync = SyncWorkerConfig(quorum_timeout_s=args.quorum_timeout_s)
        worker: AsyncDiLoCoWorker | SyncDiLoCoWorker = SyncDiLoCoWorker(
            model, opt, cfg, sync=sync, tokens_per_step=tokens, process_group=group
        )
    else:
        worker = AsyncDiLoCoWorker(model, opt, cfg, tokens_per_step=tokens, process_group=group)
    out: dict = {"rank": args.rank, "steps": []}
    try:
        _train(args, worker, model, opt, out)  # with worker: joins (and raises a failed join) first
    except Exception as exc:  # noqa: BLE001 - the test checks which
        if args.expect_join_error:
            out["join_error"], out["join_message"] = type(exc).__name__, str(exc)
            worker.close()  # a join that raised in __enter__ left its channel open
        else:
            assert args.last_rank_raises and str(exc) == "the user's code failed", exc
            out["raised"] = True
    if not args.expect_join_error:
        out["final_crc"] = crc(model)
        out["tokens"] = worker.stats.tokens
        out["module_names"] = [n for n, _ in model.module.named_parameters()]
        out["held_s"] = getattr(worker.stats, "held_s", 0.0)  # rank 0 of an async worker: its replies' holds
        out["keep_alives"] = worker.group.keep_alives if worker.group is not None else 0
    with open(args.out, "w") as f:
        json.dump(out, f)
    if args.last_rank_raises:
        # A rank left alone (its with block raised): the group is broken. torch.distributed's
        # teardown may then wait on the dead rank's sockets (gloo's destructor after a failed
        # collective; seen under load, issue 25's note), as torchrun would not let it: the
        # process ends here, its results written.
        sys.stdout.flush()
        os._exit(0)
    dist.barrier()  # every rank ended in order: wait for the others before the teardown
    dist.destroy_process_group()


def _train(args: argparse.Namespace, worker, model: nn.Module, opt: torch.optim.Optimizer, out: dict) -> None:
    gen = torch.Generator().manual_seed(100 + args.rank)
    w_true = torch.linspace(-1, 1, 8).unsqueeze(1)  # (8, 1)
    last_rank = args.rank == args.world - 1
    with worker:
        for i in range(args.steps):
            if i == args.stop_at and last_rank:
                worker.request_stop()
            if worker.should_stop:
                break
            x = torch.randn(16, 8, generator=gen)  # (B, 8)
            loss = nn.functional.mse_loss(model(x), torch.tanh(x @ w_true))
            loss.backward()
            time.sleep(args.step_sleep_s)  # inside the step: slower compute, which DyLU's rate counts
            opt.step()
            opt.zero_grad()
            rec = {"crc": crc(model), "loss": loss.item(), "opt_crc": opt_crc(opt), "opt_steps": opt_steps(opt)}
            if args.rank == 0:
                rec["local_steps"] = worker.local_steps
                rec["syncs"] = _syncs(worker)
            out["steps"].append(rec)
        if args.last_rank_raises and last_rank:
            raise RuntimeError("the user's code failed")


def _syncs(worker: AsyncDiLoCoWorker | SyncDiLoCoWorker) -> int:
    if isinstance(worker, SyncDiLoCoWorker):
        return worker.stats.rounds_committed + worker.stats.rounds_skipped
    return worker.stats.pulls


if __name__ == "__main__":
    main()
