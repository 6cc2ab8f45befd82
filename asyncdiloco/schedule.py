"""Who syncs when: Dynamic Local Updates (DyLU) and the grace window.

Both come from Liu et al. 2024, "Asynchronous Local-SGD Training for Language
Modeling", arXiv 2401.09135, and are shared by the parameter server (real clock) and
the virtual-clock simulator, so the two run the same logic.

- DyLU (Eq. 6): a worker with measured speed v_w (inner steps per second) runs
  H_w = ⌊ v_w / max_w' v_w' · H ⌋ inner steps per round (at least 1), so slow workers
  push as often as fast ones and their pseudo-gradients are not staler.
- Grace window (Alg. 2): pushes that arrive within ``grace_s`` of each other are
  applied back to back and all those workers restart from the same server model; the
  window closes once ``grace_s`` passes without a new arrival.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping


def dylu_local_steps(steps_per_s: Mapping[int, float], local_steps: int) -> dict[int, int]:
    """H_w for every worker with a measured speed (Liu et al. 2024, Eq. 6).

    Args:
        steps_per_s: worker id -> v_w, inner steps per second (> 0).
        local_steps: H, the fastest worker's local steps.
    Returns:
        worker id -> H_w = max(1, ⌊ v_w / max v · H ⌋).
    """
    if not steps_per_s:
        return {}
    fastest = max(steps_per_s.values())
    if not fastest > 0:
        return {w: local_steps for w in steps_per_s}
    return {w: max(1, math.floor(v / fastest * local_steps + 1e-9)) for w, v in steps_per_s.items()}


class StepRateMeter:
    """Per-worker inner-step rate (steps per second), measured by the server's clock.

    Each push of ``num_local_steps`` steps arriving ``dt`` seconds after the worker's
    previous push (or its join) gives a sample ``num_local_steps / dt``; the estimate is
    an exponential moving average with weight ``alpha`` on the newest sample.
    """

    def __init__(self, alpha: float = 0.5) -> None:
        self.alpha = alpha
        self._last: dict[int, float] = {}
        self.rates: dict[int, float] = {}

    def start(self, worker_id: int, now: float) -> None:
        """The worker joined (or was reset) at ``now``."""
        self._last[worker_id] = now
        self.rates.pop(worker_id, None)

    def record(self, worker_id: int, num_local_steps: int, now: float) -> None:
        last = self._last.get(worker_id)
        self._last[worker_id] = now
        if last is None or num_local_steps <= 0 or now <= last:
            return
        sample = num_local_steps / (now - last)
        old = self.rates.get(worker_id)
        self.rates[worker_id] = sample if old is None else (1 - self.alpha) * old + self.alpha * sample

    def forget(self, worker_id: int) -> None:
        self._last.pop(worker_id, None)
        self.rates.pop(worker_id, None)


class GraceWindow:
    """Holds push replies until ``grace_s`` passes without a new arrival (real clock).

    ``arrive()`` is called when a push is applied; ``wait()`` then blocks the replying
    thread until the window closes, so every worker whose push landed in the window
    pulls the same model. ``max_wait_s`` bounds the wait under a steady stream.
    """

    def __init__(self, grace_s: float, clock: Callable[[], float], max_wait_s: float | None = None) -> None:
        self.grace_s = grace_s
        self.max_wait_s = max_wait_s if max_wait_s is not None else 10 * grace_s
        self._clock = clock
        self._cond = threading.Condition()
        self._last_arrival = -math.inf

    def arrive(self) -> None:
        with self._cond:
            self._last_arrival = self._clock()
            self._cond.notify_all()

    def wait(self) -> float:
        """Block until the window closes; returns the seconds waited."""
        if self.grace_s <= 0:
            return 0.0
        start = self._clock()
        with self._cond:
            while True:
                now = self._clock()
                if not in_grace_window(self._last_arrival, now, self.grace_s) or now - start >= self.max_wait_s:
                    return now - start
                remaining = min(self._last_arrival + self.grace_s, start + self.max_wait_s) - now
                self._cond.wait(remaining)


def in_grace_window(last_arrival_s: float, arrival_s: float, grace_s: float) -> bool:
    """Whether an arrival at ``arrival_s`` joins the window of the previous arrival at
    ``last_arrival_s`` (the rule ``GraceWindow`` applies on the real clock and the
    simulator on the virtual one)."""
    return arrival_s - last_arrival_s <= grace_s
