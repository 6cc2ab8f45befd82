"""What pulls are served (``Snapshots``): θ read in place for a raw fp32 model (live_view.py),
else one encoded snapshot per version (encoded.py); the outer step's hooks (``before_step``/
``after_step``); ``open_pull``, what one pull sends. docs/architecture.md, "How a pull flows".
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from collections.abc import Callable, Iterator

import torch

from asyncdiloco.algo.outer import BlockHook, chain_hooks
from asyncdiloco.errors import NotInitializedError
from asyncdiloco.ps.books import StateLocks
from asyncdiloco.ps.config import ServerConfig
from asyncdiloco.ps.core import mode_mismatch
from asyncdiloco.ps.model import GlobalModel
from asyncdiloco.ps.pull.encoded import PullSnapshots, Snapshot, encode_snapshot
from asyncdiloco.ps.pull.live_view import LiveView, crc_hook
from asyncdiloco.ps.pull.receive_pool import ReceivePool
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.grpc_chunks import chunk_messages
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
        #: The receive pool, whose buffers an apply's Δ arrives in (set by the state): the
        #: version an apply replaces moves into its Δ's buffer (live_view.py ``begin_swap``).
        self.pool: ReceivePool | None = None
        #: The view pulls of raw fp32 θ read (live_view.py): of θ's version, or during a change
        #: of θ, of the version being replaced. None: no pull since the last change.
        self._live: LiveView | None = None
        #: During a step (``before_step`` to ``after_step``): the view moving into Δ's buffer,
        #: and the new θ's CRC-32 taken in the step.
        self._swapping: LiveView | None = None
        self._crc_of_new: Callable[[], int] | None = None

    def serves_live(self) -> bool:
        """True when pulls read θ itself (live_view.py): a raw fp32 model on the CPU; else they
        are served encoded snapshots."""
        theta = self.model.params
        return theta is not None and theta.device.type == "cpu" and self.model.pulls_raw_theta()

    def _version(self) -> int:
        with self.locks.books:
            return self.model.version

    def acquire(self, max_wait_s: float = math.inf) -> Snapshot | LiveView:
        """The newest global parameters for one pull (pair with ``release``): θ itself
        (``LiveView``) for a raw fp32 model, else the version's encoded snapshot. During an
        apply, the version it started from; when older pulls fill every slot, waits up to
        ``wait_s`` (at most ``max_wait_s``) seconds, then serves the newest there is.

        Raises:
            NotInitializedError: no worker has pushed the initial parameters yet.
        """
        with self.locks.books:
            if not self.model.initialized:
                raise NotInitializedError(
                    "not initialized: no worker has pushed the initial parameters yet; retry shortly"
                )
            version = self.model.version
        if self.serves_live():
            return self._acquire_live(version)
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

    def _acquire_live(self, version: int) -> LiveView:
        self.slots.note_pull()
        view = self._live
        if view is not None and view.version == version and view.reads(self.model.params) and view.enter():
            return view
        with self.locks.apply:  # θ holds still while the view of its version is made
            with self.locks.books:
                version = self.model.version
            view = self._live
            if view is None or view.version != version or not view.reads(self.model.params) or not view.enter():
                view = LiveView(version, self.model.theta)
                view.enter()
                self._set_live(view)
            return view

    def _set_live(self, view: LiveView | None) -> None:
        old, self._live = self._live, view
        if old is not None and old is not view:
            old.retire()

    def _build_locked(self) -> Snapshot:
        """The snapshot of the current version, encoded now unless an apply built it
        meanwhile (``apply`` lock held), registered as read by the caller."""
        version = self._version()
        snap = self.slots.acquire_if(version)
        if snap is None:
            snap = self.encode(version)
            self.slots.publish(snap, acquire=True)
        return snap

    def release(self, snap: Snapshot | LiveView) -> None:
        """A pull of ``snap`` (from ``acquire``) ended, completed or not."""
        if isinstance(snap, LiveView):
            snap.exit()
        else:
            self.slots.release(snap)

    def encode(self, version: int) -> Snapshot:
        """θ of ``version`` in the wire layout, copied into chunk messages (``apply`` lock held)."""
        return encode_snapshot(version, self.model.pull_payload(), self.config.chunk_bytes)

    def before_apply(self, version: int) -> None:
        """An apply is about to change θ, still of ``version`` (``apply`` lock held):
        while pulls are being served (one within ``lease_s``) and a slot is free, make sure
        that version has a snapshot, so the pulls during the apply are served it at once.
        Costs at most one encode per version, paid only while pulls come. A live view of
        ``version`` is copied out instead (when a pull reads it or pulls are coming), since
        θ is about to change under it."""
        view = self._live
        if view is not None and view.version == version:
            view.freeze(keep=self.slots.pulls_recent())
            return
        if self.serves_live():
            return
        if self.slots.published_version() == version or not self.slots.pulls_recent():
            return
        if self.slots.has_room():
            self.slots.publish(self.encode(version), keep_wanted=True)

    def before_step(self, version: int, swap_into: torch.Tensor | None = None) -> BlockHook | None:
        """An outer step that makes ``version`` is about to run (``apply`` lock held): the
        hook it calls after each block of θ (None: none); ``after_step`` must follow. With
        θ read in place, the view of ``version − 1`` moves block by block into ``swap_into``
        (Δ's uint8 receive buffer; live_view.py ``begin_swap``) while pulls read it, and
        the new θ's CRC-32 is taken per block; else ``before_apply``."""
        self._swapping, self._crc_of_new = None, None
        if not self.serves_live():
            self.before_apply(version - 1)
            return None
        theta = self.model.theta
        hooks: list[BlockHook] = []
        old = self._live if self._live is not None and self._live.reads(theta) else None
        if old is not None and old.version != version - 1:
            old.freeze(keep=False)  # (θ changed without a view of it: never left read in place)
        elif old is not None:
            keep = self.slots.pulls_recent()
            release = None
            target = swap_into if swap_into is not None and swap_into.numel() == old.total_bytes else None
            if (old.readers or keep) and target is not None and self.pool is not None:
                release = self.pool.hold(target, evict=old.evict)
            if release is not None and target is not None:
                hooks.append(old.begin_swap(target, release))
                self._swapping = old
            else:
                old.freeze(keep=keep)
        if self.slots.wanted:  # pulls came since the last version: the new one's CRC in the same pass
            hook, self._crc_of_new = crc_hook(theta)
            hooks.append(hook)
        return chain_hooks(hooks)

    def after_step(self, version: int) -> Snapshot | LiveView | None:
        """The step ``before_step`` prepared ended (``apply`` lock held): what pulls of
        ``version`` are served (publish it with ``publish``)."""
        if self._swapping is not None:
            self._swapping.finish_swap()
            self._swapping = None
        if not self.serves_live():
            return self.after_apply(version)
        crc = None if self._crc_of_new is None else self._crc_of_new()
        self._crc_of_new = None
        return LiveView(version, self.model.theta, crc32=crc)

    def after_apply(self, version: int) -> Snapshot | LiveView | None:
        """The snapshot of the version an apply just made (``apply`` lock held), when pulls
        are coming and a slot is free (for a live θ: its view); publish it with ``publish``."""
        if self.serves_live():
            return LiveView(version, self.model.theta)
        if self.slots.wanted and self.slots.has_room():  # encode it now: the pulls will not wait
            return self.encode(version)
        return None

    def publish(self, snap: Snapshot | LiveView | None) -> None:
        """Make ``snap`` the newest snapshot or view (None: nothing to publish)."""
        if isinstance(snap, LiveView):
            self._set_live(snap)
            self.slots.wanted = False  # the next version's CRC is taken in its step only if a pull comes
        elif snap is not None:
            self.slots.publish(snap)

    def clear(self) -> None:
        """Forget the published snapshot (θ is about to be replaced or replayed; ``apply``
        lock held): pulls reading θ in place finish from a copy."""
        view = self._live
        if view is not None:
            view.freeze(keep=False)
        self._set_live(None)
        self.slots.clear()

    def open_pull(
        self,
        request: pb.PullRequest,
        run_config: Callable[[int], pb.RunConfig],
        sync_state: Callable[[], tuple[int, torch.Tensor]] | None = None,
        max_wait_s: float = math.inf,
    ) -> PullSource:
        """What a Pull sends (gRPC or bulk): its header and payload; pair with ``close_pull``.

        Args:
            run_config: the run config of a worker id, for the header.
            sync_state: sync mode's (round, θ and m as float32 bytes) for a healing pull
                (``request.sync_state``); None on an async server, which refuses that pull.
            max_wait_s: the longest the pull may wait for a snapshot slot, seconds.
        Raises:
            NotInitializedError, ModeMismatchError (a sync-state pull of an async server).
        """
        snap: Snapshot | None = None
        live: LiveView | None = None
        payload: torch.Tensor | None = None
        if request.sync_state:
            if sync_state is None:
                raise mode_mismatch(self.config.mode, "a sync-state pull")
            version, payload = sync_state()
            total, crc = payload.numel(), crc32_of(payload)
        else:
            got = self.acquire(max_wait_s)
            try:
                if isinstance(got, LiveView):
                    live, crc = got, got.crc32()
                else:
                    snap, crc = got, got.crc32
            except BaseException:
                self.release(got)
                raise
            version, total = got.version, got.total_bytes
        header = pb.PullHeader(
            version=version,
            total_bytes=total,
            num_chunks=num_chunks_for(total, self.config.chunk_bytes),
            crc32=crc,
            run_config=run_config(request.worker_id),
            round=version if self.config.mode == "sync" else 0,
        )
        return PullSource(seal(header), snap, payload, live)

    def close_pull(self, source: PullSource) -> None:
        """A pull from ``open_pull`` ended: its snapshot or view may be freed."""
        if source.live is not None:
            self.release(source.live)
        elif source.snapshot is not None:
            self.release(source.snapshot)


@dataclasses.dataclass(frozen=True)
class PullSource:
    """What one pull sends, over gRPC or the bulk channel: its header, then the payload
    from θ itself (``live``: raw fp32 models, live_view.py), a shared ``Snapshot`` (encoded
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
