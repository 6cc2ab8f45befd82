"""Learning-rate schedules: linear warmup, then constant or cosine decay to a floor.

One schedule shape serves both optimizers, keyed by different counters:

- the **outer** optimizer's η is keyed by the **version** v the update is applied at,
  i.e. the number of outer updates applied before it (0 for the first one): the update
  that takes the global model from version v to v + 1 uses η · lr_factor(v). The
  server, its write-ahead-log replay and every sync-mode member use this v.
- the **inner** optimizer's lr is keyed by the worker's own **inner step** k (0 for
  its first ``inner.step()``), through ``torch.optim.lr_scheduler.LambdaLR``.

The factor f(t) multiplies the peak learning rate (W = ``warmup``, T = ``total``,
r = ``min_ratio``; t is 0-based):

- warmup, t < W:       f(t) = (t + 1) / W   (the first update already moves; t = W − 1 is the peak)
- ``constant``, t ≥ W: f(t) = 1
- ``cosine``, W ≤ t < T: f(t) = r + (1 − r) · ½ · (1 + cos(π · (t − W) / (T − W)))
- ``cosine``, t ≥ T:   f(t) = r   (stays at the floor)

Warmup then cosine annealing as in SGDR (Loshchilov & Hutter 2017, arXiv 1608.03983,
Eq. 5, one cycle without restarts), the schedule DiLoCo's inner AdamW uses (Douillard
et al. 2023, arXiv 2311.08105, Sec. 3: linear warmup, cosine decay).
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
