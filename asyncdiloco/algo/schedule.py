"""Who syncs when (Liu et al. 2024, arXiv 2401.09135), shared by the server and the
virtual-clock simulator: Dynamic Local Updates (Eq. 6, H_w = ⌊v_w / max v · H⌋ inner
steps per round, at least 1, from the workers' reported rates, algo/rates.py) and
grouping of pushes (Alg. 2, the grace window ``GroupWindow``: replies held until every
expected worker arrived, or the Delayed Nesterov buffer is complete, at the latest when
the window opened at the group's first arrival ends); docs/algorithms.md.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import threading
from collections.abc import Callable, Iterable, Mapping

#: Grouping modes: "off" (replies at once), "window" (all expected workers, or the window),
#: "barrier" (the Delayed Nesterov buffer complete, or the cap).
GROUPINGS = ("off", "window", "barrier")
#: The longest auto window, seconds (a rate reported absurdly low cannot hold replies longer).
MAX_WINDOW_S = 600.0
#: Reported or measured rates are clamped to this range, inner steps per second.
RATE_RANGE = (1e-4, 1e7)
#: A rate sample is also clamped to within this factor of the median rate of the other
#: workers with a known rate: one worker's absurd report (1e-6 or 1e300 steps/s) cannot
#: set everybody's H_w to 1 or hold every push for the longest window.
RATE_SPREAD = 10.0
#: Real seconds between two rechecks of a held push's group (``GroupGate.wait`` with
#: ``refresh``): an expected worker whose lease lapsed stops holding it within this.
RECHECK_S = 0.5


def dylu_local_steps(steps_per_s: Mapping[int, float], local_steps: int) -> dict[int, int]:
    """H_w for every worker with a known rate (Liu et al. 2024, Eq. 6).

    Args:
        steps_per_s: worker id -> v_w, inner steps per second (> 0); pass the live
            workers only: the fastest of them runs H.
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
    """Per-worker inner-step rate v_w, inner steps per second of the worker's compute:
    the rate DyLU uses and ``Status`` shows (``rates``).

    Samples come from the worker: a rate it reports (``report``: its estimate, a
    heartbeat before its first push or a Join) or a push of ``num_local_steps`` steps
    that took ``compute_s`` seconds of its compute (``record``; the library's worker sends
    num_local_steps / its estimate, algo/rates.py ``InnerStepRate``). The worker's own
    estimate is already an average over its recent steps, so such a sample replaces the
    previous rate (no second smoothing, no lag added). A push without ``compute_s``
    falls back to the time since the worker's previous push on the server's clock
    (which includes communication and waiting, so it is used only when nothing better
    is known), averaged in with weight ``alpha`` on the newest interval.
    """

    def __init__(self, alpha: float = 0.5, spread: float = RATE_SPREAD) -> None:
        self.alpha = alpha
        self.spread = spread
        self._last: dict[int, float] = {}
        self.rates: dict[int, float] = {}

    def start(self, worker_id: int, now: float) -> None:
        """The worker joined (or was reset) at ``now``."""
        self._last[worker_id] = now
        self.rates.pop(worker_id, None)

    def report(self, worker_id: int, steps_per_s: float) -> None:
        """A rate the worker measured itself (ignored unless finite and > 0)."""
        if math.isfinite(steps_per_s) and steps_per_s > 0:
            self._sample(worker_id, steps_per_s, weight=1.0)

    def record(self, worker_id: int, num_local_steps: int, now: float, compute_s: float = 0.0) -> None:
        """A push of ``num_local_steps`` steps arrived at ``now`` (server clock) after
        ``compute_s`` seconds of the worker's compute (0 = unknown)."""
        last = self._last.get(worker_id)
        self._last[worker_id] = now
        if num_local_steps <= 0:
            return
        if math.isfinite(compute_s) and compute_s > 0:
            self._sample(worker_id, num_local_steps / compute_s, weight=1.0)
        elif last is not None and now > last:
            self._sample(worker_id, num_local_steps / (now - last), weight=self.alpha)

    def _sample(self, worker_id: int, sample: float, weight: float) -> None:
        """Fold in one sample with ``weight`` (1: it replaces the rate), clamped to
        ``RATE_RANGE`` and to [m / spread, m · spread], m the median rate of the other
        workers with a known rate (none: no such bound)."""
        sample = min(max(sample, RATE_RANGE[0]), RATE_RANGE[1])
        others = [v for w, v in self.rates.items() if w != worker_id]
        if others:
            mid = statistics.median(others)
            sample = min(max(sample, mid / self.spread), mid * self.spread)
        old = self.rates.get(worker_id)
        self.rates[worker_id] = sample if old is None else (1 - weight) * old + weight * sample

    def forget(self, worker_id: int) -> None:
        self._last.pop(worker_id, None)
        self.rates.pop(worker_id, None)


