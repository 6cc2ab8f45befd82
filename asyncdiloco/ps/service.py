"""The gRPC servicer: decode the request, call ``ParameterServerState``, encode the reply.

Library exceptions become gRPC status codes (``AsyncDiLoCoError.grpc_code``) carrying
the exception's message, which names the value, the limit and the fix.
"""

from __future__ import annotations

import logging

import grpc

from asyncdiloco._proto import parameter_server_pb2 as pb
from asyncdiloco._proto import parameter_server_pb2_grpc as pb_grpc
from asyncdiloco.errors import AsyncDiLoCoError, InvalidPayloadError
from asyncdiloco.ps.state import ParameterServerState, PushOutcome
from asyncdiloco.tensors import Manifest, iter_chunks, num_chunks_for

log = logging.getLogger(__name__)


def _abort(context: grpc.ServicerContext, exc: AsyncDiLoCoError) -> None:
    context.abort(exc.grpc_code, str(exc))


class ParameterServerService(pb_grpc.ParameterServerServicer):
    """Implements ``asyncdiloco.v1.ParameterServer`` over a ``ParameterServerState``."""

    def __init__(self, state: ParameterServerState) -> None:
        self.state = state

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinReply:
        try:
            manifest = Manifest.from_proto(request.manifest)
            worker_id, initialize, version = self.state.join(manifest, request.worker_name)
        except AsyncDiLoCoError as exc:
            log.warning("join refused (%s): %s", request.worker_name or "unnamed", exc)
            _abort(context, exc)
        return pb.JoinReply(
            worker_id=worker_id,
            run_config=self.state.run_config(worker_id),
            manifest=self.state.manifest.to_proto(),
            version=version,
            initialize=initialize,
        )

    def Pull(self, request: pb.PullRequest, context: grpc.ServicerContext):
        try:
            snap = self.state.snapshot()
        except AsyncDiLoCoError as exc:
            _abort(context, exc)
        chunk_bytes = self.state.config.chunk_bytes
        total = snap.payload.numel()
        yield pb.PullMessage(
            header=pb.PullHeader(
                version=snap.version,
                total_bytes=total,
                num_chunks=num_chunks_for(total, chunk_bytes),
                crc32=snap.crc32,
                run_config=self.state.run_config(request.worker_id),
            )
        )
        for chunk in iter_chunks(snap.payload, chunk_bytes):
            yield pb.PullMessage(chunk=chunk)
        self.state.record_pull(request.worker_id, total)

    def Push(self, request_iterator, context: grpc.ServicerContext) -> pb.PushReply:
        worker_id = 0
        try:
            first = next(request_iterator, None)
            if first is None or first.WhichOneof("body") != "header":
                raise InvalidPayloadError(
                    "the first PushMessage must carry a PushHeader; send the header, then the chunks"
                )
            header = first.header
            worker_id = header.worker_id
            started = self.state.begin_push(header)
            if isinstance(started, PushOutcome):  # a retry of an applied push: drain and answer
                for _ in request_iterator:
                    pass
                outcome = started
            else:
                for msg in request_iterator:
                    if msg.WhichOneof("body") != "chunk":
                        raise InvalidPayloadError(
                            "a second PushHeader arrived inside the stream; send one header per push"
                        )
                    started.add(msg.chunk)
                outcome = self.state.apply_push(header, started.finish())
        except AsyncDiLoCoError as exc:
            log.warning("push from worker %d refused: %s", worker_id, exc)
            self.state.record_rejected(worker_id)
            _abort(context, exc)
        except grpc.RpcError:  # the request stream broke: the client cancelled or the connection dropped
            log.warning("push from worker %d cut off mid-stream (cancelled or disconnected); nothing was applied",
                        worker_id)
            self.state.record_rejected(worker_id)
            raise
        if outcome.duplicate:
            self.state.record_duplicate()
        else:
            self.state.grace.wait()  # workers whose pushes landed together pull the same model
        return pb.PushReply(
            applied=outcome.applied,
            duplicate=outcome.duplicate,
            version=outcome.version,
            staleness=outcome.staleness,
            staleness_weight=outcome.staleness_weight,
            local_steps=outcome.local_steps,
        )

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatReply:
        try:
            version, remaining, initialize = self.state.heartbeat(request.worker_id)
        except AsyncDiLoCoError as exc:
            _abort(context, exc)
        return pb.HeartbeatReply(version=version, lease_remaining_s=remaining, initialize=initialize)

    def Leave(self, request: pb.LeaveRequest, context: grpc.ServicerContext) -> pb.LeaveReply:
        self.state.leave(request.worker_id)
        return pb.LeaveReply()

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
        return self.state.status()
