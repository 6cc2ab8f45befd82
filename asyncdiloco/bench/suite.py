"""The sync-vs-async benchmark suite: one runner for both clocks (``run_suite``).

Virtual clock: the tuning grid, then every (profile, row, seed), spread over worker
processes; real clock: one demo per run (suite_real.py). Both write ``runs.jsonl``,
``report.md``, ``claims.json`` and plots from records of the same fields. What runs, the
tuning stage and how to read the report: docs/algorithms.md, "The benchmark suite".

    asyncdiloco bench --suite quick [--clock real] --out DIR
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import math
import multiprocessing
import os
import pathlib
import time
from typing import NamedTuple

from asyncdiloco.bench.peer_sync import peer_section
from asyncdiloco.bench.sim import METHODS, SimConfig, SimResult, staleness_mean
from asyncdiloco.bench.simulate import simulate
from asyncdiloco.bench.suite_config import SuiteConfig, sim_config
from asyncdiloco.bench.suite_markdown import write_outputs
from asyncdiloco.bench.suite_real import rate_section, run_real
from asyncdiloco.bench.suite_report import add_targets
from asyncdiloco.bench.suite_tier import run_tier, tier_configs, tier_section


def _sim(cfg: SuiteConfig, profile: str, method: str, seed: int, cell: tuple[float, float] | None) -> SimConfig:
    """``sim_config`` with the suite's held-out set and, for a tuned method, its (η, μ)."""
    sim_cfg = dataclasses.replace(sim_config(cfg, profile, method, seed), final_on_split=cfg.final_on_split)
    if cell is None:
        return sim_cfg
    return dataclasses.replace(sim_cfg, outer_lr=cell[0], outer_momentum=cell[1])


def _run_one(args: tuple[str, SimConfig]) -> dict:
    profile, sim_cfg = args
    started = time.monotonic()
    result = simulate(sim_cfg)
    return _record(profile, result, time.monotonic() - started)


def pick(losses: dict[tuple[float, float], float]) -> tuple[float, float]:
    """The cell of lowest final loss (a non-finite loss never wins; ties: the earlier cell)."""
    return min(losses, key=lambda cell: losses[cell] if math.isfinite(losses[cell]) else math.inf)


def tuning_summary(cfg: SuiteConfig, losses: dict[str, dict[tuple[float, float], float]]) -> dict:
    """tuning.json: the grid, every cell's final loss per method, each method's pick and own (η, μ)."""
    own = {}
    for m in losses:
        o = SimConfig(method=m, speeds_s_per_step=(1.0,), total_steps=1).outer()
        own[m] = [o.lr, o.momentum]
    return {
        "profile": cfg.tune.profile,
        "seed": cfg.tune.seed,
        "lrs": list(cfg.tune.lrs),
        "momenta": list(cfg.tune.momenta),
        "cells": {m: {f"{lr:g},{mom:g}": loss for (lr, mom), loss in cells.items()} for m, cells in losses.items()},
        "picks": {m: list(pick(cells)) for m, cells in losses.items()},
        "own": own,
    }


class Run(NamedTuple):
    """One simulator run of the suite."""

    profile: str
    #: The report's row (a tuning run: its method).
    row: str
    method: str
    seed: int
    #: (η, μ) of a tuned method; None: the method's own outer step.
    cell: tuple[float, float] | None
    #: A run of the tuning grid (its record goes to tuning.jsonl, not runs.jsonl).
    tuning: bool


def tuning_runs(cfg: SuiteConfig) -> list[Run]:
    """The grid: every tuned method × (η, μ) on the tuning profile and seed."""
    return [Run(cfg.tune.profile, m, m, cfg.tune.seed, cell, True) for m in cfg.tuned for cell in cfg.tune.cells()]


def reference_runs(cfg: SuiteConfig) -> list[Run]:
    """Every profile × reference row × evaluation seed, each method with its own outer step."""
    return [
        Run(p, row, m, s, None, False) for p in cfg.profiles for row, m, t in cfg.rows() if not t for s in cfg.seeds
    ]