def auto_window_s(rates: Iterable[float], local_steps: int, floor_s: float = 0.05) -> float:
    """The grouping window when ``grace_s`` is auto: one round of the fastest live worker
    (H / max v), and at least 1.5 inner steps of the slowest one, in seconds.

    DyLU leaves the workers of a released group less than one of their own inner steps
    apart, but on a real clock their rounds also start apart (processes that start at
    different times, pulls of different lengths) and their rates are estimates. A window
    of one round lets a worker that missed its group catch the next one: the others'
    next pushes land in the window its own push opened, and the group is whole again
    (with a window of one slow step the offsets of the first round persisted and most
    groups held one or two pushes; docs/algorithms.md, "Grouping"). Every group is released as
    soon as all expected workers are in, so the window costs time only when one is late.
    1 s while no rate is known.
    """
    rates = [v for v in rates if v > 0]
    if not rates:
        return 1.0
    return min(MAX_WINDOW_S, max(floor_s, local_steps / max(rates), 1.5 / min(rates)))


@dataclasses.dataclass
class _Group:
    group_id: int
    opened_at: float
    deadline: float
    members: set[int] = dataclasses.field(default_factory=set)
    arrivals: int = 0
    released_at: float | None = None


class GroupWindow:
    """When the pushes of a group are released (pure logic; the clock is passed in).

    The parameter server calls ``arrive`` for every applied pseudo-gradient and holds
    the reply until ``released`` (``GroupGate`` waits for it on the real clock); the
    simulator asks the same object on its virtual clock. A group opens at its first
    arrival with a deadline ``window_s`` later and is released at the first of:

    - ``"window"``: every expected worker has arrived in it;
    - ``"barrier"``: the Delayed Nesterov buffer is complete (the caller says so), or
      every expected worker has arrived (a buffer larger than the workers never fills);
    - the deadline (a dead or late worker never holds the others longer).

    An arrival after its group's release opens the next group.
    """

    def __init__(self, mode: str) -> None:
        if mode not in GROUPINGS:
            raise ValueError(f"grouping {mode!r} is unknown: choose one of {GROUPINGS}")
        self.mode = mode
        self._groups: dict[int, _Group] = {}
        self._open: _Group | None = None
        self._next_id = 1
        #: Sizes (arrivals) of the released groups, for status: [n(size 1), n(size 2), …].
        self.size_histogram: list[int] = []

    def arrive(self, worker_id: int, now: float, live: set[int], window_s: float, buffer_complete: bool = False) -> int:
        """Record an applied push of ``worker_id`` at ``now``; returns its group id.

        Args:
            live: ids of the live workers (the "window" mode releases once all arrived).
            window_s: seconds from the group's first arrival to its deadline.
            buffer_complete: the Delayed Nesterov buffer just completed ("barrier").
        """
        group = self._open
        if group is not None:
            self._expire(group, now)
        if group is None or group.released_at is not None:
            group = _Group(self._next_id, now, now + max(0.0, window_s))
            self._next_id += 1
            self._groups[group.group_id] = group
            self._open = group
        group.members.add(worker_id)
        group.arrivals += 1
        self._check_complete(group, now, live, buffer_complete)
        return group.group_id

    def recheck(self, now: float, live: set[int], window_s: float | None = None) -> None:
        """A worker left or lapsed: the open group may now hold every expected worker.
        ``window_s`` (the window as of now): the group's deadline moves earlier to its
        first arrival + ``window_s`` when that is sooner (a slow worker's lease lapsed)."""
        group = self._open
        if group is None or group.released_at is not None:
            return
        if window_s is not None:
            group.deadline = min(group.deadline, group.opened_at + max(0.0, window_s))
        self._expire(group, now)
        if group.released_at is None:
            self._check_complete(group, now, live, False)

    def _check_complete(self, group: _Group, now: float, live: set[int], buffer_complete: bool) -> None:
        if self.mode == "off":
            self._release(group, now)
        elif live <= group.members or (self.mode == "barrier" and buffer_complete):
            self._release(group, now)

    def _expire(self, group: _Group, now: float) -> None:
        if group.released_at is None and now >= group.deadline:
            self._release(group, group.deadline)

    def _release(self, group: _Group, at: float) -> None:
        group.released_at = at
        while len(self.size_histogram) < group.arrivals:
            self.size_histogram.append(0)
        self.size_histogram[group.arrivals - 1] += 1
        for old in [g for g in self._groups if g < group.group_id - 64]:  # keep the recent ones only
            del self._groups[old]

    def release_all(self, now: float) -> None:
        """Release the open group now (the server is stopping)."""
        if self._open is not None and self._open.released_at is None:
            self._release(self._open, now)

    def released(self, group_id: int, now: float) -> bool:
        """Whether the group is released at ``now`` (releases it at its deadline)."""
        group = self._groups.get(group_id)
        if group is None:
            return True
        self._expire(group, now)
        return group.released_at is not None

    def deadline(self, group_id: int) -> float:
        """The latest time the group is released at."""
        group = self._groups.get(group_id)
        return -math.inf if group is None else group.deadline

    def release_time(self, group_id: int) -> float | None:
        """When the group was released (None: not yet)."""
        group = self._groups.get(group_id)
        return None if group is None else group.released_at


