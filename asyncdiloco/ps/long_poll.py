"""Long-polled sync waits: how long, and how many at once, a Quorum or Commit call may
hold one of the server's RPC threads.

The gRPC server runs every call on a fixed pool of ``max_concurrent_rpcs`` threads
(server.py). A Quorum or Commit call that blocked for its whole wait held one of them,
so one server could not serve a quorum larger than its pool. With ``poll`` set in the
request (docs/protocol.md, "Long-polled waits") a call is held at most ``HOLD_S``
seconds, and only while fewer than ``max_held_waits(pool)`` calls are held: otherwise it
is answered at once. The request stays registered between polls (quorum.py
``poll_quorum``; a vote counts once), so a waiting member costs a registration, not a
thread, and the rest of the pool keeps serving pushes, pulls, heartbeats and Status.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

#: Seconds a long-polled Quorum or Commit call may be held at most before it answers
#: "pending" (Quorum) or "not decided" (Commit). Short: the server's shutdown wakes a
#: held call at once anyway, and a waiting member costs a poll per backoff step.
HOLD_S = 1.0
#: Clock seconds a pending quorum request stays registered without a new poll; the
#: client's backoff between polls stays far below it (worker/client.py ``POLL_MAX_S``).
KEEP_S = 15.0
#: At most this fraction of the RPC pool (1 / HELD_FRACTION) holds waiting calls.
HELD_FRACTION = 8


def max_held_waits(pool: int) -> int:
    """How many long-polled calls may be held at once by a pool of ``pool`` RPC threads
    (≥ 1, and ``pool // 8``: 8 of the default 64)."""
    return max(1, pool // HELD_FRACTION)


class HeldWaits:
    """Counts the long-polled calls held now; ``hold`` grants a hold only below the limit.

    Args:
        limit: most calls held at once, ≥ 1 (``max_held_waits(pool)``).
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit is {limit}; it must be >= 1 held call")
        self.limit = limit
        self._lock = threading.Lock()
        self._held = 0
        #: The most calls held at once so far (for tests and the docs' measurements).
        self.peak = 0

    @contextlib.contextmanager
    def hold(self, want_s: float) -> Iterator[float]:
        """Yields the seconds this call may wait: ``min(want_s, HOLD_S)`` when a hold is
        free (it is taken until the block ends), 0 (answer at once) when every hold is
        taken or ``want_s`` ≤ 0."""
        with self._lock:
            granted = want_s > 0 and self._held < self.limit
            if granted:
                self._held += 1
                self.peak = max(self.peak, self._held)
        try:
            yield min(want_s, HOLD_S) if granted else 0.0
        finally:
            if granted:
                with self._lock:
                    self._held -= 1
