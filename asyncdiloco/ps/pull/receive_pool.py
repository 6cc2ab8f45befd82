"""The receive budget: preallocated uint8 buffers for incoming pushes, within
``--receive-buffer-mib`` (a push that finds it spent waits before its stream is read,
so gRPC's flow control holds its sender back). A buffer can be held past its push
(``hold``): a raw fp32 model's replaced version being pulled lives in the buffer of the
push that replaced it (live_view.py). docs/performance.md.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable

import torch

from asyncdiloco.errors import ServerBusyError


class ReceivePool:
    """Preallocated receive buffers for pushes, within a byte budget.

    Args:
        budget_bytes: most bytes of buffers handed out at once (>= 0); one buffer is
            always allowed even when it alone is larger. Free buffers are kept for reuse
            up to the same budget.
        wait_s: how long ``acquire`` waits for room by default, seconds.
        hold_lease_s: a ``hold`` older than this, seconds, is evicted (its holder moves
            the bytes out of the pool) when a push waits for room, so a stalled pull of
            an old version cannot hold pushes back for good.
        clock: monotonic clock for the holds' ages, seconds.
    """

    def __init__(
        self, budget_bytes: int, wait_s: float = 30.0, hold_lease_s: float = 60.0, clock=time.monotonic
    ) -> None:
        self.budget_bytes = budget_bytes
        self.wait_s = wait_s
        self.hold_lease_s = hold_lease_s
        self._clock = clock
        self._evictable: list[list] = []  # [since, evict or None] of each hold not ended yet
        self._cond = threading.Condition()
        self._in_use_bytes = 0
        self._in_use = 0
        self._free: dict[int, list[torch.Tensor]] = {}
        self._free_bytes = 0
        self._out: dict[int, torch.Tensor] = {}  # id() -> the buffers handed out
        self._holds: dict[int, int] = {}  # id() -> releases still owed beyond the first (``hold``)
        #: Most buffers that were out at once (for the benchmarks and tests).
        self.peak_in_use = 0

    def acquire(self, nbytes: int, timeout_s: float | None = None, is_active=None) -> torch.Tensor:
        """A 1-D uint8 CPU tensor of ``nbytes`` (contents undefined), reused when one
        of that size is free.

        Raises:
            ServerBusyError: no buffer became free within ``timeout_s`` seconds (default
                ``wait_s``; the other pushes in flight hold the whole budget), or
                ``is_active()`` turned False meanwhile (the caller's RPC ended); retry the push.
        """
        deadline = time.monotonic() + (self.wait_s if timeout_s is None else timeout_s)
        with self._cond:
            while self._in_use and self._in_use_bytes + nbytes > self.budget_bytes:
                if self._evict_stale_holds_locked():
                    continue
                left = deadline - time.monotonic()
                if is_active is not None and not is_active():
                    raise ServerBusyError(
                        "the push ended (cancelled or timed out) while it waited for a receive buffer"
                    )
                if left <= 0:
                    raise ServerBusyError(
                        f"{self._in_use} pushes of {self._in_use_bytes} bytes in all are being received and a push of "
                        f"{nbytes} bytes would exceed the receive budget of {self.budget_bytes} bytes; retry the "
                        f"push (the worker does, with backoff), or raise the server's --receive-buffer-mib"
                    )
                self._cond.wait(min(left, 0.5))  # wakes to notice a cancelled caller
            self._in_use += 1
            self._in_use_bytes += nbytes
            self.peak_in_use = max(self.peak_in_use, self._in_use)
            free = self._free.get(nbytes)
            if free:
                self._free_bytes -= nbytes
                buffer = free.pop()
            else:
                self._drop_free_beyond_budget_locked()
                buffer = torch.empty(nbytes, dtype=torch.uint8)
            self._out[id(buffer)] = buffer
            return buffer

    def _drop_free_beyond_budget_locked(self) -> None:
        """Free kept buffers (of other sizes: e.g. the raw initial parameters' before
        encoded pushes) while the buffers out and kept exceed the budget."""
        for size in sorted(self._free, reverse=True):
            kept = self._free[size]
            while kept and self._in_use_bytes + self._free_bytes > self.budget_bytes:
                kept.pop()
                self._free_bytes -= size
            if not kept:
                del self._free[size]

    def hold(self, view: torch.Tensor, evict: Callable[[], None] | None = None) -> Callable[[], None] | None:
        """Keep the handed-out buffer ``view`` lies in (a tensor sharing its memory) out of
        the pool, and counted in the budget, past its ``release``: until the returned
        function is called too (once). None when ``view`` is in no buffer handed out.
        ``evict``: called (once, no lock held) when the hold is older than
        ``hold_lease_s`` and a push waits for room; it must end the hold soon after."""
        ptr = view.untyped_storage().data_ptr()
        with self._cond:
            for key, buffer in self._out.items():
                if buffer.untyped_storage().data_ptr() == ptr:
                    self._holds[key] = self._holds.get(key, 0) + 1
                    entry = [self._clock(), evict]
                    self._evictable.append(entry)
                    return functools.partial(self._end_hold, buffer, entry)
        return None

    def _end_hold(self, buffer: torch.Tensor, entry: list) -> None:
        with self._cond:
            if entry in self._evictable:
                self._evictable.remove(entry)
        self.release(buffer)

    def _evict_stale_holds_locked(self) -> bool:
        """Ask the holders of holds older than ``hold_lease_s`` to let go (the lock is
        dropped meanwhile); True when any was asked."""
        now = self._clock()
        stale = [e for e in self._evictable if e[1] is not None and now - e[0] > self.hold_lease_s]
        if not stale:
            return False
        evicts = [e[1] for e in stale]
        for e in stale:
            e[1] = None  # asked once
        self._cond.release()
        try:
            for evict in evicts:
                evict()
        finally:
            self._cond.acquire()
        return True

    def release(self, buffer: torch.Tensor) -> None:
        """Give a buffer from ``acquire`` back (keep it for reuse within the budget). A
        buffer the pool did not hand out, or already took back, is ignored."""
        nbytes = buffer.numel()
        with self._cond:
            key = id(buffer)
            if key not in self._out:
                return
            if self._holds.get(key):
                self._holds[key] -= 1
                if not self._holds[key]:
                    del self._holds[key]
                return
            del self._out[key]
            self._in_use -= 1
            self._in_use_bytes -= nbytes
            if self._free_bytes + nbytes <= max(self.budget_bytes, nbytes):
                self._free.setdefault(nbytes, []).append(buffer)
                self._free_bytes += nbytes
            self._cond.notify_all()