class GroupGate:
    """``GroupWindow`` on the real clock: threads wait for their group's release.

    All methods are thread-safe. ``wait`` blocks until the group is released (every
    live worker arrived, the buffer completed, or the deadline passed).
    """

    def __init__(self, mode: str, clock: Callable[[], float]) -> None:
        self.window = GroupWindow(mode)
        self._clock = clock
        self._cond = threading.Condition()

    def arrive(self, worker_id: int, live: set[int], window_s: float, buffer_complete: bool = False) -> int:
        with self._cond:
            group_id = self.window.arrive(worker_id, self._clock(), live, window_s, buffer_complete)
            self._cond.notify_all()
            return group_id

    def recheck(self, live: set[int], window_s: float | None = None) -> None:
        """``GroupWindow.recheck`` now; wakes the held replies."""
        with self._cond:
            self.window.recheck(self._clock(), live, window_s)
            self._cond.notify_all()

    def wait(
        self, group_id: int, max_wait_s: float = math.inf, refresh: Callable[[], tuple[set[int], float]] | None = None
    ) -> float:
        """Block until group ``group_id`` is released, or ``max_wait_s`` (the caller's
        deadline); returns the seconds waited (clock seconds).

        ``refresh`` returns (the expected workers, the window) as of now; it is called
        every ``RECHECK_S`` real seconds without this gate's lock, and the group is
        rechecked with them (``GroupWindow.recheck``): a held reply goes out once no
        expected worker is missing (one's lease lapsed) or the shrunk window ended.
        """
        start = self._clock()
        with self._cond:
            if self.window.released(group_id, start):
                return 0.0  # not held
        while True:
            with self._cond:
                now = self._clock()
                if self.window.released(group_id, now) or now - start >= max_wait_s:
                    return now - start
                until = min(self.window.deadline(group_id), start + max_wait_s)
                wait_s = max(1e-3, until - now)
                self._cond.wait(min(threading.TIMEOUT_MAX, wait_s if refresh is None else min(wait_s, RECHECK_S)))
            if refresh is not None and not self.released_now(group_id):
                self.recheck(*refresh())

    def released_now(self, group_id: int) -> bool:
        """Whether group ``group_id`` is released (at its deadline, if passed)."""
        with self._cond:
            return self.window.released(group_id, self._clock())

    def close(self) -> None:
        """Release every held reply (the server is stopping)."""
        with self._cond:
            self.window.release_all(self._clock())
            self._cond.notify_all()

    def size_histogram(self) -> list[int]:
        with self._cond:
            return list(self.window.size_histogram)
