"""What a benchmark suite runs: ``SuiteConfig`` (profiles, methods, the tuning grid,
seeds, budget), the named suites of both clocks (``SUITES``, ``REAL_SUITES``) and the
simulator run of one (profile, method, seed) (docs/algorithms.md, "The benchmark suite").
"""

from __future__ import annotations

import dataclasses

from asyncdiloco.algo.config import DEFAULT_LOCAL_STEPS
from asyncdiloco.bench.profiles import PROFILES
from asyncdiloco.bench.sim import METHODS, SimConfig
from asyncdiloco.bench.sim_tier import REGION_PROFILES
from asyncdiloco.bench.suite_report import BEYOND_METHODS, DEFAULT_METHOD, TUNED_SUFFIX
from asyncdiloco.errors import ConfigError
from asyncdiloco.job.config import JobConfig


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
    return SimConfig(
        method=method,
        **PROFILES[profile].fields(),
        total_steps=cfg.total_steps,
        local_steps=cfg.local_steps,
        seed=seed,
        eval_every_steps=cfg.eval_every_steps,
        job=cfg.job,
    )


#: The methods the real clock runs: what claims (b), (c), the strongest synchronous
#: baseline (sync DiLoCo with adaptive steps) and the method beyond the paper need
#: (``full`` adds sync LocalSGD for claim (a)); each real run costs the start-up of a
#: server and four worker processes.
REAL_METHODS = ("sync_diloco", "sync_diloco_adaptive", "async_nesterov", "async_dn_dylu", "async_dn_dylu_overlap")
#: The profiles the real clock emulates (speeds, speed changes, a leave and rejoin).
REAL_PROFILES = ("homogeneous", "uneven", "straggler", "changing", "leave_rejoin")
#: Real-clock suites: ``quick`` runs the one profile the claims are about (estimated 30
#: minutes with ``REAL_STEP_S`` 0.05; 8 min 40 s before steps were padded); ``full`` runs
#: all of ``REAL_PROFILES``. The budget is the virtual suite's.
REAL_SUITES = {
    "quick": SuiteConfig(profiles=("uneven",), methods=REAL_METHODS),
    "full": SuiteConfig(profiles=REAL_PROFILES, methods=("sync_localsgd", *REAL_METHODS)),
}
