"""A worker's inner-step rate v_w, measured over the time spent in its inner steps.

DyLU (Liu et al. 2024, "Asynchronous Local-SGD Training for Language Modeling", arXiv
2401.09135, Eq. 6) gives worker w H_w = ⌊v_w / max v · H⌋ local steps per round, so the
rates must be those of the workers' compute: a rate that also counts the time a reply was
held, a transfer, a save, an evaluation or the user's own work between steps makes a
worker look slower than it computes, and it is given too few steps (or, when the fastest
worker's rate is lowered, everybody else too many).

``InnerStepRate`` is the estimator the worker runs (worker/base.py feeds it from hooks on
the model and the inner optimizer) and the virtual-clock simulator runs on its simulated
step times (``step_took``), so both clocks estimate rates the same way:

- A step is timed from its start (``begin``: the first forward pass with gradients
  enabled since the previous step ended) to its end (``end``: the inner optimizer's step
  returned, before any sync the library runs there). Without a ``begin`` (a loop whose
  forward does not go through the hooked module) the step is timed from ``resume``, the
  moment the library handed control back after the previous step, so the sync is still
  left out but the loop's own work between steps is not.
- Warm-up and stalls: the first ``skip`` steps are not timed (they carry one-off costs:
  allocation, kernel selection, compilation), and the estimate is the mean over the last
  ``window`` timed steps without the longest one, so one more slow step at the start, or
  one stall in the window, does not move it. The mean, not the median: DyLU needs the
  throughput, and on a loaded machine step times are heavy-tailed (a fast worker's median
  step on two shared cores was 3.4 ms, its mean 12.9 ms: rates from the median were 3.8×
  too high for it and only 1.1-1.6× for the slow ones, whose steps are mostly sleep).
- A speed change has taken over the estimate fully once the window holds only steps at
  the new speed: after ``window`` steps (16), with the next report; halfway after 8.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable

#: Timed steps the rate is averaged over.
RATE_WINDOW = 16
#: Steps of a new estimator that are not timed (warm-up).
RATE_SKIP_STEPS = 1


class InnerStepRate:
    """Inner steps per second of compute, from per-step durations (see the module docstring).

    Args:
        clock: monotonic seconds (``time.monotonic``; a test or the simulator passes its own).
        window: timed steps the rate is averaged over (≥ 1).
        skip: first steps not timed (≥ 0).
    Raises:
        ValueError: ``window`` < 1 or ``skip`` < 0.

    Not thread-safe: the training thread calls it (the heartbeat thread does not).
    """

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, window: int = RATE_WINDOW, skip: int = RATE_SKIP_STEPS
    ) -> None:
        if window < 1 or skip < 0:
            raise ValueError(f"window={window} and skip={skip} are invalid: window >= 1 step, skip >= 0 steps")
        self._clock = clock
        self._skip = skip
        self._durations: collections.deque[float] = collections.deque(maxlen=window)
        self._begun: float | None = None  # the current step's start (a forward pass)
        self._resumed: float | None = None  # when the library handed back control after the previous step
        #: Steps ended (timed or not), timed steps, and seconds of compute of the timed ones.
        self.steps = 0
        self.timed_steps = 0
        self.compute_s = 0.0

    def begin(self) -> None:
        """A step's compute starts now (the first call since the previous ``end`` counts;
        later ones, e.g. the forward passes of gradient accumulation, are part of it)."""
        if self._begun is None:
            self._begun = self._clock()

    def end(self) -> float | None:
        """The step's compute ended now (its optimizer step returned).

        Returns:
            The step's duration in seconds, or None when it was not timed (a warm-up
            step, or no start known: neither ``begin`` nor ``resume`` since the last end).
        """
        now = self._clock()
        start = self._begun if self._begun is not None else self._resumed
        self._begun = self._resumed = None
        return self.step_took(None if start is None or not now >= start else now - start)

    def step_took(self, duration_s: float | None) -> float | None:
        """One inner step ended that computed for ``duration_s`` seconds (None: unknown).
        ``end`` calls it with the step it timed; the virtual-clock simulator calls it with
        each simulated step's time. The first ``skip`` steps are not timed.

        Returns:
            ``duration_s`` when it was recorded, else None.
        """
        self.steps += 1
        if duration_s is None or self.steps <= self._skip:
            return None
        self.record(duration_s)
        return duration_s

    def resume(self) -> None:
        """The library's work after a step (a sync, a rate report) is over: a step that
        has no ``begin`` is timed from here."""
        self._resumed = self._clock()
        self._begun = None

    def record(self, duration_s: float) -> None:
        """One timed step of ``duration_s`` seconds of compute (ignored unless finite and ≥ 0)."""
        if math.isfinite(duration_s) and duration_s >= 0:
            self._durations.append(duration_s)
            self.timed_steps += 1
            self.compute_s += duration_s

    @property
    def steps_per_s(self) -> float:
        """v_w = timed steps ÷ their seconds over the last ``window`` timed steps without
        the longest one (all of them while fewer than 3 are timed), inner steps per
        second; 0.0 while no step was timed (or they took no time)."""
        durations = list(self._durations)
        if len(durations) >= 3:
            durations.remove(max(durations))
        total = sum(durations)
        return len(durations) / total if durations and total > 0 else 0.0

    def seconds_for(self, steps: int) -> float:
        """The compute seconds ``steps`` inner steps take at ``steps_per_s`` (0.0 while unknown)."""
        rate = self.steps_per_s
        return steps / rate if rate > 0 else 0.0
