"""Learning-rate schedules: linear warmup, then constant or cosine decay to a floor
(docs/operations.md, "Learning-rate schedules"). The outer η is keyed by the version v an
update is applied at (the updates applied before it), the inner lr by the worker's inner
step k (``LambdaLR``).

The factor f(t) multiplies the peak rate (W = ``warmup``, T = ``total``, r = ``min_ratio``,
t 0-based): f(t) = (t + 1) / W for t < W; then 1 (``constant``), or (``cosine``)
r + (1 − r) · ½ · (1 + cos(π · (t − W) / (T − W))) for t < T and r from T on. Warmup then
cosine annealing as in SGDR (Loshchilov & Hutter 2017, arXiv 1608.03983, Eq. 5, one cycle),
the schedule of DiLoCo's inner AdamW (Douillard et al. 2023, arXiv 2311.08105, Sec. 3).
"""

from __future__ import annotations

import dataclasses
import math

from asyncdiloco.errors import ConfigError

LR_SCHEDULES = ("constant", "cosine")


def _require(ok: bool, field: str, value: object, rule: str) -> None:
    if not ok:  # the words of config.py's _require (which imports this module)
        raise ConfigError(f"lr schedule {field}={value!r} is invalid: {rule}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LRSchedule:
    """The shape of a learning-rate schedule, in units of its counter (inner steps for the
    inner optimizer, versions for the outer one). The default is no schedule at all."""

    #: "constant" (1 after the warmup) or "cosine" (cosine decay from 1 to ``min_ratio``).
    kind: str = "constant"
    #: W, steps/versions of linear warmup from 1/W to 1; 0 = no warmup.
    warmup: int = 0
    #: T, the step/version at which the cosine reaches its floor (must be > W); unused
    #: by "constant".
    total: int = 0
    #: r ∈ [0, 1], the cosine's floor as a fraction of the peak learning rate.
    min_ratio: float = 0.1

    def __post_init__(self) -> None:
        _require(self.kind in LR_SCHEDULES, "kind", self.kind, f"choose one of {LR_SCHEDULES}")
        _require(
            isinstance(self.warmup, int) and self.warmup >= 0,
            "warmup",
            self.warmup,
            "must be an integer >= 0 (0 = no warmup)",
        )
        _require(isinstance(self.total, int) and self.total >= 0, "total", self.total, "must be an integer >= 0")
        _require(
            self.kind != "cosine" or self.total > self.warmup,
            "total",
            self.total,
            f"a cosine schedule must end after its warmup: give total > warmup={self.warmup} "
            f"(the step/version at which the learning rate reaches min_ratio × peak)",
        )
        _require(
            isinstance(self.min_ratio, (int, float)) and 0.0 <= self.min_ratio <= 1.0,
            "min_ratio",
            self.min_ratio,
            "must lie in [0, 1] (the floor as a fraction of the peak; 0.1 is usual)",
        )

    def describe(self) -> str:
        """Human-readable, e.g. ``cosine(warmup=10, total=100, min_ratio=0.1)``."""
        if self.kind == "constant":
            return f"constant(warmup={self.warmup})"
        return f"cosine(warmup={self.warmup}, total={self.total}, min_ratio={self.min_ratio:g})"


def lr_factor(schedule: LRSchedule, step: int) -> float:
    """f(t): the learning rate of update ``step`` as a fraction of the peak (module docstring).

    Args:
        schedule: the schedule's shape.
        step: t ≥ 0, the 0-based index of the update: the worker's inner step, or the
            outer version before the update (the number of updates applied so far).
    Returns:
        The factor in [0, 1]; exactly 1.0 for a constant schedule after its warmup.
    Raises:
        ValueError: ``step`` < 0.
    """
    if step < 0:
        raise ValueError(f"step is {step}; it must be >= 0 (the 0-based index of the update)")
    if step < schedule.warmup:
        return (step + 1) / schedule.warmup
    if schedule.kind == "constant":
        return 1.0
    if step >= schedule.total:
        return float(schedule.min_ratio)
    progress = (step - schedule.warmup) / (schedule.total - schedule.warmup)  # in [0, 1)
    return schedule.min_ratio + (1.0 - schedule.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
