"""Run one simulated method: ``simulate(SimConfig)`` picks the loop (sim_async.py or
sim_sync.py) and returns its ``SimResult`` (docs/algorithms.md, "The benchmark suite").

One run of the suite's (profile, method, seed), printed as a JSON line::

    python -m asyncdiloco.bench.simulate slow_link async_dn_dylu 0 wire_codec=bf16 grace_s=4

Overrides after the seed set SimConfig fields (numbers, or a string for wire_codec). The
line holds the final held-out loss, virtual wall time, utilisation, outer steps, group
sizes, true staleness, charged megabytes, transfer seconds, the rates DyLU ended with,
the CPU seconds the run took and its curve as (virtual s, loss) pairs.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from asyncdiloco.bench.sim import SYNC_METHODS, Replica, SimConfig, SimResult
from asyncdiloco.bench.sim_async import run_async
from asyncdiloco.bench.sim_sync import run_sync
from asyncdiloco.bench.suite_config import SuiteConfig, sim_config
from asyncdiloco.job.dataset import CharCorpus
from asyncdiloco.job.models import evaluate


def simulate(cfg: SimConfig, progress: Callable[[int], None] | None = None) -> SimResult:
    """Run one method on the virtual clock until ``total_steps`` inner steps are done.

    Runs with one intra-op thread (restored afterwards): the small models are fastest
    that way, and a fixed thread count keeps float reductions, hence results, identical
    from machine to machine.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _simulate(cfg, progress)
    finally:
        torch.set_num_threads(threads)


def _simulate(cfg: SimConfig, progress: Callable[[int], None] | None) -> SimResult:
    torch.manual_seed(cfg.seed)
    cfg = dataclasses.replace(cfg, job=dataclasses.replace(cfg.job, seed=cfg.seed))  # init and data order
    corpus = CharCorpus.default()
    evaluator = cfg.job.build(corpus)
    eval_set = cfg.job.eval_set(corpus)
    replicas = [Replica(cfg, corpus, i) for i in range(len(cfg.speeds_s_per_step))]
    run = run_sync if cfg.method in SYNC_METHODS else run_async
    result = run(cfg, replicas, evaluator, eval_set, progress or (lambda _: None))
    if not cfg.final_on_split:
        return result
    assert result.curve[-1]["steps"] == result.steps  # the last curve point loaded the final model into evaluator
    return dataclasses.replace(result, final_eval_loss=evaluate(evaluator, cfg.job.split_set(corpus)))


def main(argv: list[str]) -> None:
    profile, method, seed = argv[0], argv[1], int(argv[2])
    extra: dict[str, Any] = dict(a.split("=", 1) for a in argv[3:])
    cfg = sim_config(SuiteConfig(profiles=(profile,), seeds=(seed,)), profile, method, seed)
    if extra:
        overrides: dict[str, Any] = {k: (v if k == "wire_codec" else float(v)) for k, v in extra.items()}
        cfg = dataclasses.replace(cfg, **overrides)
    started = time.process_time()
    r = simulate(cfg)
    print(
        json.dumps(
            {
                "profile": profile,
                "method": method,
                "seed": seed,
                **extra,
                "loss": round(r.final_eval_loss, 4),
                "wall_s": round(r.wall_s, 1),
                "util": round(r.utilisation, 3),
                "outer_steps": r.outer_steps,
                "groups": r.group_size_histogram,
                "true_stal": r.true_staleness_histogram[:6],
                "mean_true_stal": round(r.mean_true_staleness, 3),
                "MB": round((r.bytes_up + r.bytes_down) / 1e6, 1),
                "comm_s": round(r.comm_s, 1),
                "rates": [None if x is None else round(x, 3) for x in r.estimated_rates],
                "cpu_s": round(time.process_time() - started, 1),
                "curve": [(p["time_s"], p["eval_loss"]) for p in r.curve],
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
