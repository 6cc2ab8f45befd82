"""Encoded pull snapshots: one version of θ copied once into the Pull stream's chunk
messages (wire/grpc_chunks.py) and shared by every concurrent pull of it
(``Snapshot``, ``SnapshotBuilder``), and the slots that bound how many versions stay in
memory (``PullSnapshots``). docs/architecture.md, "One pull".
"""

from __future__ import annotations

import ctypes
import dataclasses
import threading
import time
from collections.abc import Iterator

import torch

from asyncdiloco.errors import InvalidPayloadError
from asyncdiloco.wire.grpc_chunks import chunk_prefix
from asyncdiloco.wire.tensors import chunk_views, crc32_update, num_chunks_for


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
    through the view (``SnapshotBuilder`` before its ``Snapshot`` exists, live_view.py before
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
