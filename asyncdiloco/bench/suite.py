"""The sync-vs-async benchmark suite on the virtual clock.

Runs every method (sim.METHODS) on worker-speed profiles with the same model, data,
token budget and seeds, and writes ``runs.jsonl`` (one line per run), ``report.md``
(suite_report.py and suite_markdown.py: two tables per profile, mean ± std over seeds, the claims of Liu et al.
2024, arXiv 2401.09135, and issue 25's against the best-tuned synchronous baseline),
``claims.json`` (the same claims, machine-readable), ``tuning.json`` and PNG plots.

**Tuning stage.** Before the evaluation, each method of ``SuiteConfig.tuned`` runs every
outer (η, μ) of ``TuneGrid`` on one profile and a seed that is not an evaluation seed, with
the evaluation's budget; the cell of lowest final loss is its pick, and the method is then
evaluated with it on every profile and seed. The other methods (``SuiteConfig.methods``:
sync LocalSGD, standard sync DiLoCo with its paper's η 0.7, μ 0.9, naive async Nesterov)
run with their own outer step, as references. A method in both lists gives two rows, the
tuned one named ``<method>_tuned``.

Equal tokens: every method trains exactly ``total_steps`` inner steps summed over the
workers (steps are allotted when a round starts; the round that would exceed the budget
is cut to what remains). Runs are independent and deterministic, so they are spread
over ``processes`` worker processes (one torch thread each); a tuned method's evaluation
runs start as soon as its grid is done.

    asyncdiloco bench --suite quick --clock virtual --out DIR
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

from asyncdiloco.algo.config import DEFAULT_LOCAL_STEPS
from asyncdiloco.bench.profiles import PROFILES
from asyncdiloco.bench.sim import METHODS, SimConfig, SimResult, simulate, staleness_mean
from asyncdiloco.bench.suite_markdown import write_outputs
from asyncdiloco.bench.suite_report import (
    BEYOND_METHODS,
    DEFAULT_METHOD,
    TUNED_SUFFIX,
    add_targets,
    claims_json,
    summarize,
)
from asyncdiloco.errors import ConfigError
from asyncdiloco.job.config import JobConfig

__all__ = ["PROFILES", "SUITES", "SuiteConfig", "TuneGrid", "claims_json", "run_suite", "summarize", "write_outputs"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TuneGrid:
    """The tuning stage's grid: every tuned method runs every (η, μ) on one profile and seed."""

    #: The profile the grid runs on.
    profile: str = "uneven"
    #: The grid's seed; never an evaluation seed, so no pick is selected on the runs it is judged by.
    seed: int = 100
    #: Outer learning rates η.
    lrs: tuple[float, ...] = (0.7, 1.0)
    #: Outer momenta μ.
    momenta: tuple[float, ...] = (0.6, 0.8, 0.9)

    def cells(self) -> list[tuple[float, float]]:
        """Every (η, μ) of the grid, η-major."""
        return [(lr, mom) for lr in self.lrs for mom in self.momenta]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SuiteConfig:
    profiles: tuple[str, ...]
    #: Methods run with their own outer step (the references).
    methods: tuple[str, ...] = tuple(METHODS)
    #: Methods whose outer η, μ the tuning stage picks before they are evaluated (row
    #: ``<method>_tuned`` when the method is also in ``methods``, else ``<method>``).
    tuned: tuple[str, ...] = ()
    tune: TuneGrid = TuneGrid()
    seeds: tuple[int, ...] = (0, 1, 2)
    #: Inner steps summed over workers, identical for every method.
    total_steps: int = 4000
    local_steps: int = DEFAULT_LOCAL_STEPS
    #: Evaluate every this many inner steps (summed over workers): fine enough that the
    #: time to a baseline's loss resolves a 3x speed-up (the async runs reach it in tens of evaluations).
    eval_every_steps: int = 40
    #: ``runs.jsonl``'s ``target_loss`` = claim (c)'s baseline's final curve loss × (1 + target_margin);
    #: the report uses no margin.
    target_margin: float = 0.0
    #: Processes the runs are spread over (0 = the number of CPU cores).
    processes: int = 0
    #: The model and data every run trains (small, so the quick suite fits in minutes). The
    #: curve is evaluated on its ``eval_set`` (32 batches: 16,384 characters, 27 ms an
    #: evaluation on one core), the final model on the whole validation split (``final_on_split``).
    job: JobConfig = dataclasses.field(
        default_factory=lambda: JobConfig(n_layer=1, n_embd=64, context_len=32, batch_size=16, eval_batches=32)
    )
    #: Score each run's final model on the whole validation split (``JobConfig.split_set``:
    #: 111,104 characters here), so the seed spread of the final loss is the training's.
    final_on_split: bool = True
    #: Two-region profiles (sim_tier.py ``REGION_PROFILES``): a flat server against the
    #: hierarchical tier, one tier run per K in ``tier_every`` (suite_tier.py).
    regions: tuple[str, ...] = ()
    tier_every: tuple[int, ...] = (1, 4, 16)
    #: End with the peer row (our ``--mode sync`` and torchft's DiLoCo, real processes).
    peer: bool = True

    def __post_init__(self) -> None:
        from asyncdiloco.bench.sim_tier import REGION_PROFILES

        unknown = [p for p in (*self.profiles, *((self.tune.profile,) if self.tuned else ())) if p not in PROFILES]
        if unknown:
            raise ConfigError(f"profiles {unknown} are unknown: choose from {sorted(PROFILES)}")
        unknown = [m for m in (*self.methods, *self.tuned) if m not in METHODS]
        if unknown:
            raise ConfigError(f"methods {unknown} are unknown: choose from {sorted(METHODS)}")
        if "sync_localsgd" in self.tuned:
            raise ConfigError("sync_localsgd cannot be tuned (plain averaging has no outer η, μ): list it in methods")
        if self.tuned and (not self.tune.lrs or not self.tune.momenta):
            raise ConfigError(f"the tuning grid {self.tune} is empty: give at least one η and one μ")
        if self.tuned and self.tune.seed in self.seeds:
            raise ConfigError(
                f"the tuning seed {self.tune.seed} is an evaluation seed {self.seeds}: pick another, so that no "
                "method is tuned on the runs it is judged by"
            )
        unknown = [p for p in self.regions if p not in REGION_PROFILES]
        if unknown:
            raise ConfigError(f"regions {unknown} are unknown: choose from {sorted(REGION_PROFILES)}")
        if any(k < 1 for k in self.tier_every):
            raise ConfigError(f"tier_every={self.tier_every} is invalid: every K must be >= 1 regional push")
        if len(self.seeds) < 1:
            raise ConfigError("give at least one seed (3 or more for mean ± std)")

    def rows(self) -> list[tuple[str, str, bool]]:
        """The report's rows: (row name, simulator method, tuned), references first."""
        refs = [(m, m, False) for m in self.methods]
        return refs + [(m + TUNED_SUFFIX if m in self.methods else m, m, True) for m in self.tuned]


