"""The outer optimizer's configuration (``OuterConfig``, validated in ``__post_init__``) and
the defaults each mode uses.
"""

from __future__ import annotations

import dataclasses
import math

from asyncdiloco.algo.lr_schedule import LRSchedule
from asyncdiloco.errors import ConfigError, require

OUTER_OPTIMIZERS = ("nesterov", "sgd", "delayed_nesterov")
STALENESS_WEIGHTINGS = ("constant", "inverse", "polynomial", "hinge")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OuterConfig:
    """The outer optimizer and staleness weighting the server applies.

    Defaults follow DiLoCo (Douillard et al. 2023, arXiv 2311.08105, Sec. 3): Nesterov
    momentum with η = 0.7, μ = 0.9.
    """

    #: "nesterov" (SGD with Nesterov momentum), "sgd" (heavy-ball momentum; with lr=1,
    #: momentum=0 the server adopts each worker's parameters: LocalSGD averaging), or
    #: "delayed_nesterov" (momentum updated once per N arrivals; Liu et al. 2024, Alg. 3).
    optimizer: str = "nesterov"
    #: η, the outer learning rate (dimensionless; scales the pseudo-gradient).
    lr: float = 0.7
    #: μ, the outer momentum coefficient in [0, 1).
    momentum: float = 0.9
    #: s(τ): "constant" 1; "inverse" 1/(1+τ); "polynomial" (1+τ)^-a;
    #: "hinge" 1 if τ ≤ b else 1/(a(τ−b)+1)  (Xie et al. 2019, arXiv 1903.03934, Sec. 5.2).
    staleness: str = "constant"
    #: a, the exponent (polynomial) or slope (hinge).
    staleness_a: float = 0.5
    #: b, the hinge's grace in versions.
    staleness_b: int = 4
    #: Pushes with staleness τ above this many versions are refused (FAILED_PRECONDITION).
    max_staleness: int = 1000
    #: delayed_nesterov: N, arrivals per momentum update (Liu et al. 2024, Alg. 3);
    #: 0 = the number of live workers at each arrival.
    dn_buffer: int = 0
    #: delayed_nesterov: c ∈ [0, 1/N], the share of momentum applied between updates.
    dn_c: float = 0.0
    #: delayed_nesterov: damp each parameter tensor of a pseudo-gradient that points
    #: against the outer momentum by (1 + cos(g, m)) (1 when they agree); in the spirit of
    #: HeLoCo's per-block momentum check (arXiv 2606.00271). Off in Liu et al.'s DN.
    block_check: bool = False
    #: η's schedule, keyed by the version v an update is applied at (updates applied
    #: before it): η_v = lr · lr_factor(v) (lr_schedule.py). "constant" or "cosine".
    lr_schedule: str = "constant"
    #: Versions of linear warmup of η (0 = none).
    lr_warmup_versions: int = 0
    #: cosine: the version from which η stays at its floor (must exceed the warmup).
    lr_total_versions: int = 0
    #: cosine: the floor as a fraction of lr, in [0, 1].
    lr_min_ratio: float = 0.1

    def schedule(self) -> LRSchedule:
        """η's schedule as an ``LRSchedule`` (its counter is the version)."""
        return LRSchedule(
            kind=self.lr_schedule,
            warmup=self.lr_warmup_versions,
            total=self.lr_total_versions,
            min_ratio=self.lr_min_ratio,
        )

    def __post_init__(self) -> None:
        require(
            self.optimizer in OUTER_OPTIMIZERS, "outer optimizer", self.optimizer, f"choose one of {OUTER_OPTIMIZERS}"
        )
        require(
            math.isfinite(self.lr) and self.lr > 0, "outer lr", self.lr, "must be a finite number > 0 (DiLoCo uses 0.7)"
        )
        require(0 <= self.momentum < 1, "outer momentum", self.momentum, "must lie in [0, 1) (DiLoCo uses 0.9)")
        require(
            self.staleness in STALENESS_WEIGHTINGS, "staleness", self.staleness, f"choose one of {STALENESS_WEIGHTINGS}"
        )
        require(
            math.isfinite(self.staleness_a) and self.staleness_a >= 0, "staleness_a", self.staleness_a, "must be >= 0"
        )
        require(self.staleness_b >= 0, "staleness_b", self.staleness_b, "must be >= 0 versions")
        require(self.max_staleness >= 0, "max_staleness", self.max_staleness, "must be >= 0 versions")
        require(
            self.dn_buffer >= 0, "dn_buffer", self.dn_buffer, "must be >= 1 arrivals, or 0 for the number of workers"
        )
        require(
            0 <= self.dn_c <= (1 / self.dn_buffer if self.dn_buffer else 1),
            "dn_c",
            self.dn_c,
            f"must lie in [0, 1/N] with N = dn_buffer = {self.dn_buffer or 'workers'} (0 is Liu et al.'s default)",
        )
        try:
            self.schedule()
        except ConfigError as exc:
            raise ConfigError(
                f"outer {exc} [kind: lr_schedule, --outer-lr-schedule; warmup: lr_warmup_versions, "
                f"--outer-warmup-versions; total: lr_total_versions, --outer-total-versions; "
                f"min_ratio: lr_min_ratio, --outer-min-lr-ratio]"
            ) from None


#: The async server's default outer step: Delayed Nesterov (Liu et al. 2024, Alg. 3) with
#: N = the live workers, constant staleness weights (the grouping keeps τ within a group),
#: η and μ as chosen by the benchmark suite (docs/algorithms.md has the sweep).
ASYNC_OUTER = OuterConfig(optimizer="delayed_nesterov", lr=0.7, momentum=0.6)
#: The sync server's default: DiLoCo's own outer step (Douillard et al. 2023, Sec. 3).
SYNC_OUTER = OuterConfig(optimizer="nesterov", lr=0.7, momentum=0.9)
#: H, inner steps between pushes (the fastest worker's under DyLU).
DEFAULT_LOCAL_STEPS = 20
