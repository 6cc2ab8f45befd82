"""The gRPC servicer: decode the request, call the state's part that owns it, encode the reply.

Library exceptions become gRPC status codes (``AsyncDiLoCoError.grpc_code``) carrying
the exception's message, which names the value, the limit and the fix.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import cast

import grpc

from asyncdiloco.errors import AsyncDiLoCoError, InvalidPayloadError, quoted, reason_metadata
from asyncdiloco.ps.push.shard_order import CURRENT, METADATA_KEY, ShardOrder, order_from_metadata
from asyncdiloco.ps.state import ParameterServerState
from asyncdiloco.ps.sync.long_poll import KEEP_S, CallWatch
from asyncdiloco.ps.sync.quorum import QuorumMiss
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire._proto import parameter_server_pb2_grpc as pb_grpc
from asyncdiloco.wire.grpc_chunks import WirePushRequest, is_chunk
from asyncdiloco.wire.roles import ROLE_KEY, ROLE_REGION
from asyncdiloco.wire.tensors import Manifest, PayloadAssembler

log = logging.getLogger(__name__)


def _abort(context: grpc.ServicerContext, exc: AsyncDiLoCoError) -> None:
    """End the call with ``exc``'s status code and message, and its reason code in the
    trailing metadata (errors.py): the client raises the same exception from it."""
    context.set_trailing_metadata(reason_metadata(exc))
    context.abort(exc.grpc_code, str(exc))


def _nothing() -> None:
    """A PushOne retry's drain: its payload came in the one message, nothing is left."""


