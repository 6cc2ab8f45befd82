"""Push intake: the one place a push is refused (``PushIntake.refuse``), and the one
function every transport hands a push to (``PushIntake.receive``: gRPC Push and PushOne,
the bulk channel, an in-process call), then the reply (``PushIntake.reply``).
docs/architecture.md, "One push".
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Protocol, cast

import torch

from asyncdiloco.algo.schedule import GroupGate
from asyncdiloco.errors import (
    AsyncDiLoCoError,
    InvalidPayloadError,
    PayloadTooLargeError,
    UnknownVersionError,
)
from asyncdiloco.ps.books import AppliedAs, Counters, PushOutcome, StateLocks, WorkerRecord
from asyncdiloco.ps.config import ServerConfig
from asyncdiloco.ps.core import mode_mismatch
from asyncdiloco.ps.pull.receive_pool import ReceivePool
from asyncdiloco.ps.push.value_scan import ValueScan
from asyncdiloco.ps.registry import WorkerRegistry
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.grpc_chunks import WireChunk
from asyncdiloco.wire.header_crc import check_header, seal
from asyncdiloco.wire.tensors import PayloadAssembler, chunk_views, crc32_of, num_chunks_for

log = logging.getLogger(__name__)

#: Every push kind a header may name (the others are refused as invalid).
KNOWN_KINDS = (pb.PUSH_KIND_PSEUDO_GRADIENT, pb.PUSH_KIND_INITIAL_PARAMETERS, pb.PUSH_KIND_ROUND_RESULT)
#: Kinds a retried push_id does not short-circuit: a retried round-result upload
#: re-stages the same Δ̄, and only the vote decides whether it is applied.
_NOT_DEDUPLICATED = (pb.PUSH_KIND_ROUND_RESULT,)


class PushKind(Protocol):
    """What one push kind (``pb.PUSH_KIND_*``) checks and does (apply.py, sync/rounds.py)."""

    #: The payload is received into the receive pool (else into a buffer of its own).
    pooled: bool

    def check(self, header: pb.PushHeader) -> None:
        """The kind's own header checks (books lock held); raises the refusal."""

    def payload_bytes(self) -> tuple[int, str]:
        """(bytes, how they are laid out) the payload must have (books lock held)."""

    def apply(self, header: pb.PushHeader, payload: torch.Tensor, largest: float | None = None) -> PushOutcome:
        """Apply (or stage) a complete, CRC-checked payload (uint8 (total_bytes,));
        ``largest``: its ‖x‖∞ when it was scanned as it landed, else None."""

    def replay(self, rec: WorkerRecord, header: pb.PushHeader, delta: torch.Tensor, applied: AppliedAs) -> None:
        """Redo a logged push at start-up (both locks held; durable/durability.py)."""


def describe_push(header: pb.PushHeader) -> str:
    """Names a push in a refusal: "the pseudo-gradient push 3 of worker 1", "the round result of quorum 2"."""
    if header.kind == pb.PUSH_KIND_ROUND_RESULT:
        return f"the round result of quorum {header.quorum_id}"
    return f"the pseudo-gradient push {header.push_id} of worker {header.worker_id}"