def tuned_runs(cfg: SuiteConfig, method: str, cell: tuple[float, float]) -> list[Run]:
    """Every profile × evaluation seed of a tuned method, with its pick ``cell``."""
    return [
        Run(p, row, m, s, cell, False)
        for p in cfg.profiles
        for row, m, t in cfg.rows()
        if t and m == method
        for s in cfg.seeds
    ]


def run_suite(
    cfg: SuiteConfig,
    out_dir: str,
    progress: bool = True,
    pool: concurrent.futures.Executor | None = None,
    *,
    clock: str = "virtual",
    real_s_per_step: float | None = None,
) -> list[dict]:
    """Run every (profile, row, seed) of ``cfg`` on ``clock`` ("virtual" or "real") and
    write runs.jsonl, report.md, claims.json and plots (virtual: tuning.jsonl and
    tuning.json too); the records, in report order.

    Args:
        pool: virtual clock: where the runs go (``submit(_run_one, (profile, SimConfig))``);
            None: a pool of ``cfg.processes`` spawned processes.
        real_s_per_step: real clock: r of ``suite_real.real_schedule`` for the profiles
            with speed changes or a leave; None: measured per such profile.
    """
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if clock == "virtual" and not cfg.profiles:  # only the two-region section
        (out / "report.md").write_text(
            "# Two regions — benchmark report (virtual clock)\n" + _tier_section(cfg, out, progress)
        )
        return []
    tuning = None
    if clock == "real":
        records = run_real(cfg, out, progress, real_s_per_step)
        extra = rate_section(records) + "\n" + peer_section(cfg, out, progress)
    else:
        records, tuning = _run_virtual(cfg, out, progress, pool)
        extra = ("\n" + peer_section(cfg, out, progress) if cfg.peer else "") + _tier_section(cfg, out, progress)
    add_targets(records, cfg.target_margin)
    write_outputs(records, cfg, out, clock, extra, tuning)
    return records


def _run_virtual(
    cfg: SuiteConfig, out: pathlib.Path, progress: bool, pool: concurrent.futures.Executor | None
) -> tuple[list[dict], dict | None]:
    """The tuning grid, then every evaluation run, spread over ``pool``: (records in
    report order, tuning.json's summary or None)."""
    from tqdm import tqdm

    for name in ("runs.jsonl", "tuning.jsonl"):
        (out / name).unlink(missing_ok=True)
    rows, grid = cfg.rows(), cfg.tune.cells()
    n_runs = len(cfg.tuned) * len(grid) + len(cfg.profiles) * len(rows) * len(cfg.seeds)
    losses: dict[str, dict[tuple[float, float], float]] = {m: {} for m in cfg.tuned}
    records: list[dict] = []
    with contextlib.ExitStack() as stack:
        bar = stack.enter_context(tqdm(total=n_runs, disable=not progress, unit="run", dynamic_ncols=True))
        if pool is None:
            pool = stack.enter_context(_executor(cfg.processes, n_runs))
        jobs: dict[concurrent.futures.Future, Run] = {}

        def submit(runs: list[Run]) -> None:
            for run in runs:
                jobs[pool.submit(_run_one, (run.profile, _sim(cfg, run.profile, run.method, run.seed, run.cell)))] = run

        submit(tuning_runs(cfg))  # the grid first: the tuned rows wait for it
        submit(reference_runs(cfg))
        while jobs:
            done, _ = concurrent.futures.wait(jobs, return_when=concurrent.futures.FIRST_COMPLETED)
            for fut in done:
                run = jobs.pop(fut)
                rec = _label(cfg, run, fut.result())
                bar.set_postfix_str(f"{run.profile} {run.row} seed {run.seed}: {rec['final_eval_loss']:.3f}")
                bar.update(1)
                if run.tuning:
                    assert run.cell is not None  # every grid run has its (η, μ)
                    losses[run.method][run.cell] = rec["final_eval_loss"]
                    _append(out / "tuning.jsonl", rec)
                    if len(losses[run.method]) == len(grid):  # its grid is done: evaluate its pick
                        submit(tuned_runs(cfg, run.method, pick(losses[run.method])))
                    continue
                records.append(rec)
                _append(out / "runs.jsonl", rec)  # as they finish; rewritten in order at the end
    order = {(p, row[0]): i for i, (p, row) in enumerate((p, r) for p in cfg.profiles for r in rows)}
    records.sort(key=lambda r: (order[r["profile"], r["method"]], cfg.seeds.index(r["seed"])))
    tuning = tuning_summary(cfg, {m: {c: losses[m][c] for c in grid} for m in cfg.tuned}) if cfg.tuned else None
    return records, tuning


