"""Push intake: a push's header checked before its payload is read, the payload
received into a pooled buffer and checked (size, CRC-32, finite values), whatever
carries it (gRPC, the bulk channel, an in-process call).

A push goes ``begin`` (header checks, a receive buffer from the pool) → the transport
fills the ``PayloadAssembler`` (which checks chunk order and the CRC-32) → ``apply``
(the push kind's own apply: apply.py, rounds.py); ``receive`` runs the three and gives the
buffer back however they end. Receiving, the CRC check, decoding and the finiteness
check happen before the state's locks are taken, so a push being received never holds
up another one being applied. ``(worker_id, push_id)`` makes a retried push idempotent:
it is answered with its original outcome, and an id at or below the worker's high-water
mark is never applied again (records.py ``WorkerRecord.answer_retry``).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from typing import cast

import torch

from asyncdiloco.algo.schedule import GroupGate
from asyncdiloco.errors import InvalidPayloadError, PayloadTooLargeError, UnknownVersionError
from asyncdiloco.ps.buffers import ReceivePool
from asyncdiloco.ps.config import ServerConfig
from asyncdiloco.ps.counters import Counters
from asyncdiloco.ps.modes import KNOWN_KINDS, Mode, PushHandler, describe_push
from asyncdiloco.ps.records import PushOutcome, StateLocks
from asyncdiloco.ps.registry import WorkerRegistry
from asyncdiloco.ps.values import ValueScan, largest_magnitude
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.grpc_chunks import WireChunk
from asyncdiloco.wire.header_crc import check_header
from asyncdiloco.wire.tensors import Manifest, PayloadAssembler, chunk_views, crc32_of, num_chunks_for

log = logging.getLogger(__name__)

#: Kinds a retried push_id does not short-circuit: a retried round-result upload
#: re-stages the same Δ̄, and only the vote decides whether it is applied.
_NOT_DEDUPLICATED = (pb.PUSH_KIND_ROUND_RESULT,)


def check_values(
    delta: torch.Tensor,
    worker_id: int,
    max_abs_value: float,
    manifest: Manifest | None = None,
    what: str = "",
    largest: float | None = None,
    fix: str = "lower the inner learning rate or clip gradients",
) -> float:
    """Refuse a decoded push (float32 (N,), in the manifest's parameter order) with
    non-finite values or values too large for θ; returns ‖Δ‖∞ (the divergence monitor's
    input). The refusal names the parameter and index of the first bad element.

    Args:
        what: names the payload in the refusal (default "payload from worker <id>").
        largest: ‖Δ‖∞ when it is known already (values.py ``ValueScan``, computed while
            the chunks landed): then a payload that passes costs no pass here.
    Raises:
        InvalidPayloadError: a NaN or ±inf, or a magnitude over ``max_abs_value``.
    """
    what = what or f"payload from worker {worker_id}"
    if largest is None:
        largest = largest_magnitude(delta)  # NaN/Inf propagate
    if not math.isfinite(largest):
        bad = ~torch.isfinite(delta)
        first = int(torch.argmax(bad.to(torch.uint8)))  # argmax gives the first maximal index
        raise InvalidPayloadError(
            f"{what} holds {int(bad.sum())} non-finite values (NaN/Inf), the first at "
            f"{element_name(manifest, first)}; the limit is 0: {fix}"
        )
    if largest > max_abs_value:
        first = int(torch.argmax((delta.abs() > max_abs_value).to(torch.uint8)))
        raise InvalidPayloadError(
            f"{what} holds a value of magnitude {largest:.3g} (the first over the limit at "
            f"{element_name(manifest, first)}), over max_abs_value={max_abs_value:g} (it would overflow the "
            f"global model); {fix}, or raise --max-abs-value for a model on that scale"
        )
    return largest


def element_name(manifest: Manifest | None, index: int) -> str:
    """ "parameter #0 'weight', index (0, 7)": where element ``index`` of the flat (N,)
    vector lies (the manifest's parameter order); "element <index>" without a manifest."""
    if manifest is not None:
        start = 0
        for i, spec in enumerate(manifest.tensors):
            if index < start + spec.numel:
                at = tuple(int(v) for v in torch.unravel_index(torch.tensor(index - start), spec.shape))
                return f"parameter #{i} {spec.name!r}, index {at}"
            start += spec.numel
    return f"element {index}"


def _check_fields(header: pb.PushHeader, max_payload_bytes: int) -> None:
    """The header fields every kind shares, before the kind is known."""
    if header.total_bytes > max_payload_bytes:
        raise PayloadTooLargeError(
            f"total_bytes is {header.total_bytes}; the limit is max_payload_bytes="
            f"{max_payload_bytes}; send a smaller model or raise the server's limit"
        )
    if header.base_version < 0:
        raise UnknownVersionError(
            f"base_version {header.base_version} was never served: versions start at 0; push against the "
            f"version the worker pulled"
        )


def _check_push_id(header: pb.PushHeader) -> None:
    """A push id is a per-worker counter from 1 (PushHeader.push_id)."""
    if header.push_id < 1:
        raise InvalidPayloadError(
            f"push_id is {header.push_id}; the smallest is 1: number a worker's pushes with a counter starting at 1"
        )


def _check_counts(header: pb.PushHeader) -> None:
    for name in ("num_local_steps", "num_tokens"):
        if getattr(header, name) < 0:
            raise InvalidPayloadError(f"{name} is {getattr(header, name)}; it must be >= 0")


class PushIntake:
    """Checks and receives pushes (see the module docstring).

    Args:
        config: ``max_payload_bytes``, ``chunk_bytes``, ``receive_buffer_bytes``.
        locks: the state's locks (header checks run under ``books``).
        registry: the worker table (leases, remembered outcomes, H_w).
        counters: the status numbers (refused and retried pushes).
        groups: holds push replies per group (schedule.py).
        mode: the push kinds this server takes.
    """

    def __init__(
        self,
        config: ServerConfig,
        locks: StateLocks,
        registry: WorkerRegistry,
        counters: Counters,
        groups: GroupGate,
        mode: Mode,
    ) -> None:
        self.config = config
        self.locks = locks
        self.registry = registry
        self.counters = counters
        self.groups = groups
        self.mode = mode
        #: Receive buffers of the pushes in flight (and of the old versions pulls still read,
        #: ps/live.py), within ``receive_buffer_bytes``.
        self.pool = ReceivePool(config.receive_buffer_bytes, hold_lease_s=config.lease_s, clock=registry.clock)

    def kind_of(self, header: pb.PushHeader) -> PushHandler:
        """The mode's handler of the header's push kind.

        Raises:
            ModeMismatchError: a kind of the other mode. InvalidPayloadError: an unknown kind.
        """
        kind = self.mode.kinds.get(header.kind)
        if kind is not None:
            return kind
        if header.kind in KNOWN_KINDS:
            raise self.mode.mismatch(describe_push(header))
        raise InvalidPayloadError(
            f"push kind {header.kind} is not one of PUSH_KIND_PSEUDO_GRADIENT (1), "
            f"PUSH_KIND_INITIAL_PARAMETERS (2), PUSH_KIND_ROUND_RESULT (3)"
        )

    def begin(
        self, header: pb.PushHeader, is_active: Callable[[], bool] | None = None
    ) -> PayloadAssembler | PushOutcome:
        """Check a push header before its payload arrives, then take a receive buffer
        from the pool (waiting while other pushes in flight hold the budget).

        Args:
            header: the push's header.
            is_active: optional ``() -> bool``, False once the caller's RPC ended (gRPC's
                ``context.is_active``): the wait for a buffer then stops.
        Returns:
            A ``PayloadAssembler`` to feed the chunks to, or the original outcome when
            this ``(worker_id, push_id)`` was applied before (a retry).
        Raises:
            PayloadCorruptedError (the header's header_crc32 differs: corrupted in transit),
            UnknownWorkerError, WorkerSupersededError, InvalidPayloadError, PayloadTooLargeError, StalePushError,
            NotInitializedError, ModeMismatchError, ServerBusyError (no buffer within
            30 s): nothing is changed.
        """
        check_header(header, f"a push from worker {header.worker_id} (push_id {header.push_id} as received)")
        _check_push_id(header)  # before a retry's answer: 0 or -5 is no replay of anything
        with self.locks.books:
            self.registry.check_session(header.worker_id, header.session_id)  # before a retry's answer
            retried = self._retried(header)
            if retried is not None:
                return retried
            self.registry.touch(header.worker_id, header.session_id)
            _check_fields(header, self.config.max_payload_bytes)
            kind = self.kind_of(header)
            kind.check(header)
            _check_counts(header)
            total, what = kind.payload_bytes()
        if header.total_bytes != total:
            raise InvalidPayloadError(
                f"total_bytes is {header.total_bytes}; the model's payload is {total} bytes {what}"
            )
        before_receive = getattr(kind, "before_receive", None)  # a follower shard's turn (apply.py)
        if before_receive is not None:
            before_receive(header)  # no receive buffer held while it waits
        return self._assembler(header, kind.pooled, is_active)

    def _retried(self, header: pb.PushHeader) -> PushOutcome | None:
        """The answer to a replayed push id (books lock held; ``WorkerRecord.answer_retry``),
        else None."""
        rec = self.registry.get(header.worker_id)
        if rec is None or header.kind in _NOT_DEDUPLICATED:
            return None
        retried = rec.answer_retry(header.push_id, self.registry.model.version, self.config.local_steps)
        if retried is not None and not retried.applied:
            log.warning(
                "push %d of worker %d is at or below its high-water mark %d and no outcome of it is remembered: "
                "not applied (a replay of an old push)",
                header.push_id,
                header.worker_id,
                rec.last_push_id,
            )
        return retried

    def _assembler(self, header: pb.PushHeader, pooled: bool, is_active: Callable[[], bool] | None) -> PayloadAssembler:
        buffer = None  # not pooled (a round result, staged until the vote): a buffer of its own
        if pooled:
            buffer = self.pool.acquire(header.total_bytes, is_active=is_active)  # waits up to 30 s
        try:
            assembler = PayloadAssembler(
                total_bytes=header.total_bytes,
                num_chunks=header.num_chunks,
                crc32=header.crc32,
                chunk_bytes=self.config.chunk_bytes,
                max_bytes=self.config.max_payload_bytes,
                buffer=buffer,
            )
            if self._float32_payload(header):  # the value check per chunk, as the chunks land
                assembler.watch = ValueScan(assembler.buffer)
            return assembler
        except Exception:
            if buffer is not None:
                self.pool.release(buffer)
            raise

    def _float32_payload(self, header: pb.PushHeader) -> bool:
        """Whether the payload's bytes are the float32 vector the kind's value check reads
        (raw fp32 pseudo-gradients and initial parameters; Δ̄ of a round), so that it can
        be scanned as it lands (values.py)."""
        model = self.registry.model
        fp32 = model.manifest is not None and model.manifest.all_float32 and header.total_bytes % 4 == 0
        if header.kind == pb.PUSH_KIND_PSEUDO_GRADIENT:
            return fp32 and model.config.wire_codec == "raw"
        if header.kind == pb.PUSH_KIND_INITIAL_PARAMETERS:
            return fp32
        return header.kind == pb.PUSH_KIND_ROUND_RESULT and header.total_bytes % 4 == 0

    def apply(self, header: pb.PushHeader, payload: torch.Tensor, largest: float | None = None) -> PushOutcome:
        """Apply a complete, CRC-checked payload (uint8 (total_bytes,)) with its kind's apply.

        Args:
            largest: the payload's ‖x‖∞ when it was scanned as it landed (values.py), else None.
        Raises:
            The kind's refusals (apply.py, rounds.py); ``kind_of``'s for a kind this mode
            does not take. In every case θ, momentum, version and the counters are unchanged.
        """
        return self.kind_of(header).apply(header, payload, largest=largest)

    def receive(
        self,
        header: pb.PushHeader,
        fill: Callable[[PayloadAssembler], None],
        drain: Callable[[], None],
        is_active: Callable[[], bool] | None = None,
    ) -> PushOutcome:
        """One whole push: ``begin``, ``fill`` (copies the payload into the assembler),
        ``apply``; the buffer goes back to the pool however that ends. A retry of an
        applied push is answered with its original outcome after ``drain`` consumed its
        payload.

        The worker's lease does not lapse while its push is received and applied, however
        slow the upload (``_in_progress``).

        Raises:
            The exceptions of ``begin`` (raised before ``fill`` is called: nothing of the
            payload was read), of ``fill`` and of ``apply``.
        """
        with self._in_progress(header.worker_id):
            started = self.begin(header, is_active)
            if isinstance(started, PushOutcome):
                drain()
                return started
            try:
                fill(started)
                payload = started.finish()  # size and CRC-32 checked
                scan = started.watch
                return self.apply(header, payload, scan.largest if isinstance(scan, ValueScan) else None)
            finally:  # the payload is not used after this; a buffer of its own is not the pool's
                self.pool.release(started.buffer)

    @contextlib.contextmanager
    def _in_progress(self, worker_id: int) -> Iterator[None]:
        """A part of ``worker_id``'s push (its receipt and apply, or its held reply): the
        worker's lease does not lapse meanwhile and runs afresh from its end (registry.py
        ``begin_call``). A lease that lapsed before it stays lapsed (expired first)."""
        if not worker_id:
            yield
            return
        with self.locks.books:
            self.registry.expire(self.registry.clock())
            self.registry.begin_call(worker_id)
        try:
            yield
        finally:
            with self.locks.books:
                self.registry.end_call(worker_id)

    def receive_in_process(self, header: pb.PushHeader, payload: torch.Tensor) -> PushOutcome:
        """``receive`` of a payload (uint8 (N,) CPU) held in memory, cut into chunks
        exactly as the wire carries it; fills in the header's size, chunk count and CRC-32."""
        chunk_bytes = self.config.chunk_bytes
        header.total_bytes = payload.numel()
        header.num_chunks = num_chunks_for(payload.numel(), chunk_bytes)
        header.crc32 = crc32_of(payload)

        def fill(assembler: PayloadAssembler) -> None:
            for index, offset, data in chunk_views(payload, chunk_bytes):
                assembler.add(cast(pb.PayloadChunk, WireChunk(index, offset, data)))  # quacks like one

        return self.receive(header, fill, drain=lambda: None)

    def _group_now(self) -> tuple[set[int], float]:
        """(the workers a group waits for, the window) as of now, leases re-checked: what
        a held reply rechecks its group with (schedule.py ``GroupGate.wait``)."""
        with self.locks.books:
            now = self.registry.clock()
            self.registry.expire(now)
            return self.registry.expected(now), self.registry.group_max_wait_s()

    def reply(
        self, outcome: PushOutcome, worker_id: int = 0, hold: bool = True, max_wait_s: float = math.inf
    ) -> pb.PushReply:
        """The reply to a push that was applied or answered as a retry (gRPC and bulk).

        Counts a duplicate, or holds an applied push until its group is released
        (schedule.py; Liu et al. 2024, Alg. 2), so that workers whose pushes landed
        together pull the same model; not when ``hold`` is False (the worker's last
        push, ``PushHeader.last``). H_w is taken after the wait, when the group's rates
        are in.

        The hold never outlasts the wait the worker was told (``group_max_wait_s`` of its
        previous PushReply or its JoinReply, registry.py ``told_wait_s``), which its
        push deadline covers, even when the group's window is longer (it grew since:
        an auto window once slower rates are known, a worker that joined). The worker's
        lease does not lapse while the server holds its reply, and runs afresh from the
        reply (``_in_progress``): a window as long as the lease, or longer, costs no lease.

        Args:
            outcome: what ``receive`` returned.
            worker_id: the pusher (0: reply with the outcome's H).
            hold: wait for the push's group.
            max_wait_s: the wait ends by then in any case (the call's deadline), seconds.
        Returns:
            The ``PushReply``; its ``group_max_wait_s`` bounds the hold of the worker's
            next push (and so its deadline).
        """
        held_s = 0.0
        if outcome.duplicate:
            self.count_duplicate()
        elif outcome.group_id and hold:
            with self.locks.books:
                told_s = self.registry.told_wait_s(worker_id) if worker_id else max_wait_s
            with self._in_progress(worker_id):
                held_s = self.groups.wait(outcome.group_id, min(max_wait_s, told_s), self._group_now)
        with self.locks.books:
            local_steps = self.registry.local_steps(worker_id) if worker_id else outcome.local_steps
            max_wait_next_s = self.registry.tell_wait_s(worker_id)
        return pb.PushReply(
            applied=outcome.applied,
            duplicate=outcome.duplicate,
            version=outcome.version,
            staleness=outcome.staleness,
            staleness_weight=outcome.staleness_weight,
            local_steps=local_steps,
            held_s=held_s,
            group_max_wait_s=max_wait_next_s,
        )

    def count_rejected(self, worker_id: int) -> None:
        """A push of ``worker_id`` was refused or cut off."""
        with self.locks.books:
            self.counters.rejected_pushes += 1
            rec = self.registry.get(worker_id)
            if rec is not None:
                rec.rejected_pushes += 1

    def count_duplicate(self) -> None:
        """A retried push was answered with its original outcome."""
        with self.locks.books:
            self.counters.duplicate_pushes += 1