class PushIntake:
    """Checks, receives and answers pushes (see the module docstring).

    Args:
        config: ``max_payload_bytes``, ``chunk_bytes``, ``receive_buffer_bytes``, ``mode``.
        locks: the state's locks (header checks run under ``books``).
        registry: the worker table (leases, remembered outcomes, H_w).
        counters: the status numbers (refused and retried pushes).
        groups: holds push replies per group (schedule.py).
        kinds: the handler of each push kind this server's mode takes.
    """

    def __init__(
        self,
        config: ServerConfig,
        locks: StateLocks,
        registry: WorkerRegistry,
        counters: Counters,
        groups: GroupGate,
        kinds: Mapping[int, PushKind],
    ) -> None:
        self.config = config
        self.locks = locks
        self.registry = registry
        self.counters = counters
        self.groups = groups
        self.kinds = kinds
        #: Receive buffers of the pushes in flight (and of the old versions pulls still read,
        #: pull/live_view.py), within ``receive_buffer_bytes``.
        self.pool = ReceivePool(config.receive_buffer_bytes, hold_lease_s=config.lease_s, clock=registry.clock)

    def refuse(self, header: pb.PushHeader) -> PushKind | PushOutcome:
        """Every check of a push before its payload is read, in the order they run; the
        first that fails raises its typed error and nothing is changed. Later, in
        ``receive``: a follower shard's turn (``before_receive``: its order from shard 0,
        or too late); after the payload its size and CRC-32 (``PayloadAssembler.finish``),
        its values (value_check.py ``check_values``, in the kind's apply), and under the
        apply lock its staleness, lease and "already initialized" again (apply.py), or a
        sync round's upload refused by its round (``RoundRefusedError``).

        Returns:
            The push's kind, or for a retry of an applied push id its original outcome
            (``WorkerRecord.answer_retry``): it is answered, not applied.
        Raises:
            PayloadCorruptedError: the header's CRC is missing or wrong.
            InvalidPayloadError: push_id < 1; negative counts; an unknown kind; a size
                that is not the model's.
            WorkerSupersededError, UnknownWorkerError: an old session, a lapsed lease.
            PayloadTooLargeError: over ``max_payload_bytes``.
            UnknownVersionError: a negative base version.
            ModeMismatchError: a kind of the other mode.
            NotInitializedError, StalePushError: the kind's own checks.
        """
        _check_crc(header)
        return self._refuse_trusted(header)

    def _refuse_trusted(self, header: pb.PushHeader) -> PushKind | PushOutcome:
        """``refuse`` after the header's CRC passed."""
        if header.push_id < 1:  # before a retry's answer: 0 or -5 is no replay of anything
            raise InvalidPayloadError(
                f"push_id is {header.push_id}; the smallest is 1: number a worker's pushes with a counter starting at 1"
            )
        with self.locks.books:
            self.registry.check_session(header.worker_id, header.session_id)  # before a retry's answer
            retried = self._retried(header)
            if retried is not None:
                return retried
            self.registry.touch(header.worker_id, header.session_id)
            self._check_size_and_version(header)
            kind = self._kind(header)
            kind.check(header)
            for name in ("num_local_steps", "num_tokens"):
                if getattr(header, name) < 0:
                    raise InvalidPayloadError(f"{name} is {getattr(header, name)}; it must be >= 0")
            total, what = kind.payload_bytes()
        if header.total_bytes != total:
            raise InvalidPayloadError(
                f"total_bytes is {header.total_bytes}; the model's payload is {total} bytes {what}"
            )
        return kind

    def _check_size_and_version(self, header: pb.PushHeader) -> None:
        max_bytes = self.config.max_payload_bytes
        if header.total_bytes > max_bytes:
            raise PayloadTooLargeError(
                f"total_bytes is {header.total_bytes}; the limit is max_payload_bytes={max_bytes}; send a "
                f"smaller model or raise the server's limit"
            )
        if header.base_version < 0:
            raise UnknownVersionError(
                f"base_version {header.base_version} was never served: versions start at 0; push against the "
                f"version the worker pulled"
            )

    def _kind(self, header: pb.PushHeader) -> PushKind:
        kind = self.kinds.get(header.kind)
        if kind is None and header.kind in KNOWN_KINDS:
            raise mode_mismatch(self.config.mode, describe_push(header))
        if kind is None:
            raise InvalidPayloadError(
                f"push kind {header.kind} is not one of PUSH_KIND_PSEUDO_GRADIENT (1), "
                f"PUSH_KIND_INITIAL_PARAMETERS (2), PUSH_KIND_ROUND_RESULT (3)"
            )
        return kind

    def _retried(self, header: pb.PushHeader) -> PushOutcome | None:
        """The answer to a replayed push id (books lock held; ``WorkerRecord.answer_retry``),
        else None."""
        rec = self.registry.workers.get(header.worker_id)
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

    def receive(
        self,
        header: pb.PushHeader,
        fill: Callable[[PayloadAssembler], None],
        drain: Callable[[], None],
        is_active: Callable[[], bool] | None = None,
    ) -> PushOutcome:
        """One whole push, whatever carries it: ``refuse``, a receive buffer from the pool
        (waiting while ``is_active()``), ``fill`` (the transport copies the payload into the
        assembler, which checks it as it lands), then the kind's apply. A retry of an
        applied push gets its original outcome after ``drain`` consumed its payload.

        Raises:
            The exceptions of ``refuse`` (before ``fill`` is called: nothing of the payload
            was read), ServerBusyError (no buffer within 30 s), those of ``fill`` and of
            the kind's apply.
        """
        _check_crc(header)  # before its worker id is trusted with anything (a lease kept by _in_progress)
        with self._in_progress(header.worker_id):
            kind = self._refuse_trusted(header)
            if isinstance(kind, PushOutcome):
                drain()
                return kind
            before_receive = getattr(kind, "before_receive", None)  # a follower shard's turn (apply.py)
            if before_receive is not None:
                before_receive(header)  # no receive buffer held while it waits
            assembler = self._assembler(header, kind.pooled, is_active)
            try:
                fill(assembler)
                payload = assembler.finish()  # size and CRC-32 checked
                scan = assembler.watch
                return kind.apply(header, payload, largest=scan.largest if isinstance(scan, ValueScan) else None)
            finally:  # the payload is not used after this; a buffer of its own is not the pool's
                self.pool.release(assembler.buffer)

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
        be scanned as it lands (value_check.py)."""
        model = self.registry.model
        fp32 = model.manifest is not None and model.manifest.all_float32 and header.total_bytes % 4 == 0
        if header.kind == pb.PUSH_KIND_PSEUDO_GRADIENT:
            return fp32 and model.config.wire_codec == "raw"
        if header.kind == pb.PUSH_KIND_INITIAL_PARAMETERS:
            return fp32
        return header.kind == pb.PUSH_KIND_ROUND_RESULT and header.total_bytes % 4 == 0

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

    def push(
        self,
        payload: torch.Tensor,
        *,
        worker_id: int,
        push_id: int,
        base_version: int = 0,
        num_local_steps: int = 0,
        num_tokens: int = 0,
        kind: pb.PushKind = pb.PUSH_KIND_PSEUDO_GRADIENT,
        compute_s: float = 0.0,
        session_id: int = 0,
        last: bool = False,
        quorum_id: int = 0,
    ) -> PushOutcome:
        """An in-process push (the simulator, benchmarks and tests): ``receive`` of a
        payload (1-D uint8 CPU, the manifest's or the wire codec's layout) cut into chunks
        exactly as the wire carries it, its header sealed as a client seals it.

        Args:
            worker_id, push_id, base_version, num_local_steps, num_tokens, kind,
            compute_s, session_id, last, quorum_id: the ``PushHeader`` fields (compute_s
            in seconds; ``last``: the worker's closing push, outer.py ``step_closing``).
        Returns:
            The outcome (``duplicate`` for a retried push_id).
        Raises:
            The exceptions of ``receive``.
        """
        chunk_bytes = self.config.chunk_bytes
        header = pb.PushHeader(
            worker_id=worker_id,
            push_id=push_id,
            base_version=base_version,
            num_local_steps=num_local_steps,
            num_tokens=num_tokens,
            kind=kind,
            compute_s=compute_s,
            session_id=session_id,
            last=last,
            quorum_id=quorum_id,
            total_bytes=payload.numel(),
            num_chunks=num_chunks_for(payload.numel(), chunk_bytes),
            crc32=crc32_of(payload),
        )

        def fill(assembler: PayloadAssembler) -> None:
            for index, offset, data in chunk_views(payload, chunk_bytes):
                assembler.add(cast(pb.PayloadChunk, WireChunk(index, offset, data)))  # quacks like one

        return self.receive(seal(header), fill, drain=lambda: None)

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
        """The reply to a push that was applied or answered as a retry (gRPC and bulk): with
        ``hold``, an applied push waits until its group is released (schedule.py; Liu et
        al. 2024, Alg. 2), at most the wait the worker was told (registry.py
        ``told_wait_s``) and ``max_wait_s`` seconds; H_w is taken after the wait.
        ``worker_id`` 0: reply with the outcome's H."""
        held_s = 0.0
        if outcome.duplicate:
            with self.locks.books:
                self.counters.duplicate_pushes += 1
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

    def refused(self, worker_id: int, exc: AsyncDiLoCoError) -> None:
        """A transport's push was refused with ``exc`` (from ``receive``, or before it could
        read a header: ``worker_id`` 0): logged and counted (``count_rejected``)."""
        log.warning("push from worker %d refused: %s", worker_id, exc)
        self.count_rejected(worker_id, exc.reason)

    def count_rejected(self, worker_id: int, reason: str = "cut_off") -> None:
        """A push of ``worker_id`` was refused with the exception's ``reason`` code
        (errors.py), or cut off mid-stream ("cut_off")."""
        with self.locks.books:
            self.counters.rejected_pushes += 1
            self.counters.note_refusal(reason)
            rec = self.registry.workers.get(worker_id)
            if rec is not None:
                rec.rejected_pushes += 1


def _check_crc(header: pb.PushHeader) -> None:
    """``check_header`` for a push: PayloadCorruptedError when its CRC is missing or wrong."""
    check_header(header, f"a push from worker {header.worker_id} (push_id {header.push_id} as received)")