def _label(cfg: SuiteConfig, run: Run, rec: dict) -> dict:
    """A finished run's record with its row, method, mode and outer step (and ``tuning``)."""
    outer = _sim(cfg, run.profile, run.method, run.seed, run.cell).outer()
    rec.update(method=run.row, sim_method=run.method, mode=METHODS[run.method].mode)
    rec.update(tuned=run.cell is not None, outer_lr=outer.lr, outer_momentum=outer.momentum)
    if run.tuning:
        rec["tuning"] = True
    return rec


def _append(path: pathlib.Path, rec: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")


def _tier_section(cfg: SuiteConfig, out: pathlib.Path, progress: bool) -> str:
    """The two-region runs, spread over ``cfg.processes``, and their section (suite_tier.py;
    "" without ``cfg.regions``)."""
    runs = [run for p in cfg.regions for run in tier_configs(cfg, p)]
    if not runs:
        return ""
    if progress:
        print(f"two regions: {len(runs)} runs (flat server vs tier)", flush=True)
    with _executor(cfg.processes, len(runs)) as pool:
        records = list(pool.map(run_tier, runs))  # in order: the file does not depend on timing
    return "\n" + tier_section(records, cfg, out)


class _Inline(concurrent.futures.Executor):
    """Runs each call in this process as it is submitted (one process: no pool to start)."""

    def submit(self, fn, /, *args, **kwargs):
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_result(fn(*args, **kwargs))
        return fut


def _executor(processes: int, n_runs: int) -> concurrent.futures.Executor:
    """Where independent runs go: ``processes`` spawned processes (0: one per CPU core, at
    most one per run), or this process when that is one."""
    n = min(n_runs, processes or os.cpu_count() or 1)
    if n <= 1:
        return _Inline()
    return concurrent.futures.ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn"))


def _record(profile: str, r: SimResult, real_s: float) -> dict:
    c = r.config
    return {
        "clock": "virtual",
        "profile": profile,
        "method": c.method,
        "seed": c.seed,
        "workers": len(c.speeds_s_per_step),
        "speeds_s_per_step": list(c.speeds_s_per_step),
        "local_steps": c.local_steps,
        "total_steps": c.total_steps,
        "tokens": c.total_steps * c.job.tokens_per_step,
        "final_eval_loss": r.final_eval_loss,
        "virtual_wall_s": r.wall_s,
        "utilisation": r.utilisation,
        "updates": r.updates,
        "staleness_histogram": r.staleness_histogram,
        "mean_staleness": staleness_mean(r.staleness_histogram),
        "group_size_histogram": r.group_size_histogram,
        "steps": r.steps,
        "bytes_up": r.bytes_up,
        "bytes_down": r.bytes_down,
        "true_staleness_histogram": r.true_staleness_histogram,
        "mean_true_staleness": r.mean_true_staleness,
        "outer_steps": r.outer_steps,
        "comm_s": r.comm_s,
        "local_steps_log": r.local_steps_log,
        "estimated_rates": r.estimated_rates,
        "curve": r.curve,
        "real_s": real_s,
    }