#: The references every suite runs with their own outer step: claims (a) and (b).
REFERENCES = ("sync_localsgd", "sync_diloco", "async_nesterov")
#: The tuned methods: sync DiLoCo (the tuned copy), sync DiLoCo with speed-proportional
#: local steps, the default and the first method beyond the paper, momentum look-ahead
#: (``full``: all of them).
TUNED = ("sync_diloco", "sync_diloco_adaptive", DEFAULT_METHOD, BEYOND_METHODS[0])

SUITES = {
    #: 4 profiles × 7 rows × 3 seeds, after 4 methods × 6 cells of tuning: 108 runs.
    "quick": SuiteConfig(profiles=("uneven", "jittery", "slow_link", "non_iid"), methods=REFERENCES, tuned=TUNED),
    #: Every profile, the other methods of the paper as references, every method beyond the
    #: paper tuned, and the two-region section: 42 tuning runs, 8 × 13 × 3 = 312 evaluation runs.
    "full": SuiteConfig(
        profiles=tuple(PROFILES),
        methods=(*REFERENCES, "async_nesterov_poly", "async_dn", "async_dn_dylu_barrier"),
        tuned=(*TUNED[:-1], *BEYOND_METHODS),
        regions=("two_region",),
    ),
    #: Only the two-region section (flat server vs hierarchical tier).
    "tier": SuiteConfig(profiles=(), regions=("two_region",), tier_every=(1, 2, 4, 8, 16)),
}


