"""A worker's inner-step rate v_w for DyLU (Liu et al. 2024, arXiv 2401.09135, Eq. 6),
measured over the time spent in its inner steps only (not held replies, transfers, saves
or the caller's own work), the same way on the real and the virtual clock: the mean over
the last ``window`` timed steps without the longest, after ``skip`` warm-up steps
(docs/algorithms.md "The parts": DyLU from the first round).
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
