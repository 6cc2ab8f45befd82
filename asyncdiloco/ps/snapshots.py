"""Pull snapshots: θ of one version, encoded once as the Pull stream's chunk messages
and shared by every concurrent pull of that version (buffers.py ``Snapshot``).

While pulls keep coming, the apply that makes a version encodes its snapshot before it
publishes the version (``after_apply``), and an apply that starts from a version without
a snapshot encodes that one before its outer step (``before_apply``). A pull during an
apply is served the newest complete snapshot (the version the apply started from) without
taking the apply lock, so a pull never waits for an apply, however long its outer step,
and never mixes two versions. Otherwise the first pull of a version encodes it
(``acquire``). Only a pull that finds no snapshot at all (the first pull of a run, or the
first after ``lease_s`` without pulls) while an apply runs waits for that apply. At
most ``ServerConfig.pull_snapshots`` versions stay in memory (buffers.py
``PullSnapshots`` keeps that count). ``open_pull`` says what one pull sends: a shared
snapshot, or sync mode's private copy of θ and m for a healing member.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable

import torch

from asyncdiloco.algo.outer import BlockHook
from asyncdiloco.errors import NotInitializedError
from asyncdiloco.ps.buffers import PullSnapshots, PullSource, Snapshot, SnapshotBuilder, encode_snapshot
from asyncdiloco.ps.config import ServerConfig
from asyncdiloco.ps.model import GlobalModel
from asyncdiloco.ps.modes import Mode
from asyncdiloco.ps.records import StateLocks
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.header_crc import seal
from asyncdiloco.wire.tensors import crc32_of, num_chunks_for

log = logging.getLogger(__name__)

#: Seconds a pull waits for pulls of older versions to finish (room for a new snapshot)
#: before it is served the newest snapshot there is, of an older version.
SNAPSHOT_WAIT_S = 10.0


class Snapshots:
    """Builds, publishes and hands out the snapshots pulls are served from.

    Args:
        config: ``pull_snapshots`` (versions kept), ``lease_s`` (a pull older than that
            stops holding a slot), ``chunk_bytes``.
        model: θ, its version and its wire codec.
        locks: the state's locks (a snapshot is encoded under ``apply``).
        clock: the server's monotonic clock, seconds.
    """

    def __init__(self, config: ServerConfig, model: GlobalModel, locks: StateLocks, clock: Callable[[], float]) -> None:
        self.config = config
        self.model = model
        self.locks = locks
        #: The slots: which versions are published and still read (tests inspect it).
        self.slots = PullSnapshots(config.pull_snapshots, stale_after_s=config.lease_s, clock=clock)
        #: Seconds a pull waits for a free slot before it is served an older version.
        self.wait_s = SNAPSHOT_WAIT_S
        self._build_lock = threading.Lock()  # one builder at a time; the others reuse its result

    def _version(self) -> int:
        with self.locks.books:
            return self.model.version

    def acquire(self, max_wait_s: float = math.inf) -> Snapshot:
        """The newest global parameters, encoded once per version and shared by all
        pulls; pair every call with ``release`` when the pull ends.

        Returns at once while the applies build the snapshots; else encodes it here, or,
        while an apply changes θ, serves the newest complete snapshot (the version that
        apply started from; the pull header says which) instead of waiting for it. When
        pulls of older versions fill every slot, waits up to ``wait_s`` seconds for them
        (at most ``max_wait_s``, what the pull's deadline leaves), then serves the newest
        snapshot there is (an older version).

        Raises:
            NotInitializedError: no worker has pushed the initial parameters yet.
        """
        with self.locks.books:
            if not self.model.initialized:
                raise NotInitializedError(
                    "not initialized: no worker has pushed the initial parameters yet; retry shortly"
                )
            version = self.model.version
        snap = self.slots.acquire_if(version)
        if snap is not None:
            return snap
        with self._build_lock:
            snap = self.slots.acquire_if(self._version())
            if snap is not None:
                return snap
            if not self.slots.wait_for_room(max(0.0, min(self.wait_s, max_wait_s))):
                snap = self.slots.acquire_if(None)
                if snap is not None:
                    log.info("pull served version %d: older pulls still hold every snapshot slot", snap.version)
                    return snap
            if not self.locks.apply.acquire(blocking=False):  # an apply is changing θ: do not wait for it
                snap = self.slots.acquire_if(None)  # the newest complete snapshot: what that apply started from
                if snap is not None:
                    return snap
                self.locks.apply.acquire()  # no snapshot at all yet: this pull waits for the one apply
            try:
                return self._build_locked()
            finally:
                self.locks.apply.release()

    def _build_locked(self) -> Snapshot:
        """The snapshot of the current version, encoded now unless an apply built it
        meanwhile (``apply`` lock held), registered as read by the caller."""
        version = self._version()
        snap = self.slots.acquire_if(version)
        if snap is None:
            snap = self.encode(version)
            self.slots.publish(snap, acquire=True)
        return snap

    def release(self, snap: Snapshot) -> None:
        """A pull of ``snap`` (from ``acquire``) ended, completed or not."""
        self.slots.release(snap)

    def encode(self, version: int) -> Snapshot:
        """θ of ``version`` in the wire layout, copied into chunk messages (``apply`` lock held)."""
        return encode_snapshot(version, self.model.pull_payload(), self.config.chunk_bytes)

    def before_apply(self, version: int) -> None:
        """An apply is about to change θ, still of ``version`` (``apply`` lock held):
        while pulls are being served (one within ``lease_s``) and a slot is free, make sure
        that version has a snapshot, so the pulls during the apply are served it at once.
        Costs at most one encode per version, paid only while pulls come."""
        if self.slots.published_version() == version or not self.slots.pulls_recent():
            return
        if self.slots.has_room():
            self.slots.publish(self.encode(version), keep_wanted=True)

    def step_and_encode(self, version: int, step: Callable[[BlockHook | None], None]) -> Snapshot | None:
        """Run an outer step that makes ``version`` (``apply`` lock held) and build that
        version's snapshot in the same pass where it can: ``step(on_block)`` is called
        with a hook that copies each block of the new θ into the snapshot's chunk
        messages while the block is still in cache (outer.py ``on_block``; buffers.py
        ``SnapshotBuilder``), instead of a second pass over θ after the step. Fused when
        pulls are coming, θ travels raw (the wire payload is θ's own bytes) and a slot is
        free beside the published snapshot (which serves the pulls during the step);
        otherwise ``step(None)`` then ``after_apply``. Publish the result with ``publish``."""
        theta = self.model.params
        fused = (
            theta is not None
            and theta.device.type == "cpu"
            and self.model.pulls_raw_theta()
            and self.slots.wanted
            and self.slots.has_spare_room()
        )
        if not fused:
            step(None)
            return self.after_apply(version)
        assert theta is not None
        builder = SnapshotBuilder(version, theta.numel() * 4, self.config.chunk_bytes)
        raw = theta.view(torch.uint8).numpy().data  # θ's bytes, no copy

        def on_block(start: int, end: int) -> None:
            builder.feed(raw[start * 4 : end * 4])

        step(on_block)
        return builder.finish()

    def after_apply(self, version: int) -> Snapshot | None:
        """The snapshot of the version an apply just made (``apply`` lock held), when pulls
        are coming and a slot is free; publish it with ``publish``."""
        if self.slots.wanted and self.slots.has_room():  # encode it now: the pulls will not wait
            return self.encode(version)
        return None

    def publish(self, snap: Snapshot | None) -> None:
        """Make ``snap`` the newest snapshot (None: nothing to publish)."""
        if snap is not None:
            self.slots.publish(snap)

    def clear(self) -> None:
        """Forget the published snapshot (θ was replaced: a restore or a replay)."""
        self.slots.clear()

    def open_pull(
        self,
        request: pb.PullRequest,
        mode: Mode,
        run_config: Callable[[int], pb.RunConfig],
        max_wait_s: float = math.inf,
    ) -> PullSource:
        """What a Pull sends (over gRPC or the bulk channel): its header and payload.
        Pair every call with ``close_pull`` when the pull ends, completed or not.

        Args:
            request: the pull; ``sync_state`` asks for θ and m (sync mode's healing pull).
            mode: the server's mode (it serves or refuses the sync-state pull).
            run_config: the run config of a worker id, for the header.
            max_wait_s: the longest the pull may wait for a snapshot slot (``acquire``), seconds.
        Returns:
            A ``PullSource``: the header (version, size, chunk count, CRC-32, run config)
            and the newest snapshot, or for ``request.sync_state`` θ and m as float32 bytes.
        Raises:
            NotInitializedError, ModeMismatchError (a sync-state pull of an async server).
        """
        snap: Snapshot | None = None
        payload: torch.Tensor | None = None
        if request.sync_state:
            version, payload = mode.sync_state()
            total, crc = payload.numel(), crc32_of(payload)
        else:
            snap = self.acquire(max_wait_s)
            version, total, crc = snap.version, snap.total_bytes, snap.crc32
        header = pb.PullHeader(
            version=version,
            total_bytes=total,
            num_chunks=num_chunks_for(total, self.config.chunk_bytes),
            crc32=crc,
            run_config=run_config(request.worker_id),
            round=mode.pull_round(version),
        )
        return PullSource(seal(header), snap, payload)

    def close_pull(self, source: PullSource) -> None:
        """A pull from ``open_pull`` ended: its snapshot may be freed."""
        if source.snapshot is not None:
            self.release(source.snapshot)
