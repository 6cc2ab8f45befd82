"""What a torchrun group's per-step exchange (worker/group.py) adds to a DDP inner step:
gloo ranks on 127.0.0.1 time blocks of plain DDP steps against blocks of DDP steps plus
the group's exchange, and a due step's outcome with and without rank 0's keep-alive.
Measures; asserts nothing. docs/operations.md, "A torchrun group as one worker".

    python -m asyncdiloco.bench.perf.group_step_cost [--steps 200] [--world 2] [--default-job]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from asyncdiloco.job.config import JobConfig
from asyncdiloco.job.dataset import BatchStream, CharCorpus
from asyncdiloco.job.models import lm_loss
from asyncdiloco.worker.group import LocalGroup

#: Consecutive steps of one kind between two barriers (DDP's allreduce absorbs the ranks'
#: skew within a block, as in a real loop).
BLOCK = 20

#: The small model (the tests' tiny job): the exchange's share of a step is larger here than
#: with a real model, so the ratio is an upper bound.
SMALL = JobConfig(n_layer=1, n_embd=32, n_head=2, context_len=16, batch_size=8)


def _rank(rank: int, world: int, init_file: str, steps: int, default_job: bool) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    job = JobConfig() if default_job else SMALL
    corpus = CharCorpus.default()
    model = DistributedDataParallel(job.build(corpus))
    inner, _ = job.build_inner(model.parameters())
    batches = BatchStream(corpus, job.batch_size, job.context_len, job.seed, rank)
    group = LocalGroup(None)
    times: dict[str, list[float]] = {"ddp": [], "ddp+exchange": []}
    for block in range(2 * (steps // BLOCK) + 2):
        kind = "ddp+exchange" if block % 2 else "ddp"
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(BLOCK):
            x, y = next(batches)
            lm_loss(model(x), y).backward()
            inner.step()
            inner.zero_grad(set_to_none=True)
            if kind == "ddp+exchange":
                group.exchange(tokens=x.numel(), stop=False, due=False)
        if block >= 2:  # the first two blocks warm up
            times[kind].append((time.perf_counter() - t0) / BLOCK)
    if rank == 0:
        ddp, grouped = statistics.median(times["ddp"]), statistics.median(times["ddp+exchange"])
        exchange = _exchange_alone(group)
        outcome, kept_alive = _outcome_alone(group, leading=False), _outcome_alone(group, leading=True)
        print(
            json.dumps(
                {
                    "bench": "group_step_cost",
                    "world_size": world,
                    "model": "default job" if default_job else "small",
                    "backend": "gloo",
                    "params": sum(p.numel() for p in model.parameters()),
                    "steps_each": BLOCK * len(times["ddp"]),
                    "ddp_step_ms": round(1e3 * ddp, 3),
                    "ddp_plus_exchange_step_ms": round(1e3 * grouped, 3),
                    "ratio": round(grouped / ddp, 4),
                    "exchange_alone_ms": round(1e3 * exchange, 4),
                    "due_outcome_ms": round(1e3 * outcome, 4),
                    "due_outcome_with_keep_alive_ms": round(1e3 * kept_alive, 4),
                }
            ),
            flush=True,
        )
    else:
        _exchange_alone(group)
        _outcome_alone(group, leading=False)
        _outcome_alone(group, leading=True)
    dist.destroy_process_group()


def _exchange_alone(group: LocalGroup, n: int = 200) -> float:
    """Median seconds of one exchange with nothing else running."""
    samples = []
    for _ in range(n):
        dist.barrier()
        t0 = time.perf_counter()
        group.exchange(tokens=1, stop=False, due=False)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _outcome_alone(group: LocalGroup, leading: bool, n: int = 200) -> float:
    """Median seconds of a due step's outcome (unchanged model) with nothing else
    running; ``leading``: rank 0 first starts and joins its keep-alive thread, as around
    every sync (the sync itself is empty here, so no keep-alive is sent)."""
    samples = []
    for _ in range(n):
        dist.barrier()
        t0 = time.perf_counter()
        if group.is_leader and leading:
            with group.leading():
                pass
        group.share_outcome([])
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200, help="timed steps of each kind (default %(default)s)")
    p.add_argument("--world", type=int, default=2, help="ranks (default %(default)s)")
    p.add_argument("--default-job", action="store_true", help="time the CLI worker's default model")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(
            _rank, args=(args.world, os.path.join(folder, "store"), args.steps, args.default_job), nprocs=args.world
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
