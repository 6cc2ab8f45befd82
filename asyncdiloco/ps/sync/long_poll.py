"""Long-polled sync waits: a Quorum or Commit call with ``poll`` is held at most ``HOLD_S``
seconds, and only while fewer than ``max_held_waits(pool)`` are held, so a waiting member
costs a registration, not one of the server's RPC threads. docs/protocol.md, "Long-polled waits".
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from collections.abc import Callable, Iterator

from asyncdiloco.errors import InvalidPayloadError

#: Seconds a long-polled Quorum or Commit call may be held at most before it answers
#: "pending" (Quorum) or "not decided" (Commit). Short: the server's shutdown wakes a
#: held call at once anyway, and a waiting member costs a poll per backoff step.
HOLD_S = 1.0
#: Clock seconds a pending quorum request stays registered without a new poll; the
#: client's backoff between polls stays far below it (worker/client.py ``POLL_MAX_S``).
KEEP_S = 15.0
#: At most this fraction of the RPC pool (1 / HELD_FRACTION) holds waiting calls.
HELD_FRACTION = 8
#: The longest ``timeout_s`` a Quorum or Commit call may ask for, seconds. Above it (or
#: not a finite number) the call is refused with INVALID_ARGUMENT: a blocking call holds
#: an RPC thread for its whole wait (a long poll only ``HOLD_S`` of it).
MAX_WAIT_S = 3600.0


def check_wait(timeout_s: float, *, poll: bool, what: str) -> None:
    """Refuse a Quorum/Commit ``timeout_s`` that is not finite, or above ``MAX_WAIT_S``
    without ``poll`` (a long poll's ``timeout_s`` only says when the caller's wait ends).

    Raises:
        InvalidPayloadError: naming the value, the limit and the fix.
    """
    if not math.isfinite(timeout_s):
        raise InvalidPayloadError(f"{what} timeout_s is {timeout_s}; it must be a finite number of seconds")
    if not poll and timeout_s > MAX_WAIT_S:
        raise InvalidPayloadError(
            f"{what} timeout_s is {timeout_s:g} s, above the server's limit of {MAX_WAIT_S:g} s for a blocking "
            f"call; ask for at most {MAX_WAIT_S:g} s and ask again, or set poll (a long poll)"
        )


@dataclasses.dataclass(frozen=True)
class CallWatch:
    """What a held Quorum/Commit wait knows of its RPC: ``alive()`` is False once the
    call ended (the client cancelled or its deadline passed; the servicer passes
    ``context.is_active`` and wakes the waits when the call ends), and ``left_s`` is the
    seconds to its deadline (inf: none), past which no wait lasts."""

    alive: Callable[[], bool]
    left_s: float = math.inf


def _always() -> bool:
    return True


#: No RPC behind the wait (tests, in-process callers).
NO_WATCH = CallWatch(_always)


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