def sim_config(cfg: SuiteConfig, profile: str, method: str, seed: int) -> SimConfig:
    """The simulator run of (profile, method, seed) in suite ``cfg`` (profiles.py)."""
    prof = PROFILES[profile]
    return SimConfig(
        method=method,
        speeds_s_per_step=prof.speeds_s_per_step,
        total_steps=cfg.total_steps,
        local_steps=cfg.local_steps,
        seed=seed,
        eval_every_steps=cfg.eval_every_steps,
        speed_changes=prof.speed_changes,
        leave_rejoin=prof.leave_rejoin,
        links=prof.links,
        noise=prof.noise,
        non_iid=prof.non_iid,
        wire_params=prof.wire_params,
        job=cfg.job,
    )


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
    cfg: SuiteConfig, out_dir: str, progress: bool = True, pool: concurrent.futures.Executor | None = None
) -> list[dict]:
    """Tune, then run every (profile, row, seed); write runs.jsonl, tuning.jsonl,
    tuning.json, report.md, claims.json and plots.

    Args:
        pool: where the runs go (``submit(_run_one, (profile, SimConfig))``); None: a pool
            of ``cfg.processes`` spawned processes.
    """
    from tqdm import tqdm

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if not cfg.profiles:  # only the two-region section
        (out / "report.md").write_text(
            "# Two regions — benchmark report (virtual clock)\n" + _tier_section(cfg, out, progress)
        )
        return []
    for name in ("runs.jsonl", "tuning.jsonl"):
        (out / name).unlink(missing_ok=True)
    rows, grid = cfg.rows(), cfg.tune.cells()
    n_runs = len(cfg.tuned) * len(grid) + len(cfg.profiles) * len(rows) * len(cfg.seeds)
    losses: dict[str, dict[tuple[float, float], float]] = {m: {} for m in cfg.tuned}
    records: list[dict] = []
    with contextlib.ExitStack() as stack:
        bar = stack.enter_context(tqdm(total=n_runs, disable=not progress, unit="run", dynamic_ncols=True))
        if pool is None:
            processes = min(n_runs, cfg.processes or os.cpu_count() or 1)
            spawn = multiprocessing.get_context("spawn")
            pool = stack.enter_context(concurrent.futures.ProcessPoolExecutor(processes, mp_context=spawn))
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
                rec = fut.result()
                outer = _sim(cfg, run.profile, run.method, run.seed, run.cell).outer()
                rec.update(method=run.row, sim_method=run.method, mode=METHODS[run.method].mode)
                rec.update(tuned=run.cell is not None, outer_lr=outer.lr, outer_momentum=outer.momentum)
                bar.set_postfix_str(f"{run.profile} {run.row} seed {run.seed}: {rec['final_eval_loss']:.3f}")
                bar.update(1)
                if run.tuning:
                    assert run.cell is not None  # every grid run has its (η, μ)
                    rec["tuning"] = True
                    losses[run.method][run.cell] = rec["final_eval_loss"]
                    with open(out / "tuning.jsonl", "a") as f:
                        f.write(json.dumps(rec) + "\n")
                    if len(losses[run.method]) == len(grid):  # its grid is done: evaluate its pick
                        submit(tuned_runs(cfg, run.method, pick(losses[run.method])))
                    continue
                records.append(rec)
                with open(out / "runs.jsonl", "a") as f:  # as they finish; rewritten in order at the end
                    f.write(json.dumps(rec) + "\n")
    order = {(p, row[0]): i for i, (p, row) in enumerate((p, r) for p in cfg.profiles for r in rows)}
    records.sort(key=lambda r: (order[r["profile"], r["method"]], cfg.seeds.index(r["seed"])))
    add_targets(records, cfg.target_margin)
    tuning = tuning_summary(cfg, {m: {c: losses[m][c] for c in grid} for m in cfg.tuned}) if cfg.tuned else None
    extra = ("\n" + peer_section(cfg, out, progress) if cfg.peer else "") + _tier_section(cfg, out, progress)
    write_outputs(records, cfg, out, "virtual", extra, tuning)
    return records


#: suite_real.py's name for ``add_targets``.
_add_targets = add_targets


def _tier_section(cfg: SuiteConfig, out: pathlib.Path, progress: bool) -> str:
    """The two-region section (suite_tier.py; "" without ``cfg.regions``)."""
    from asyncdiloco.bench.suite_tier import run_tier_section

    return ("\n" + run_tier_section(cfg, out, progress)) if cfg.regions else ""


def peer_section(cfg: SuiteConfig, out: pathlib.Path, progress: bool = True) -> str:
    """The peer row: our ``--mode sync`` (bench/peer_sync.py: a server and 4 CLI workers)
    and torchft's synchronous DiLoCo (https://github.com/pytorch/torchft) on the same
    model, data order, H and token budget, 4 replicas at full speed, one after the other
    in this run, each with its training wall and whole-command wall measured the same way;
    torchft's line is left out, saying why, when it is not installed."""
    from asyncdiloco.bench.peer_sync import row_table, run_row
    from asyncdiloco.bench.peer_torchft import torchft_available

    head = (
        "## Peer: synchronous DiLoCo, ours and torchft's (4 replicas, equal speeds, same model, data, H and tokens)\n\n"
    )
    if progress:
        print("peer: --mode sync, then torchft DiLoCo", flush=True)
    job = cfg.job
    try:
        rows = run_row(
            replicas=4, steps=cfg.total_steps // 4, local_steps=cfg.local_steps, out_dir=str(out / "peer"), job=job
        )
    except RuntimeError as exc:
        return head + f"peer run failed: {exc}\n"
    (out / "peer.json").write_text(json.dumps(rows) + "\n")
    missing = (
        ""
        if torchft_available()
        else "torchft is not installed, so its line was skipped: `pip install 'asyncdiloco[peer]'` (after torch) "
        "adds it.\n\n"
    )
    return (
        head
        + missing
        + row_table(rows)
        + (
            "\nTraining wall: the first replica's join to the last replica's last inner step; whole command: the "
            'first process started to the last one reaped (docs/performance.md, "Sync mode end to end").\n'
        )
    )


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