class ParameterServerService(pb_grpc.ParameterServerServicer):
    """Implements ``asyncdiloco.v1.ParameterServer`` over a ``ParameterServerState``."""

    def __init__(self, state: ParameterServerState) -> None:
        self.state = state

    def _watch(self, context: grpc.ServicerContext) -> CallWatch:
        """A Quorum/Commit wait's view of its call: it ends when the call ends (the client
        cancelled or its deadline passed: gRPC runs the callback, which wakes the waits)
        and never outlasts the call's deadline."""
        quorum = self.state.quorum
        if quorum is not None:
            context.add_callback(quorum.notify)
        remaining = context.time_remaining()
        return CallWatch(context.is_active, remaining if remaining is not None else math.inf)

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinReply:
        try:
            manifest = Manifest.from_proto(request.manifest)
            region = (ROLE_KEY, ROLE_REGION) in tuple(context.invocation_metadata() or ())
            joined = self.state.join_worker(manifest, request.worker_name, request.steps_per_s, request.ranks, region)
        except AsyncDiLoCoError as exc:
            log.warning("join refused (%s): %s", quoted(request.worker_name) if request.worker_name else "unnamed", exc)
            _abort(context, exc)
        return pb.JoinReply(
            worker_id=joined.worker_id,
            run_config=self.state.run_config(joined.worker_id, joining=True),
            manifest=self.state.model.known_manifest.to_proto(),
            version=joined.version,
            initialize=joined.initialize,
            resumed=joined.resumed,
            last_push_id=joined.last_push_id,
            session_id=joined.session_id,
        )

    def Pull(self, request: pb.PullRequest, context: grpc.ServicerContext):
        remaining = context.time_remaining()  # a wait for a snapshot slot leaves half of it for the transfer
        max_wait_s = remaining / 2 if remaining is not None else float("inf")
        try:
            # a snapshot's chunk messages are encoded once per version
            source = self.state.open_pull(request, max_wait_s=max_wait_s)
        except AsyncDiLoCoError as exc:
            _abort(context, exc)
        try:
            yield pb.PullMessage(header=source.header)
            yield from source.messages(self.state.config.chunk_bytes)
            self.state.record_pull(request.worker_id, source.header.total_bytes)
        finally:  # also when the client cancels: the snapshot may then be freed
            self.state.snapshots.close_pull(source)

    def Push(self, request_iterator, context: grpc.ServicerContext) -> pb.PushReply:
        """A push streamed as a header, then its chunks (several hand-offs from gRPC's poller)."""

        def fill(assembler) -> None:
            for msg in request_iterator:
                if not is_chunk(msg):
                    if msg.WhichOneof("body") != "chunk":
                        raise InvalidPayloadError(
                            "a second PushHeader arrived inside the stream; send one header per push"
                        )
                    msg = msg.chunk
                assembler.add(msg)

        def drain() -> None:
            for _ in request_iterator:
                pass

        def first_header() -> pb.PushHeader:
            first = next(request_iterator, None)
            if first is None or is_chunk(first) or first.WhichOneof("body") != "header":
                raise InvalidPayloadError(
                    "the first PushMessage must carry a PushHeader; send the header, then the chunks"
                )
            return first.header

        return self._push(first_header, fill, drain, context)

    def PushOne(self, request: WirePushRequest, context: grpc.ServicerContext) -> pb.PushReply:
        """A push whose payload fits in one chunk, header and chunk in one message: the
        same checks, refusals and apply as ``Push``."""

        def fill(assembler: PayloadAssembler) -> None:
            if assembler.num_chunks > 1:  # after the header's checks: its CRC vouches for num_chunks
                raise InvalidPayloadError(
                    f"a PushOne message carries one chunk, but num_chunks is {assembler.num_chunks} "
                    f"(total_bytes {assembler.total_bytes} over chunk_bytes={assembler.chunk_bytes}); "
                    f"send a payload of more than one chunk as a Push stream"
                )
            if request.chunk is not None:
                assembler.add(cast(pb.PayloadChunk, request.chunk))  # a WireChunk quacks like one

        def header() -> pb.PushHeader:
            if request.header is None:
                raise InvalidPayloadError("the PushRequest carries no PushHeader; send the header with the chunk")
            return request.header

        return self._push(header, fill, _nothing, context)

    def _push(
        self,
        first_header: Callable[[], pb.PushHeader],
        fill: Callable[[PayloadAssembler], None],
        drain: Callable[[], None],
        context: grpc.ServicerContext,
    ) -> pb.PushReply:
        """One push, whatever the RPC that carried it: push/intake.py ``receive``, its
        refusal (``PushIntake.refused``) or its reply; ``first_header`` reads the header,
        ``fill`` the payload, ``drain`` what a retry's payload left unread."""
        intake, header, token = self.state.intake, None, None
        try:
            header = first_header()
            follower = self.state.config.shard_index > 0  # a follower shard: shard 0's order rides in the metadata
            token = CURRENT.set(order_from_metadata(context.invocation_metadata()) if follower else None)
            outcome = intake.receive(header, fill, drain, is_active=context.is_active)
        except AsyncDiLoCoError as exc:
            intake.refused(header.worker_id if header is not None else 0, exc)
            _abort(context, exc)
        except grpc.RpcError:  # the request stream broke: the client cancelled or the connection dropped
            worker_id = header.worker_id if header is not None else 0
            log.warning(
                "push from worker %d cut off mid-stream (cancelled or disconnected); nothing was applied", worker_id
            )
            intake.count_rejected(worker_id, "cut_off")
            raise
        finally:
            if token is not None:
                CURRENT.reset(token)
        assert header is not None
        remaining = context.time_remaining()  # never hold a reply past the client's deadline
        max_wait_s = max(0.0, remaining - 1.0) if remaining is not None else float("inf")
        hold = not header.last  # a last push is not held
        reply = intake.reply(outcome, header.worker_id, hold=hold, max_wait_s=max_wait_s)
        if self.state.config.shard_count > 1 and outcome.applied and outcome.num_workers:
            order = ShardOrder(
                outcome.version, outcome.staleness, outcome.staleness_weight, outcome.num_workers, outcome.closing
            )
            context.set_trailing_metadata(((METADATA_KEY, order.encode()),))  # for the other shards
        return reply

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatReply:
        try:
            version, remaining, initialize = self.state.heartbeat(
                request.worker_id, request.steps_per_s, request.session_id
            )
        except AsyncDiLoCoError as exc:
            _abort(context, exc)
        return pb.HeartbeatReply(
            version=version,
            lease_remaining_s=remaining,
            initialize=initialize,
            local_steps=self.state.local_steps_for(request.worker_id),
            group_max_wait_s=self.state.group_max_wait_s(),
        )

    def Leave(self, request: pb.LeaveRequest, context: grpc.ServicerContext) -> pb.LeaveReply:
        self.state.leave(request.worker_id, request.session_id)
        return pb.LeaveReply()

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
        return self.state.status()

    def ReportEval(self, request: pb.EvalReport, context: grpc.ServicerContext) -> pb.EvalReply:
        try:
            self.state.report_eval(request.version, request.loss, request.num_tokens, request.evaluator)
        except AsyncDiLoCoError as exc:
            name = quoted(request.evaluator) if request.evaluator else "unnamed"
            log.warning("eval report (%s) refused: %s", name, exc)
            _abort(context, exc)
        return pb.EvalReply()

    def Quorum(self, request: pb.QuorumRequest, context: grpc.ServicerContext) -> pb.QuorumReply:
        try:
            got = self.state.request_quorum(
                request.worker_id,
                request.round,
                request.manifest_hash,
                request.timeout_s,
                request.poll,
                self._watch(context),
            )
        except AsyncDiLoCoError as exc:
            log.warning("quorum request of worker %d refused: %s", request.worker_id, exc)
            _abort(context, exc)
        if isinstance(got, QuorumMiss):
            return pb.QuorumReply(
                formed=False,
                reason=got.reason,
                have=got.have,
                need=got.need,
                queued=got.queued,
                pending=got.pending,
                keep_s=KEEP_S if got.pending else 0.0,
            )
        return pb.QuorumReply(
            formed=True,
            quorum_id=got.quorum_id,
            round=got.round,
            members=list(got.members),
            rank=got.rank,
            world_size=got.world_size,
            heal=got.heal,
            round_deadline_s=max(0.0, got.deadline - self.state.clock()),
        )

    def Commit(self, request: pb.CommitRequest, context: grpc.ServicerContext) -> pb.CommitReply:
        try:
            decision = self.state.commit(
                request.worker_id,
                request.quorum_id,
                success=request.success,
                total_weight=request.total_weight,
                num_tokens=request.num_tokens,
                num_local_steps=request.num_local_steps,
                reason=request.reason,
                timeout_s=request.timeout_s,
                poll=request.poll,
                call=self._watch(context),
                compute_s=request.compute_s,
            )
        except AsyncDiLoCoError as exc:
            log.warning("commit vote of worker %d refused: %s", request.worker_id, exc)
            _abort(context, exc)
        if decision is None:
            return pb.CommitReply(decided=False)
        return pb.CommitReply(
            decided=True,
            committed=decision.committed,
            round=decision.round,
            reason=decision.reason,
            local_steps=decision.local_steps.get(request.worker_id, 0),
        )

    def Store(self, request: pb.StoreRequest, context: grpc.ServicerContext) -> pb.StoreReply:
        try:
            reply = self.state.store(request)
        except AsyncDiLoCoError as exc:
            log.debug("store call of worker %d refused: %s", request.worker_id, exc)  # a closed round: routine
            _abort(context, exc)
        return reply
