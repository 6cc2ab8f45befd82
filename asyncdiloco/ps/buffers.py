"""The server's payload memory: pooled receive buffers and the shared pull snapshots.

Two rules: a fresh large allocation faults every page on first touch (a copy into it
is several times slower than a copy into reused memory), and peak memory must not grow
with the number of workers pushing at once, nor with the versions being pulled. So:

* ``ReceivePool`` hands out preallocated uint8 buffers for incoming pushes and takes
  them back; the bytes of all buffers in use at once stay within ``budget_bytes`` (but
  one push is always admitted, whatever its size). A push that finds the budget spent
  waits for a buffer before its stream is read, so its sender is held back by gRPC's
  flow control instead of the server holding its bytes. A buffer can be *held* past
  its push (``hold``): a raw fp32 model's old version being pulled lives in the buffer
  of the push that replaced it (live.py). Server memory is then about θ + momentum +
  max(budget_bytes, one payload), whatever the number of workers and of versions pulled.
* ``Snapshot`` (encoded models) is one version of the global model already encoded as the Pull stream's
  chunk messages (wire/grpc_chunks.py), built once per version and shared by every
  concurrent pull, which then copies nothing. ``PullSnapshots`` counts which versions are
  alive; snapshots.py builds them.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from asyncdiloco.errors import InvalidPayloadError, ServerBusyError
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.grpc_chunks import chunk_messages, chunk_prefix
from asyncdiloco.wire.tensors import chunk_views, crc32_update, num_chunks_for

if TYPE_CHECKING:
    from asyncdiloco.ps.live import LiveView


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


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """The global parameters at one version, encoded for Pull; never mutated.

    Attributes:
        version: the global version.
        total_bytes: payload size in bytes (the manifest's layout).
        crc32: CRC-32 of the payload.
        messages: the serialised ``PullMessage(chunk=...)`` of each chunk, in order.
        data_offsets: where the payload bytes start inside each message.
    """

    version: int
    total_bytes: int
    crc32: int
    messages: tuple[bytes, ...]
    data_offsets: tuple[int, ...]

    def data_views(self) -> Iterator[memoryview]:
        """The payload as read-only memoryviews, one per chunk, zero-copy."""
        for msg, start in zip(self.messages, self.data_offsets):
            yield memoryview(msg)[start:]


def new_bytes(nbytes: int) -> tuple[bytes, memoryview]:
    """A new ``bytes`` object of ``nbytes`` (contents undefined) and a writable view of
    its contents: CPython's ``PyBytes_FromStringAndSize(NULL, n)``, whose contents the C
    API lets its creator fill before the object is shared. Only its creator writes
    through the view (``SnapshotBuilder`` before its ``Snapshot`` exists, live.py before
    the message is yielded), before anyone else holds the object; gRPC sends ``bytes``
    without copying them again (a ``bytearray`` would cost one more copy)."""
    obj = _PyBytes_FromStringAndSize(None, nbytes)
    if not nbytes:
        return obj, memoryview(bytearray())
    address = _PyBytes_AsString(obj)
    return obj, memoryview((ctypes.c_ubyte * nbytes).from_address(address)).cast("B")


_PyBytes_FromStringAndSize = ctypes.pythonapi.PyBytes_FromStringAndSize
_PyBytes_FromStringAndSize.argtypes = (ctypes.c_char_p, ctypes.c_ssize_t)
_PyBytes_FromStringAndSize.restype = ctypes.py_object
_PyBytes_AsString = ctypes.pythonapi.PyBytes_AsString
_PyBytes_AsString.argtypes = (ctypes.py_object,)
_PyBytes_AsString.restype = ctypes.c_void_p


class SnapshotBuilder:
    """Builds one ``Snapshot`` from the payload's bytes fed in order, in pieces of any
    size: each piece is copied into its place in the chunk messages (allocated up front,
    their headers written) and folded into the CRC-32 while it is still in cache. The
    outer step feeds each block of θ as soon as it is updated (snapshots.py), so the new
    θ is read once, from cache, instead of in a second pass over the whole model.

    Args:
        version: the global version the snapshot is of.
        total_bytes: payload size in bytes (>= 0).
        chunk_bytes: payload bytes per chunk message (> 0).
    Raises:
        InvalidPayloadError: ``chunk_bytes`` <= 0 (constructor); ``feed`` past
            ``total_bytes``; ``finish`` before every byte was fed.
    """

    def __init__(self, version: int, total_bytes: int, chunk_bytes: int) -> None:
        self.version, self.total_bytes, self.chunk_bytes = version, total_bytes, chunk_bytes
        if chunk_bytes <= 0:
            raise InvalidPayloadError(f"chunk_bytes is {chunk_bytes}; it must be > 0")
        messages, offsets, views = [], [], []
        for index in range(num_chunks_for(total_bytes, chunk_bytes)):
            offset = index * chunk_bytes
            n = min(chunk_bytes, total_bytes - offset)
            prefix = chunk_prefix(index, offset, n)
            msg, view = new_bytes(len(prefix) + n)
            view[: len(prefix)] = prefix
            messages.append(msg)
            offsets.append(len(prefix))
            views.append(view[len(prefix) :])
        self._messages, self._offsets, self._views = messages, offsets, views
        self._filled = 0
        self._crc = 0

    def feed(self, data: memoryview) -> None:
        """Copy the payload's next ``len(data)`` bytes (a C-contiguous 'B' buffer) into place."""
        n = data.nbytes
        if self._filled + n > self.total_bytes:
            raise InvalidPayloadError(f"snapshot fed {self._filled + n} bytes; the payload is {self.total_bytes} bytes")
        pos = 0
        while pos < n:
            index, within = divmod(self._filled, self.chunk_bytes)
            dst = self._views[index]
            take = min(len(dst) - within, n - pos)
            dst[within : within + take] = data[pos : pos + take]
            pos += take
            self._filled += take
        self._crc = crc32_update(self._crc, data)

    def finish(self) -> Snapshot:
        """The snapshot, once every byte was fed."""
        if self._filled != self.total_bytes:
            raise InvalidPayloadError(f"snapshot fed {self._filled} of {self.total_bytes} bytes")
        self._views = []  # no writes after this
        return Snapshot(self.version, self.total_bytes, self._crc, tuple(self._messages), tuple(self._offsets))


def encode_snapshot(version: int, payload: torch.Tensor, chunk_bytes: int) -> Snapshot:
    """Copy a uint8 payload (1-D CPU tensor) into the Pull stream's chunk messages (the
    only copy a pull's bytes make on the server) and take its CRC-32, chunk by chunk
    while each copy is still in cache. Call it while the payload cannot change."""
    builder = SnapshotBuilder(version, payload.numel(), chunk_bytes)
    for _, _, part in chunk_views(payload, chunk_bytes):
        builder.feed(part)
    return builder.finish()


class PullSnapshots:
    """The snapshots pulls are served from, at most ``max_snapshots`` versions in memory.

    The newest snapshot is *published*; each pull registers as a reader of the snapshot
    it streams (``acquire_*``) and unregisters when done (``release``), so an older
    snapshot lives exactly as long as pulls still stream it. A new snapshot is built only
    when there is room: (versions still being read) + 1 ≤ ``max_snapshots``.

    Args:
        max_snapshots: most snapshot versions alive at once (>= 1). Each costs one
            payload of memory; with 1, a pull of a new version waits for the pulls of
            the previous one to finish.
        stale_after_s: a pull that started longer ago than this no longer holds a slot
            (the server's lease, so one stalled client cannot keep every pull on an old
            version); its snapshot lives on until that pull ends.
    """

    def __init__(self, max_snapshots: int, stale_after_s: float = 60.0, clock=time.monotonic) -> None:
        self.max_snapshots = max_snapshots
        self.stale_after_s = stale_after_s
        self._clock = clock
        self._cond = threading.Condition()
        self._published: Snapshot | None = None
        self._readers: dict[int, list[float]] = {}  # version -> start times of the pulls streaming it
        #: A pull came since the last snapshot was built: the next apply should build one.
        self.wanted = False
        self._last_pull_at: float | None = None  # the clock at the newest pull (None: none yet)

    def _reading_versions(self) -> int:
        """Versions a pull started less than ``stale_after_s`` ago still reads (a pull
        stalled for longer, e.g. a client that stopped reading, no longer holds a slot;
        its snapshot is freed when that pull finally ends)."""
        recent = self._clock() - self.stale_after_s
        return sum(1 for starts in self._readers.values() if starts and starts[-1] > recent)

    def _make_room_locked(self) -> bool:
        reading = self._reading_versions()
        pub = self._published
        unread = pub is not None and not self._readers.get(pub.version)
        if reading + unread + 1 <= self.max_snapshots:
            return True
        if reading + 1 <= self.max_snapshots:  # only the unread published one is in the way:
            self._published = None  # the snapshot about to be built supersedes it; free it first
            return True
        return False

    def has_room(self) -> bool:
        """True when one more snapshot may be built now: the versions alive (being read,
        or published) stay within ``max_snapshots``; an unread published snapshot is
        dropped first when that is what makes room."""
        with self._cond:
            return self._make_room_locked()

    def wait_for_room(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds until ``has_room``; False if it never came."""
        with self._cond:
            return self._cond.wait_for(self._make_room_locked, timeout_s)

    def acquire_if(self, version: int | None) -> Snapshot | None:
        """The published snapshot, registered as read by the caller, if it is of
        ``version`` (any version when None); else None. Marks snapshots as wanted."""
        with self._cond:
            self.wanted = True
            self._last_pull_at = self._clock()
            snap = self._published
            if snap is None or (version is not None and snap.version != version):
                return None
            self._readers.setdefault(snap.version, []).append(self._clock())
            return snap

    def note_pull(self) -> None:
        """A pull came (one served from θ itself, not from a snapshot here)."""
        with self._cond:
            self.wanted = True
            self._last_pull_at = self._clock()

    def pulls_recent(self) -> bool:
        """True when a pull came within the last ``stale_after_s`` seconds."""
        with self._cond:
            return self._last_pull_at is not None and self._clock() - self._last_pull_at <= self.stale_after_s

    def published_version(self) -> int | None:
        """The published snapshot's version (None: none is published)."""
        with self._cond:
            return None if self._published is None else self._published.version

    def publish(self, snap: Snapshot, *, acquire: bool = False, keep_wanted: bool = False) -> None:
        """Make ``snap`` the newest (ignored if an even newer one is published); the
        previous one lives on only while pulls still read it. ``keep_wanted``: leave
        ``wanted`` as it is (a snapshot built ahead of an apply, not for the pulls after it)."""
        with self._cond:
            if self._published is None or self._published.version < snap.version:
                self._published = snap
            if not keep_wanted:
                self.wanted = acquire  # built for a pull: pulls are coming, the next apply builds its own
            if acquire:
                self._readers.setdefault(snap.version, []).append(self._clock())

    def release(self, snap: Snapshot) -> None:
        """A pull of ``snap`` finished (or was cancelled)."""
        with self._cond:
            starts = self._readers.get(snap.version)
            if starts:
                starts.pop(0)  # which pull ended does not matter: the oldest start is dropped
            if not starts:
                self._readers.pop(snap.version, None)
            self._cond.notify_all()

    def clear(self) -> None:
        with self._cond:
            self._published = None


@dataclasses.dataclass(frozen=True)
class PullSource:
    """What one pull sends, over gRPC or the bulk channel: its header, then the payload
    from θ itself (``live``: raw fp32 models, live.py), a shared ``Snapshot`` (encoded
    models), or a private payload (sync-state pulls).
    Obtained from ``ParameterServerState.open_pull``; give it back with ``close_pull``."""

    header: pb.PullHeader
    snapshot: Snapshot | None = None
    payload: torch.Tensor | None = None  # 1-D uint8 CPU, when there is no snapshot
    live: LiveView | None = None

    def _private(self) -> torch.Tensor:
        assert self.payload is not None, "a PullSource holds a view, a snapshot or a payload"
        return self.payload

    def messages(self, chunk_bytes: int) -> Iterator[bytes]:
        """The serialised ``PullMessage(chunk=...)`` of each chunk (ready-made for a snapshot)."""
        if self.live is not None:
            yield from self.live.messages(chunk_bytes)
        elif self.snapshot is not None:
            yield from self.snapshot.messages
        else:
            yield from chunk_messages(self._private(), chunk_bytes)

    def data_views(self, chunk_bytes: int) -> Iterator[memoryview]:
        """The payload as read-only memoryviews, in order (a live view's piece is valid
        until the next is asked for; the others are zero-copy)."""
        if self.live is not None:
            yield from self.live.data_views(chunk_bytes)
        elif self.snapshot is not None:
            yield from self.snapshot.data_views()
        else:
            yield self._private().numpy().data.toreadonly()
