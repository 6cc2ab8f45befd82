"""The parameter server's state and logic, free of any network code.

Owns the fp32 global parameters θ, the outer optimizer (and its momentum), the global
version, the worker table (leases by the server's monotonic clock) and the counters.
``ParameterServerService`` (service.py) only decodes requests, calls these methods and
encodes replies, so everything here is testable in-process.

Concurrency: two locks. ``_apply_lock`` serialises whatever reads or writes θ and the
momentum (the outer step, the copy into a snapshot, checkpoints); ``_lock`` guards the
version, workers and counters and is held only for bookkeeping, never during tensor
math, so Join, Heartbeat and Status never wait for an apply. Receiving, the CRC check,
decoding and the finiteness check of a push happen before either lock is taken, into a
pooled buffer (buffers.py). Pulls are served from an immutable ``Snapshot`` (the
encoded chunk messages of one version); while pulls are coming in, each apply encodes
the next snapshot before it publishes its version, so a pull never waits for an apply
and never mixes two versions.

Wire codec (codec.py, ``ServerConfig.wire_codec``): pseudo-gradient pushes arrive
encoded (raw, bf16 or block-wise int8) and are decoded to an fp32 Δ before the lock is
taken, into a buffer from a small pool; pulls are served from θ encoded once per version
(under the apply lock, into a reused buffer, then copied into the snapshot). Initial
parameters, round results and sync-state pulls stay raw. θ, momentum and every outer
step stay fp32 whatever the codec.

Push semantics (Liu et al. 2024, arXiv 2401.09135, Sec. 3; staleness weights in
outer.py): a pseudo-gradient with base version v arriving at version V has staleness
τ = V − v; it is refused when τ > max_staleness or v > V, otherwise applied at once and
the version becomes V + 1. ``(worker_id, push_id)`` makes a retried push idempotent.

Durability (store.py): when a ``journal`` is attached, every Join and every push is
logged (and fsynced) after all checks pass and before it changes anything in memory or
is acknowledged; ``state_dict``/``load_state_dict`` and ``replay_join``/``replay_push``
(state_durable.py) are what checkpoints and log replay use.
Sync mode (``ServerConfig.mode == "sync"``; methods in state_sync.py): pseudo-gradient
pushes are refused (``ModeMismatchError``); rounds are run by a ``QuorumManager`` (quorum.py). Rank 0 of
each quorum uploads the reduced pseudo-gradient Δ̄ (``PUSH_KIND_ROUND_RESULT``) before it
votes; on commit this state applies the same ``OuterOptimizer`` step to θ and m that
every member applies to its θ_base, and the version becomes the committed-round count.
So the server always holds the committed global parameters and outer momentum, and a
joining or healing worker pulls both (``sync_state``) before its first round.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable

import torch

from asyncdiloco.algo.outer import (
    DelayedNesterov,
    OuterOptimizer,
    PseudoGradientMonitor,
    describe,
    make_outer_optimizer,
    staleness_weight,
)
from asyncdiloco.algo.schedule import GroupGate, StepRateMeter, auto_window_s, dylu_local_steps
from asyncdiloco.errors import (
    InvalidPayloadError,
    ModeMismatchError,
    NotInitializedError,
    PayloadTooLargeError,
    StalePushError,
    UnknownWorkerError,
)
from asyncdiloco.ps.buffers import (
    PullSnapshots,
    PullSource,
    ReceivePool,
    Snapshot,
    encode_snapshot,
)
from asyncdiloco.ps.config import ServerConfig
from asyncdiloco.ps.quorum import QuorumManager
from asyncdiloco.ps.records import PUSH_MEMORY as _PUSH_MEMORY
from asyncdiloco.ps.records import PushOutcome, WorkerRecord
from asyncdiloco.ps.state_durable import DurableState
from asyncdiloco.ps.state_sync import SyncRounds
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.codec import DecodeBuffers, WireCodec, make_codec
from asyncdiloco.wire.grpc_chunks import WireChunk
from asyncdiloco.wire.tensors import Manifest, PayloadAssembler, chunk_views, crc32_of, num_chunks_for

log = logging.getLogger(__name__)

#: Seconds a pull waits for pulls of older versions to finish (room for a new snapshot)
#: before it is served the newest snapshot there is, of an older version.
_SNAPSHOT_WAIT_S = 10.0

__all__ = ["ParameterServerState", "PushOutcome", "Snapshot", "WorkerRecord"]


def _largest_magnitude(x: torch.Tensor) -> float:
    """max |x| of a 1-D float tensor (NaN if any NaN, inf if any ±inf; 0 when empty).
    One ``aminmax`` pass: ~5× faster here than ``vector_norm(x, inf)``."""
    if not x.numel():
        return 0.0
    lo, hi = (float(v) for v in torch.aminmax(x))
    return math.nan if math.isnan(lo) or math.isnan(hi) else max(-lo, hi)


class ParameterServerState(SyncRounds, DurableState):
    """Global model, outer optimizer, version, workers and counters.

    Args:
        config: the server configuration.
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(self, config: ServerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._started = clock()
        self._lock = threading.Lock()  # version, workers, counters: bookkeeping only
        self._apply_lock = threading.Lock()  # θ and the outer optimizer's state; taken before _lock
        self._snapshot_lock = threading.Lock()
        self._receive_pool = ReceivePool(config.receive_buffer_bytes)
        self._pack_scratch: torch.Tensor | None = None  # θ packed to the manifest's dtypes
        self._snapshots = PullSnapshots(config.pull_snapshots, stale_after_s=config.lease_s, clock=clock)
        self.manifest: Manifest | None = None
        self.params: torch.Tensor | None = None  # θ, float32 (N,)
        self.outer: OuterOptimizer | None = None
        self.version = 0
        self._initializer: int | None = None  # worker id told to push initial parameters
        self._codec: WireCodec | None = None  # for the current manifest (see _wire_codec)
        self._decode_buffers: DecodeBuffers | None = None
        self._workers: dict[int, WorkerRecord] = {}
        self._next_worker_id = 1
        self.applied_pushes = 0
        self.rejected_pushes = 0
        self.duplicate_pushes = 0
        self.bytes_pushed = 0
        self.bytes_pulled = 0
        self.pulls = 0
        self.tokens = 0
        self.staleness_histogram = [0] * config.histogram_buckets
        #: store.DurableStore (or None): logs each change before it is applied.
        self.journal = None
        self._rates = StepRateMeter()
        #: Push replies held per group (schedule.py); sync mode has rounds instead.
        self.groups = GroupGate(config.grouping if config.mode == "async" else "off", clock)
        self.monitor = PseudoGradientMonitor()
        #: Sync mode: the rounds; ``store_host``/``store_port`` of the rendezvous store
        #: are set by the process that hosts it (server.py).
        self.quorum: QuorumManager | None = None
        self.store_host = ""
        self.store_port = 0
        #: The bulk data channel's port (ps/bulk.py), set by server.py; 0 = none offered.
        self.bulk_port = 0
        if config.mode == "sync":
            self.quorum = QuorumManager(
                config.sync, live_workers=self.live_worker_ids, on_commit=self._apply_round, clock=clock
            )

    # ------------------------------------------------------------ properties
    @property
    def initialized(self) -> bool:
        return self.params is not None

    def clock(self) -> float:
        """The server's monotonic clock, seconds."""
        return self._clock()

    @property
    def sync_mode(self) -> bool:
        return self.quorum is not None

    def run_config(self, worker_id: int = 0) -> pb.RunConfig:
        """The run config for ``worker_id`` (its H_w under DyLU; H for observers)."""
        with self._lock:
            return self._run_config_locked(worker_id)

    def _run_config_locked(self, worker_id: int) -> pb.RunConfig:
        sync, outer = self.config.sync, self.config.outer
        return pb.RunConfig(
            local_steps=self._local_steps_locked(worker_id),
            chunk_bytes=self.config.chunk_bytes,
            lease_s=self.config.lease_s,
            max_staleness=outer.max_staleness,
            mode=self.config.mode,
            min_workers=sync.min_workers,
            join_timeout_s=sync.join_timeout_s,
            round_timeout_s=sync.round_timeout_s,
            sync_weighting=sync.weighting,
            outer_optimizer=outer.optimizer,
            outer_lr=outer.lr,
            outer_momentum=outer.momentum,
            outer_lr_schedule=outer.lr_schedule,
            outer_lr_warmup_versions=outer.lr_warmup_versions,
            outer_lr_total_versions=outer.lr_total_versions,
            outer_lr_min_ratio=outer.lr_min_ratio,
            wire_codec=self.config.wire_codec,
            codec_block_size=self.config.codec_block_size,
            bulk_port=self.bulk_port,
            dylu=self.config.dylu,
            grouping=self.groups.window.mode,
            group_window_s=self._group_window_s_locked(),
            group_max_wait_s=self._group_max_wait_s_locked(),
        )

    def _live_rates_locked(self) -> dict[int, float]:
        return {w: v for w, v in self._rates.rates.items() if w in self._workers and self._workers[w].alive}

    def _group_window_s_locked(self) -> float:
        """Seconds from a group's first arrival to its deadline ("window" mode)."""
        if self.groups.window.mode == "off":
            return 0.0
        if self.config.grace_s is not None:
            return self.config.grace_s
        return auto_window_s(self._live_rates_locked().values(), self.config.local_steps)

    def _expected_locked(self, now: float) -> set[int]:
        """The live workers a group waits for (and Delayed Nesterov's N, with dn_buffer=0):
        those that pushed within two of their own rounds (H_w / v_w) plus the window, or
        joined since. A worker that stopped pushing without leaving (killed, hung) stops
        holding groups after that, long before its lease lapses."""
        window = self._group_window_s_locked()
        rounds = self._rounds_s_locked()
        unknown_s = max(rounds.values(), default=math.inf)  # no rate yet: the longest known round
        expected = set()
        for w, rec in self._workers.items():
            if not rec.alive:
                continue
            round_s = rounds.get(w, unknown_s)
            if now - max(rec.joined_at, rec.last_push) <= 2 * round_s + window:
                expected.add(w)
        return expected

    def _group_max_wait_s_locked(self) -> float:
        """The longest a push reply is held: the window, or the barrier's cap."""
        mode = self.groups.window.mode
        if mode != "barrier":
            return self._group_window_s_locked()
        if self.config.group_max_wait_s is not None:
            return self.config.group_max_wait_s
        longest = max(self._rounds_s_locked().values(), default=30.0)
        return min(3600.0, longest + self._group_window_s_locked())

    def _rounds_s_locked(self) -> dict[int, float]:
        """Seconds of a round of each live worker with a known rate: H_w / v_w."""
        rates = self._live_rates_locked()
        steps = dylu_local_steps(rates, self.config.local_steps) if self.config.dylu else {}
        return {w: steps.get(w, self.config.local_steps) / v for w, v in rates.items()}

    def _wire_codec(self) -> WireCodec:
        """The run's wire codec for the current manifest (rebuilt if the provisional
        manifest was replaced). Its decode is thread-safe; its encode is used only by the
        snapshot builder, one at a time."""
        codec = self._codec
        if codec is None or codec.manifest is not self.manifest:
            codec = make_codec(self.config.wire_codec, self.manifest, self.config.codec_block_size)
            self._decode_buffers = DecodeBuffers(codec.numel)
            self._codec = codec
        return codec

    def mode_mismatch_error(self, what: str) -> ModeMismatchError:
        """The refusal for a request of the other mode; ``what`` names the request."""
        other = "async" if self.sync_mode else "sync"
        fix = (
            "use SyncDiLoCoWorker (`asyncdiloco worker --mode sync`)"
            if self.sync_mode
            else "use AsyncDiLoCoWorker (`asyncdiloco worker --mode async`), or start the server with --mode sync"
        )
        return ModeMismatchError(
            f"mode mismatch: {what} is a {other}-mode request but this server runs mode {self.config.mode!r}; {fix}"
        )

    def _local_steps_locked(self, worker_id: int) -> int:
        """H_w: DyLU (Liu et al. 2024, Eq. 6) over the live workers' measured rates."""
        if not self.config.dylu:
            return self.config.local_steps
        return dylu_local_steps(self._live_rates_locked(), self.config.local_steps).get(
            worker_id, self.config.local_steps
        )

    def local_steps_for(self, worker_id: int) -> int:
        """H_w, the inner steps ``worker_id`` should run in its current round."""
        with self._lock:
            return self._local_steps_locked(worker_id)

    def report_rate(self, worker_id: int, steps_per_s: float) -> None:
        """A rate v_w the worker measured on its own compute (DyLU; ignored if ≤ 0)."""
        if steps_per_s > 0:
            with self._lock:
                if worker_id in self._workers:
                    self._rates.report(worker_id, steps_per_s)

    # --------------------------------------------------------------- workers
    def join(self, manifest: Manifest, worker_name: str = "", steps_per_s: float = 0.0) -> tuple[int, bool, int]:
        """Register a worker whose model has ``manifest`` (and, if > 0, the inner-step rate
        it measured, for DyLU).

        Returns:
            (worker_id, initialize, version): ``initialize`` is True when this worker
            must push the initial parameters.
        Raises:
            ManifestMismatchError: the manifest differs from the server's.
            PayloadTooLargeError: the model exceeds ``max_payload_bytes``.
        """
        if manifest.total_bytes > self.config.max_payload_bytes:
            raise PayloadTooLargeError(
                f"model of {manifest.total_bytes} bytes exceeds max_payload_bytes={self.config.max_payload_bytes}; "
                f"start the server with a larger --max-payload-bytes"
            )
        with self._lock:
            now = self._clock()
            self._expire_locked(now)
            # The manifest is provisional until the initial parameters arrive: if every
            # worker that brought it is gone, the next join may bring another model.
            replace = self.manifest is None or (
                not self.initialized and not any(r.alive for r in self._workers.values())
            )
            if not replace:
                manifest.check_same(self.manifest)
            worker_id = self._next_worker_id
            initialize = False
            if not self.initialized:
                holder = self._workers.get(self._initializer) if self._initializer else None
                initialize = holder is None or not holder.alive
            name = worker_name or f"worker-{worker_id}"
            if self.journal is not None:  # durable before the worker learns its id
                self.journal.log_join(worker_id, name, initialize, manifest if replace else None)
            self._register_locked(worker_id, name, initialize, manifest if replace else None, now)
            self._rates.report(worker_id, steps_per_s)
            log.info("worker %d (%s) joined at version %d%s", worker_id, name, self.version,
                     " and initializes the global model" if initialize else "")  # fmt: skip
            return worker_id, initialize, self.version

    def _register_locked(
        self, worker_id: int, name: str, initialize: bool, manifest: Manifest | None, now: float
    ) -> None:
        if manifest is not None:
            self.manifest = manifest
        self._next_worker_id = max(self._next_worker_id, worker_id + 1)
        self._workers[worker_id] = WorkerRecord(worker_id, name, now, now)
        self._rates.start(worker_id, now)
        if initialize:
            self._initializer = worker_id

    def _claim_initializer_locked(self, worker_id: int) -> bool:
        """While no parameters exist: make ``worker_id`` the initializer if the chosen one
        is gone (left, or its lease lapsed). True when ``worker_id`` must initialize."""
        if self.initialized:
            return False
        holder = self._workers.get(self._initializer) if self._initializer else None
        if holder is None or not holder.alive:
            if self._initializer is not None:
                log.warning("initializer %s is gone; worker %d initializes instead", self._initializer, worker_id)
            self._initializer = worker_id
        return self._initializer == worker_id

    def heartbeat(self, worker_id: int, steps_per_s: float = 0.0) -> tuple[int, float, bool]:
        """Renew the lease (and take the worker's measured inner-step rate, if > 0).
        Returns (version, seconds until the lease expires, whether this worker must now
        push the initial parameters)."""
        with self._lock:
            self._touch_locked(worker_id)
            self._rates.report(worker_id, steps_per_s)
            return self.version, self.config.lease_s, self._claim_initializer_locked(worker_id)

    def leave(self, worker_id: int) -> None:
        with self._lock:
            rec = self._workers.get(worker_id)
            if rec is not None:
                rec.alive = False
                self._rates.forget(worker_id)
                log.info("worker %d (%s) left", worker_id, rec.name)
            expected = self._expected_locked(self._clock())
        self.groups.recheck(expected)  # the open group may now hold every expected worker
        if self.quorum is not None:  # outside our lock: the quorum calls live_worker_ids
            self.quorum.withdraw(worker_id)
            self.quorum.notify()

    def live_worker_ids(self) -> set[int]:
        """Ids of the workers whose lease is current."""
        with self._lock:
            self._expire_locked(self._clock())
            return {w for w, r in self._workers.items() if r.alive}

    def _expire_locked(self, now: float) -> None:
        for rec in self._workers.values():
            if rec.alive and now - rec.last_seen > self.config.lease_s:
                rec.alive = False
                log.warning(
                    "worker %d (%s): lease expired after %.1f s of silence",
                    rec.worker_id,
                    rec.name,
                    now - rec.last_seen,
                )

    def _touch_locked(self, worker_id: int) -> WorkerRecord:
        now = self._clock()
        self._expire_locked(now)
        rec = self._workers.get(worker_id)
        if rec is None:
            issued = (
                f"ids 1..{self._next_worker_id - 1} were issued" if self._next_worker_id > 1 else "no ids issued yet"
            )
            raise UnknownWorkerError(f"worker_id {worker_id} is unknown to this server ({issued}); call Join again")
        if not rec.alive:
            raise UnknownWorkerError(
                f"worker_id {worker_id} is no longer registered (it left, or was silent longer than "
                f"lease_s={self.config.lease_s:g}); call Join again"
            )
        rec.last_seen = now
        return rec

    # ------------------------------------------------------------------ pull
    def acquire_snapshot(self) -> Snapshot:
        """The newest global parameters, encoded once per version and shared by all
        pulls; pair every call with ``release_snapshot`` when the pull ends.

        While pulls keep coming, the apply that makes a version encodes its snapshot, so
        this returns at once. Otherwise the pull encodes it here (it may wait for one
        apply in progress). At most ``ServerConfig.pull_snapshots`` versions stay in
        memory: when pulls of older versions fill them, this waits up to
        ``_SNAPSHOT_WAIT_S`` for them to finish, then serves the newest snapshot there is
        (an older version, which the pull header says).

        Raises:
            NotInitializedError: no worker has pushed the initial parameters yet.
        """
        with self._lock:
            if self.params is None:
                raise NotInitializedError(
                    "not initialized: no worker has pushed the initial parameters yet; retry shortly"
                )
            version = self.version
        snap = self._snapshots.acquire_if(version)
        if snap is not None:
            return snap
        with self._snapshot_lock:  # one builder at a time; the others reuse its result
            with self._lock:
                version = self.version
            snap = self._snapshots.acquire_if(version)
            if snap is not None:
                return snap
            if not self._snapshots.wait_for_room(_SNAPSHOT_WAIT_S):
                snap = self._snapshots.acquire_if(None)
                if snap is not None:
                    log.info("pull served version %d: older pulls still hold every snapshot slot", snap.version)
                    return snap
            with self._apply_lock:
                with self._lock:
                    version = self.version
                snap = self._snapshots.acquire_if(version)  # an apply may have built it meanwhile
                if snap is None:
                    snap = self._encode_snapshot_applylocked(version)
                    self._snapshots.publish(snap, acquire=True)
            return snap

    def release_snapshot(self, snap: Snapshot) -> None:
        """A pull of ``snap`` (from ``acquire_snapshot``) ended, completed or not."""
        self._snapshots.release(snap)

    def _encode_snapshot_applylocked(self, version: int) -> Snapshot:
        """θ in the wire layout, copied into chunk messages (``_apply_lock`` held)."""
        if self.config.wire_codec == "raw" and self.manifest.all_float32:
            payload = self.params.view(torch.uint8)  # no intermediate copy
        else:
            codec = self._wire_codec()
            if self._pack_scratch is None or self._pack_scratch.numel() != codec.wire_bytes:
                self._pack_scratch = torch.empty(codec.wire_bytes, dtype=torch.uint8)
            payload = codec.encode(self.params, self._pack_scratch)  # θ in the wire codec (raw: manifest dtypes)
        return encode_snapshot(version, payload, self.config.chunk_bytes)

    def open_pull(self, request: pb.PullRequest) -> PullSource:
        """What a Pull sends (over gRPC or the bulk channel): its header and payload.
        Pair every call with ``close_pull`` when the pull ends, completed or not.

        Returns:
            A ``PullSource``: the header (version, size, chunk count, CRC-32, run config)
            and the newest snapshot, or for ``request.sync_state`` θ and m as float32 bytes.
        Raises:
            NotInitializedError, ModeMismatchError (a sync-state pull of an async server).
        """
        if request.sync_state:
            if not self.sync_mode:
                raise self.mode_mismatch_error("a sync-state pull")
            version, payload = self.sync_state()
            snap, total, crc = None, payload.numel(), crc32_of(payload)
        else:
            snap, payload = self.acquire_snapshot(), None
            version, total, crc = snap.version, snap.total_bytes, snap.crc32
        header = pb.PullHeader(
            version=version,
            total_bytes=total,
            num_chunks=num_chunks_for(total, self.config.chunk_bytes),
            crc32=crc,
            run_config=self.run_config(request.worker_id),
            round=version if self.sync_mode else 0,
        )
        return PullSource(header, snap, payload)

    def close_pull(self, source: PullSource) -> None:
        """A pull from ``open_pull`` ended: its snapshot may be freed."""
        if source.snapshot is not None:
            self.release_snapshot(source.snapshot)

    def record_pull(self, worker_id: int, num_bytes: int) -> None:
        with self._lock:
            self.pulls += 1
            self.bytes_pulled += num_bytes
            rec = self._workers.get(worker_id)
            if rec is not None and rec.alive:
                rec.last_seen = self._clock()

    # ------------------------------------------------------------------ push
    def begin_push(self, header: pb.PushHeader, is_active=None) -> PayloadAssembler | PushOutcome:
        """Check a push header before its payload arrives, then take a receive buffer
        from the pool (waiting while other pushes in flight hold the budget).

        Args:
            header: the push's header.
            is_active: optional ``() -> bool``, False once the caller's RPC ended (gRPC's
                ``context.is_active``): the wait for a buffer then stops.
        Returns:
            A ``PayloadAssembler`` to feed the chunks to (``receive_push`` gives its buffer back),
            or the original outcome when this ``(worker_id, push_id)`` was applied before
            (a retry).
        Raises:
            UnknownWorkerError, InvalidPayloadError, PayloadTooLargeError,
            NotInitializedError, ServerBusyError (no buffer within 30 s): nothing is changed.
        """
        with self._lock:
            rec = self._workers.get(header.worker_id)
            # Round results are not deduplicated by push_id: a retried upload re-stages
            # the same Δ̄, and only the vote decides whether it is applied.
            if rec is not None and header.push_id in rec.outcomes and header.kind != pb.PUSH_KIND_ROUND_RESULT:
                return dataclasses.replace(rec.outcomes[header.push_id], duplicate=True)
            self._touch_locked(header.worker_id)
            if header.total_bytes > self.config.max_payload_bytes:
                raise PayloadTooLargeError(
                    f"total_bytes is {header.total_bytes}; the limit is max_payload_bytes="
                    f"{self.config.max_payload_bytes}; send a smaller model or raise the server's limit"
                )
            if header.push_id < 1:
                raise InvalidPayloadError(f"push_id is {header.push_id}; use a per-worker counter starting at 1")
            if header.base_version < 0:
                raise InvalidPayloadError(
                    f"base_version is {header.base_version}; it must be >= 0, the version the worker pulled"
                )
            if header.kind == pb.PUSH_KIND_INITIAL_PARAMETERS:
                if self.initialized:
                    raise StalePushError(
                        f"initial parameters from worker {header.worker_id} refused: the server is already "
                        f"initialized at version {self.version}; pull the global model instead"
                    )
                if header.worker_id != self._initializer:
                    raise StalePushError(
                        f"initial parameters from worker {header.worker_id} refused: worker {self._initializer} "
                        f"was chosen to initialize; pull the global model once it is there"
                    )
            elif header.kind == pb.PUSH_KIND_PSEUDO_GRADIENT:
                if self.sync_mode:
                    what = f"the pseudo-gradient push {header.push_id} of worker {header.worker_id}"
                    raise self.mode_mismatch_error(what)
                if not self.initialized:
                    raise NotInitializedError("not initialized: no global parameters yet to apply a pseudo-gradient to")
            elif header.kind == pb.PUSH_KIND_ROUND_RESULT:
                if not self.sync_mode:
                    raise self.mode_mismatch_error(f"the round result of quorum {header.quorum_id}")
                if not self.initialized:
                    raise NotInitializedError("not initialized: no global parameters yet to apply a round result to")
            else:
                raise InvalidPayloadError(
                    f"push kind {header.kind} is not one of PUSH_KIND_PSEUDO_GRADIENT (1), "
                    f"PUSH_KIND_INITIAL_PARAMETERS (2), PUSH_KIND_ROUND_RESULT (3)"
                )
            for name in ("num_local_steps", "num_tokens"):
                if getattr(header, name) < 0:
                    raise InvalidPayloadError(f"{name} is {getattr(header, name)}; it must be >= 0")
            total, what = self.manifest.total_bytes, "(see the manifest from Join)"
            if header.kind == pb.PUSH_KIND_ROUND_RESULT:
                total = self.manifest.numel * 4  # float32 Δ̄, whatever the model's dtypes
            elif header.kind == pb.PUSH_KIND_PSEUDO_GRADIENT and self.config.wire_codec != "raw":
                codec = self._wire_codec()
                total = codec.wire_bytes
                what = (
                    f"encoded with this run's wire codec {codec.describe()} (raw: {self.manifest.total_bytes} "
                    f"bytes); encode pushes with the codec in RunConfig.wire_codec from Join"
                )
        if header.total_bytes != total:
            raise InvalidPayloadError(
                f"total_bytes is {header.total_bytes}; the model's payload is {total} bytes {what}"
            )
        assembler_args = dict(
            total_bytes=header.total_bytes, num_chunks=header.num_chunks, crc32=header.crc32,
            chunk_bytes=self.config.chunk_bytes, max_bytes=self.config.max_payload_bytes,
        )  # fmt: skip
        if header.kind == pb.PUSH_KIND_ROUND_RESULT:  # staged until the vote: a buffer of its own
            return PayloadAssembler(**assembler_args)
        buffer = self._receive_pool.acquire(header.total_bytes, is_active=is_active)  # waits up to 30 s
        try:
            assembler = PayloadAssembler(**assembler_args, buffer=buffer)
        except Exception:
            self._receive_pool.release(buffer)
            raise
        return assembler

    def receive_push(
        self,
        header: pb.PushHeader,
        fill: Callable[[PayloadAssembler], None],
        drain: Callable[[], None],
        is_active: Callable[[], bool] | None = None,
    ) -> PushOutcome:
        """One whole push, whatever carries it (gRPC, the bulk channel, in-process):
        ``begin_push``, then ``fill`` copies the payload into the pooled buffer, then
        ``apply_push``; the buffer goes back to the pool however that ends. A retry of an
        applied push is answered with its original outcome after ``drain`` consumed its
        payload.

        Args:
            header: the push's header.
            fill: feeds the whole payload to the assembler (``add`` per chunk, or ``fill_with``).
            drain: consumes the payload of a push that is not read into a buffer (a retry).
            is_active: as for ``begin_push``.
        Raises:
            The exceptions of ``begin_push`` (raised before ``fill`` is called: nothing of
            the payload was read), of ``fill`` and of ``apply_push``.
        """
        started = self.begin_push(header, is_active)
        if isinstance(started, PushOutcome):
            drain()
            return started
        try:
            fill(started)
            return self.apply_push(header, started.finish())
        finally:  # the payload is not used after this; a round result's own buffer is not the pool's
            self._receive_pool.release(started.buffer)

    def apply_push(self, header: pb.PushHeader, payload: torch.Tensor) -> PushOutcome:
        """Apply a complete, CRC-checked payload: the initial parameters, or a
        pseudo-gradient (decoded with the run's wire codec, outside the lock) with the
        outer optimizer weighted by its staleness.

        Raises:
            InvalidPayloadError: non-finite values.
            StalePushError: τ > max_staleness, or a base version from the future.
            UnknownWorkerError: the worker's lease expired meanwhile.
            In every case θ, momentum, version and the applied counters are unchanged.
        """
        if header.kind == pb.PUSH_KIND_ROUND_RESULT:
            return self._stage_round_result(header, payload)
        buffer = None
        copies = self.config.wire_codec != "raw" or not self.manifest.all_float32  # else Δ is a view
        if header.kind == pb.PUSH_KIND_PSEUDO_GRADIENT and copies:
            codec = self._wire_codec()
            buffer = self._decode_buffers.take()  # at most two out: memory stays bounded
            delta = codec.decode(payload, buffer)  # (N,) fp32
        else:
            delta = self.manifest.unpack_flat(payload)  # (N,) float32, a view when all fp32
        try:
            return self._apply_decoded(header, payload, delta)
        finally:
            if buffer is not None:
                self._decode_buffers.give(buffer)

    def _apply_decoded(self, header: pb.PushHeader, payload: torch.Tensor, delta: torch.Tensor) -> PushOutcome:
        """Check and apply a decoded push: ``delta`` (N,) fp32 (used as scratch by the
        outer step); ``payload`` is what the journal logs, as received."""
        largest = _largest_magnitude(delta)  # NaN/Inf propagate; also ‖Δ‖∞ for the divergence monitor
        if not math.isfinite(largest):
            bad = int((~torch.isfinite(delta)).sum())
            raise InvalidPayloadError(
                f"payload from worker {header.worker_id} holds {bad} non-finite values (NaN/Inf); "
                f"the limit is 0: lower the inner learning rate or clip gradients"
            )
        if largest > self.config.max_abs_value:
            raise InvalidPayloadError(
                f"payload from worker {header.worker_id} holds a value of magnitude {largest:.3g}, over "
                f"max_abs_value={self.config.max_abs_value:g} (it would overflow the global model); the worker "
                f"diverged: lower its inner learning rate, or raise --max-abs-value for a model on that scale"
            )
        with self._apply_lock:  # one apply at a time; θ and m change only under this lock
            with self._lock:
                rec = self._workers.get(header.worker_id)
                if rec is not None and header.push_id in rec.outcomes:  # a concurrent retry won the race
                    return dataclasses.replace(rec.outcomes[header.push_id], duplicate=True)
                rec = self._touch_locked(header.worker_id)
                tau, weight, version_after = self._check_staleness_locked(header)
                expected = self._expected_locked(self._clock()) | {header.worker_id}
                live = len(expected)  # N for delayed_nesterov with dn_buffer=0
                if self.journal is not None:  # durable before it is applied and acknowledged
                    self.journal.log_push(header, payload, tau, weight, version_after, live)
            self._apply_delta(header, delta, weight, live, version_after)  # the tensor math: _lock is free meanwhile
            snap = None
            pulls_follow = self._snapshots.wanted and header.kind == pb.PUSH_KIND_PSEUDO_GRADIENT
            if pulls_follow and self._snapshots.has_room():  # encode it now: the pulls will not wait
                snap = self._encode_snapshot_applylocked(version_after)
            with self._lock:
                outcome = self._record_push_locked(rec, header, tau, weight)
                if snap is not None:
                    self._snapshots.publish(snap)
                if header.kind == pb.PUSH_KIND_PSEUDO_GRADIENT:
                    self._rates.record(header.worker_id, header.num_local_steps, self._clock(), header.compute_s)
                    rec.last_push = self._clock()
                    group_id = self.groups.arrive(
                        header.worker_id, expected, self._group_max_wait_s_locked(),
                        buffer_complete=isinstance(self.outer, DelayedNesterov) and self.outer.arrivals == 0,
                    )  # fmt: skip
                    # (the remembered outcome stays as replay rebuilds it; H_w is recomputed per reply)
                    outcome = dataclasses.replace(outcome, group_id=group_id)
                    self.monitor.observe(largest, header.worker_id, self.version)
        if self.journal is not None:
            self.journal.maybe_checkpoint()
        return outcome

    def _check_staleness_locked(self, header: pb.PushHeader) -> tuple[int, float, int]:
        """(τ, s(τ), version after the apply) of a push about to be applied.

        Raises:
            StalePushError: τ > max_staleness, a base version from the future, or
            initial parameters for an initialized server.
        """
        if header.kind == pb.PUSH_KIND_INITIAL_PARAMETERS:
            if self.initialized:
                raise StalePushError(f"initial parameters from worker {header.worker_id} refused: already initialized")
            return 0, 1.0, self.version
        tau = self.version - header.base_version
        if tau < 0:
            raise StalePushError(
                f"base_version {header.base_version} is from the future: the server is at version "
                f"{self.version}; pull the global model and push against its version"
            )
        limit = self.config.outer.max_staleness
        if tau > limit:
            raise StalePushError(
                f"staleness {tau} (base_version {header.base_version}, server version {self.version}) "
                f"exceeds max_staleness={limit}; pull the global model and sync more often "
                f"(smaller H) or raise --max-staleness"
            )
        return tau, staleness_weight(self.config.outer, tau), self.version + 1

    def _apply_delta(
        self, header: pb.PushHeader, delta: torch.Tensor, weight: float, num_workers: int, version_after: int
    ) -> None:
        """The tensor math of a checked push (``_apply_lock`` held): the initial
        parameters become θ, or the outer optimizer steps on s(τ)·Δ. ``delta`` (N,)
        fp32 may be scaled in place (the outer step uses it as scratch). The step that
        produces ``version_after`` is applied at version ``version_after − 1`` (the
        updates applied before it), which keys η's schedule, live and in log replay."""
        if header.kind == pb.PUSH_KIND_INITIAL_PARAMETERS:
            params = delta.clone()
            outer = make_outer_optimizer(params, self.config.outer, self.manifest.block_sizes())
            self.params, self.outer = params, outer
            log.info("global model initialized by worker %d (%d parameters)", header.worker_id, delta.numel())
        else:
            self.outer.step(delta, weight, version=version_after - 1, num_workers=num_workers)

    def _record_push_locked(self, rec: WorkerRecord, header: pb.PushHeader, tau: int, weight: float) -> PushOutcome:
        """The bookkeeping of an applied push (``_lock`` held): version, counters and the
        outcome remembered for retries."""
        if header.kind == pb.PUSH_KIND_INITIAL_PARAMETERS:
            outcome = PushOutcome(True, False, self.version, 0, 1.0, self.config.local_steps)
        else:
            self.version += 1
            self.applied_pushes += 1
            self.tokens += header.num_tokens
            self.bytes_pushed += header.total_bytes
            self.staleness_histogram[min(tau, len(self.staleness_histogram) - 1)] += 1
            rec.applied_pushes += 1
            rec.tokens += header.num_tokens
            rec.local_steps += header.num_local_steps
            outcome = PushOutcome(True, False, self.version, tau, weight, self.config.local_steps)
        rec.outcomes[header.push_id] = outcome
        while len(rec.outcomes) > _PUSH_MEMORY:
            rec.outcomes.popitem(last=False)
        return outcome

    def push(
        self,
        payload: torch.Tensor,
        *,
        worker_id: int,
        push_id: int,
        base_version: int = 0,
        num_local_steps: int = 0,
        num_tokens: int = 0,
        kind: int = pb.PUSH_KIND_PSEUDO_GRADIENT,
        compute_s: float = 0.0,
    ) -> PushOutcome:
        """An in-process push (the simulator, benchmarks and tests): the payload is cut
        into chunks exactly as the wire carries it and goes through ``receive_push``,
        with every check the servicer applies.

        Args:
            payload: 1-D uint8 CPU tensor in the manifest's layout.
        Returns:
            The outcome (``duplicate`` for a retried push_id).
        Raises:
            The exceptions of ``begin_push``, ``PayloadAssembler`` and ``apply_push``.
        """
        chunk_bytes = self.config.chunk_bytes
        header = pb.PushHeader(
            worker_id=worker_id, push_id=push_id, base_version=base_version, num_local_steps=num_local_steps,
            num_tokens=num_tokens, total_bytes=payload.numel(), num_chunks=num_chunks_for(payload.numel(), chunk_bytes),
            crc32=crc32_of(payload), kind=kind, compute_s=compute_s,
        )  # fmt: skip

        def fill(assembler: PayloadAssembler) -> None:
            for index, offset, data in chunk_views(payload, chunk_bytes):
                assembler.add(WireChunk(index, offset, data))

        return self.receive_push(header, fill, drain=lambda: None)

    def record_rejected(self, worker_id: int) -> None:
        with self._lock:
            self.rejected_pushes += 1
            rec = self._workers.get(worker_id)
            if rec is not None:
                rec.rejected_pushes += 1

    def record_duplicate(self) -> None:
        with self._lock:
            self.duplicate_pushes += 1

    def finish_push(
        self, outcome: PushOutcome, worker_id: int = 0, hold: bool = True, max_wait_s: float = math.inf
    ) -> pb.PushReply:
        """The reply to a push that was applied or answered as a retry (gRPC and bulk):
        counts a duplicate, or holds an applied push until its group is released
        (schedule.py; Liu et al. 2024, Alg. 2), so that workers whose pushes landed
        together pull the same model (not when ``hold`` is False: the worker's last
        push, ``PushHeader.last``). H_w is taken after the wait, when the group's rates
        are in. The wait ends by ``max_wait_s`` (the caller's deadline) in any case.
        ``group_max_wait_s`` in the reply is the current bound on that wait, for the
        worker's next push deadline."""
        held_s = 0.0
        if outcome.duplicate:
            self.record_duplicate()
        elif outcome.group_id and hold:
            held_s = self.groups.wait(outcome.group_id, max_wait_s)
        local_steps = self.local_steps_for(worker_id) if worker_id else outcome.local_steps
        return pb.PushReply(
            applied=outcome.applied,
            duplicate=outcome.duplicate,
            version=outcome.version,
            staleness=outcome.staleness,
            staleness_weight=outcome.staleness_weight,
            local_steps=local_steps,
            held_s=held_s,
            group_max_wait_s=self.group_max_wait_s(),
        )

    def group_max_wait_s(self) -> float:
        """The longest a push reply may be held now, seconds (RunConfig.group_max_wait_s)."""
        with self._lock:
            return self._group_max_wait_s_locked()

    # ---------------------------------------------------------------- status
    def status(self) -> pb.StatusReply:
        with self._lock:
            now = self._clock()
            self._expire_locked(now)
            opt, stal = describe(self.config.outer)
            return pb.StatusReply(
                version=self.version,
                applied_pushes=self.applied_pushes,
                rejected_pushes=self.rejected_pushes,
                duplicate_pushes=self.duplicate_pushes,
                staleness_histogram=list(self.staleness_histogram),
                bytes_pushed=self.bytes_pushed,
                bytes_pulled=self.bytes_pulled,
                tokens=self.tokens,
                uptime_s=now - self._started,
                initialized=self.initialized,
                workers=[
                    pb.WorkerStatus(
                        worker_id=r.worker_id,
                        worker_name=r.name,
                        applied_pushes=r.applied_pushes,
                        rejected_pushes=r.rejected_pushes,
                        tokens=r.tokens,
                        local_steps=r.local_steps,
                        last_seen_s=now - r.last_seen,
                        alive=r.alive,
                        local_steps_per_round=self._local_steps_locked(r.worker_id),
                        steps_per_s=self._rates.rates.get(r.worker_id, 0.0),
                    )
                    for r in self._workers.values()
                ],
                run_config=self._run_config_locked(0),
                outer_optimizer=opt,
                staleness_weighting=stal,
                manifest=self.manifest.to_proto() if self.manifest else None,
                pulls=self.pulls,
                rounds_committed=self.quorum.rounds_committed if self.quorum else 0,
                rounds_failed=self.quorum.rounds_failed if self.quorum else 0,
                group_size_histogram=self.groups.size_histogram(),
                divergence_warnings=self.monitor.warnings,
            )
