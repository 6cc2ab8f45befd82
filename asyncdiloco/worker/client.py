"""Typed gRPC client of the parameter server: deadlines, the push transports (picked in
``_send_push``), resends, errors mapped to errors.py's exceptions. docs/protocol.md.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging

import grpc
import torch

from asyncdiloco.errors import (
    AsyncDiLoCoError,
    InvalidPayloadError,
    PayloadCorruptedError,
    PayloadTooLargeError,
    from_rpc_error,
)
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire._proto import parameter_server_pb2_grpc as pb_grpc
from asyncdiloco.wire.channel import grpc_channel_options
from asyncdiloco.wire.codec import wire_bytes_for
from asyncdiloco.wire.grpc_chunks import (
    chunk_messages,
    is_chunk,
    pull_callable,
    push_callable,
    push_one_callable,
    push_request_bytes,
)
from asyncdiloco.wire.header_crc import check_header, seal
from asyncdiloco.wire.roles import ROLE_KEY, ROLE_REGION
from asyncdiloco.wire.security import (
    ClientSecurityConfig,
    auth_metadata,
    channel_credentials,
    check_client_transport,
    client_ssl_context,
    client_token,
)
from asyncdiloco.wire.tensors import DEFAULT_CHUNK_BYTES, Manifest, PayloadAssembler, crc32_of, num_chunks_for
from asyncdiloco.worker import long_poll
from asyncdiloco.worker.bulk_client import BulkChannel, PayloadSize, expected_payload
from asyncdiloco.worker.resend import CorruptedResends, over_bulk

log = logging.getLogger(__name__)

_MIB = 1024 * 1024

#: Times a push or pull whose payload arrived corrupted is sent again before
#: ``PayloadCorruptedError`` is raised.
CORRUPTED_RESENDS = 3
#: Seconds before the first resend of a corrupted payload; doubles with every resend.
RESEND_BACKOFF_S = 0.05


@dataclasses.dataclass(frozen=True)
class Pulled:
    """Result of a pull: the global parameters at ``version`` as a uint8 payload, encoded
    with the wire codec of ``run_config`` (decode with ``codec.codec_for(run_config,
    manifest)``; sync-state pulls are raw fp32)."""

    version: int
    payload: torch.Tensor
    run_config: pb.RunConfig


def _open_channel(address: str, security: ClientSecurityConfig | None) -> grpc.Channel:
    """The gRPC channel to ``address`` (TLS when ``security`` asks), sized for the largest
    chunk allowed; reconnect backoff capped at 2 s, so a restarted server is found fast."""
    options: list[tuple[str, int | str]] = [
        *grpc_channel_options(64 * _MIB),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2000),
    ]
    creds = channel_credentials(security)
    if creds is None:
        return grpc.insecure_channel(address, options=options)
    if security is not None and security.tls_server_name:
        options.append(("grpc.ssl_target_name_override", security.tls_server_name))
    return grpc.secure_channel(address, creds, options=options)


class ParameterServerClient:
    """One channel to the parameter server at ``address`` ("HOST:PORT").

    Args:
        address: "HOST:PORT".
        rpc_timeout_s: deadline for small calls, seconds.
        timeout_s_per_mib: extra deadline per MiB of payload for Push/Pull, seconds.
        chunk_bytes: chunk size for pushes (the server's ``RunConfig.chunk_bytes``).
        security: token and TLS settings; None = plaintext, no token.
        bulk_channel: use the server's bulk data channel for push/pull when it offers one.
        corrupted_resends: times a corrupted push or pull is sent again (resend.py).
        resend_backoff_s: seconds before the first such resend; doubles with each.
        one_message_pushes: send a push that fits one chunk as one PushOne message.
    Raises:
        ConfigError: a token or PEM file cannot be read, or a token would go in clear
            beyond the loopback (security.py ``check_client_transport``).
    """

    def __init__(
        self,
        address: str,
        *,
        rpc_timeout_s: float = 10.0,
        timeout_s_per_mib: float = 1.0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        security: ClientSecurityConfig | None = None,
        bulk_channel: bool = True,
        corrupted_resends: int = CORRUPTED_RESENDS,
        resend_backoff_s: float = RESEND_BACKOFF_S,
        one_message_pushes: bool = True,
    ) -> None:
        check_client_transport(address, security)  # before any connection: no token in clear beyond the loopback
        self.address = address
        self.corrupted_resends = corrupted_resends
        self.resend_backoff_s = resend_backoff_s
        #: Pushes and pulls whose payload arrived corrupted (each was sent again, or raised).
        self.corrupted_transfers = 0
        #: The trailing metadata of the newest push answered over gRPC (key, value) pairs.
        self.last_push_trailer: tuple = ()
        self.rpc_timeout_s = rpc_timeout_s
        self.timeout_s_per_mib = timeout_s_per_mib
        self.chunk_bytes = chunk_bytes
        #: The newest ``group_max_wait_s`` the server announced (any reply), seconds.
        self.group_wait_s = 0.0
        #: Worker id → ``group_max_wait_s`` of its newest JoinReply or PushReply (registry.py ``told_wait_s``).
        self._push_wait_s: dict[int, float] = {}
        self._token = client_token(security)
        self._metadata = auth_metadata(self._token)
        self._security = security
        self._bulk_allowed = bulk_channel
        #: JoinReply.session_id per worker id joined through this client, sent with its calls.
        self._sessions: dict[int, int] = {}
        self._bulk: BulkChannel | None = None
        self._channel = _open_channel(address, security)
        self._stub = pb_grpc.ParameterServerStub(self._channel)
        # Push and Pull (de)serialise their chunks by hand, one copy each (wire/grpc_chunks.py).
        self._push = push_callable(self._channel)
        #: PushOne, for a push that fits one chunk; None: every push is a stream.
        self._push_one: grpc.UnaryUnaryMultiCallable | None = (
            push_one_callable(self._channel) if one_message_pushes else None
        )
        self._pull_stream = pull_callable(self._channel)

    def close(self) -> None:
        self._use_bulk_port(0)
        self._channel.close()

    def _use_bulk_port(self, port: int) -> None:
        """Talk to the bulk data channel on ``port`` from now on (0: none)."""
        if self._bulk is not None and (port <= 0 or port != self._bulk.port):
            self._bulk.close()
            self._bulk = None
        if port > 0 and self._bulk is None and self._bulk_allowed:
            host = self.address.rpartition(":")[0].strip("[]")
            name = self._security.tls_server_name if self._security is not None else None
            self._bulk = BulkChannel(
                host,
                port,
                token=self._token,
                ssl_context=client_ssl_context(self._security),
                server_hostname=name,
                connect_timeout_s=self.rpc_timeout_s,
            )

    @property
    def bulk_port(self) -> int:
        """The bulk data channel this client uses for push/pull (0: gRPC only)."""
        return self._bulk.port if self._bulk is not None else 0

    def __enter__(self) -> ParameterServerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _payload_timeout(self, num_bytes: int) -> float:
        """Deadline of a push or pull of ``num_bytes`` payload bytes, without any hold, seconds."""
        return self.rpc_timeout_s + self.timeout_s_per_mib * num_bytes / _MIB

    def _push_timeout(self, num_bytes: int, worker_id: int) -> float:
        """Deadline of a push of ``num_bytes`` by ``worker_id``, seconds: the payload's plus
        the longest hold the server announced."""
        held_s = max(self._push_wait_s.get(worker_id, 0.0), self.group_wait_s)
        return self._payload_timeout(num_bytes) + held_s

    def _told(self, wait_s: float, worker_id: int = 0) -> None:
        """A reply announced ``group_max_wait_s``; ``worker_id``: that worker's Join or Push reply."""
        self.group_wait_s = wait_s or self.group_wait_s  # 0: grouping off
        if worker_id:
            self._push_wait_s[worker_id] = wait_s

    def _metadata_with(self, extra: tuple) -> tuple:
        """This client's call metadata (the token), with ``extra`` after it."""
        return (*self._metadata, *extra) if extra else self._metadata

    def _call(self, method, request, timeout_s: float | None = None, extra_metadata: tuple = ()):
        """Invoke an RPC with a deadline; a failure becomes the library's exception."""
        try:
            return method(
                request,
                timeout=self.rpc_timeout_s if timeout_s is None else timeout_s,
                metadata=self._metadata_with(extra_metadata),
            )
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    # ---------------------------------------------------------------- calls
    def join(
        self, manifest: Manifest, worker_name: str = "", steps_per_s: float = 0.0, ranks: int = 1, region: bool = False
    ) -> pb.JoinReply:
        """Register (``ranks``: a torchrun group's world size; ``region``: a regional server
        joins its parent, wire/roles.py); raises ManifestMismatchError, ServerUnavailableError."""
        request = pb.JoinRequest(
            manifest=manifest.to_proto(), worker_name=worker_name, steps_per_s=steps_per_s, ranks=ranks
        )
        role = ((ROLE_KEY, ROLE_REGION),) if region else ()
        reply, _call = self._call(self._stub.Join.with_call, request, extra_metadata=role)
        self._sessions[reply.worker_id] = reply.session_id
        self.chunk_bytes = reply.run_config.chunk_bytes or self.chunk_bytes
        self._told(reply.run_config.group_max_wait_s, reply.worker_id)
        self._use_bulk_port(reply.run_config.bulk_port)
        return reply

    def pull_sync_state(self, manifest: Manifest, worker_id: int, with_momentum: bool) -> Pulled:
        """Sync mode: stream the server's fp32 master state for healing.

        Returns:
            ``Pulled`` whose ``version`` is the committed round and whose payload is θ
            as float32 bytes, then (``with_momentum``) m as float32 bytes: uint8
            (k · numel · 4,), k = 2 with momentum, else 1.
        Raises:
            ModeMismatchError (async server), NotInitializedError, InvalidPayloadError,
            ServerUnavailableError.
        """
        total = manifest.numel * 4 * (2 if with_momentum else 1)
        request = pb.PullRequest(worker_id=worker_id, sync_state=True)
        return self._pull_with_resends(request, total, None, total, f"the sync-state pull of worker {worker_id}")

    def pull(self, manifest: Manifest, worker_id: int = 0, buffer: torch.Tensor | None = None) -> Pulled:
        """Stream the newest global parameters, encoded with the server's wire codec, into
        ``buffer`` (or a new uint8 tensor). Raises NotInitializedError, InvalidPayloadError,
        ServerUnavailableError."""

        def size(header: pb.PullHeader) -> int:
            return wire_bytes_for(header.run_config, manifest)

        deadline_bytes = max(manifest.total_bytes, 4 * manifest.numel)  # ≥ any codec's size, about
        request = pb.PullRequest(worker_id=worker_id)
        return self._pull_with_resends(request, size, buffer, deadline_bytes, f"the pull of worker {worker_id}")

    def _pull_with_resends(
        self, request: pb.PullRequest, size: PayloadSize, buffer: torch.Tensor | None, deadline_bytes: int, what: str
    ) -> Pulled:
        """``_pull``, made again while it arrives corrupted (resend.py)."""
        tries = self._tries(what)
        while True:
            try:
                return self._pull(request, size, buffer, deadline_bytes, tries.bulk)
            except PayloadCorruptedError as exc:
                tries.failed(exc)

    def _pull(
        self,
        request: pb.PullRequest,
        size: PayloadSize,
        buffer: torch.Tensor | None,
        deadline_bytes: int,
        bulk: bool = True,
    ) -> Pulled:
        """One pull over the bulk channel if ``bulk`` and it can, else gRPC; ``size``: bytes,
        or a function of the header; ``deadline_bytes``: the size the deadline allows for."""
        timeout_s = self._payload_timeout(deadline_bytes)
        got = None
        if bulk and self._bulk is not None:
            with over_bulk():
                got = self._bulk.pull(request, size, buffer, self.chunk_bytes, timeout_s)
        if got is not None:
            self._told(got[0].run_config.group_max_wait_s)
            pulled = Pulled(got[0].version, got[1], got[0].run_config)
        else:
            try:
                pulled = self._pull_over_grpc(request, size, buffer, timeout_s)
            except grpc.RpcError as err:
                raise from_rpc_error(err) from None
        self.chunk_bytes = pulled.run_config.chunk_bytes or self.chunk_bytes  # a restarted server's
        return pulled

    def _pull_over_grpc(
        self, request: pb.PullRequest, size: PayloadSize, buffer: torch.Tensor | None, timeout_s: float
    ) -> Pulled:
        stream = self._pull_stream(request, timeout=timeout_s, metadata=self._metadata)
        first = next(stream, None)
        if first is None or is_chunk(first) or first.WhichOneof("body") != "header":
            raise InvalidPayloadError("the server's pull stream did not start with a PullHeader")
        header = first.header
        try:
            check_header(header, f"the pull of version {header.version} (as received)")
        except PayloadCorruptedError:
            stream.cancel()  # the payload that follows is not read
            raise
        total, buffer = expected_payload(size, header, buffer)
        self._told(header.run_config.group_max_wait_s)
        assembler = PayloadAssembler(
            total_bytes=total,
            num_chunks=header.num_chunks,
            crc32=header.crc32,
            chunk_bytes=header.run_config.chunk_bytes or self.chunk_bytes,
            buffer=buffer,
        )
        for msg in stream:
            if not is_chunk(msg):
                if msg.WhichOneof("body") != "chunk":
                    raise InvalidPayloadError("a second PullHeader arrived inside the pull stream")
                msg = msg.chunk
            assembler.add(msg)
        return Pulled(header.version, assembler.finish(), header.run_config)

    def push(
        self,
        payload: torch.Tensor,
        *,
        worker_id: int,
        push_id: int,
        base_version: int,
        num_local_steps: int = 0,
        num_tokens: int = 0,
        compute_s: float = 0.0,
        kind: pb.PushKind = pb.PUSH_KIND_PSEUDO_GRADIENT,
        quorum_id: int = 0,
        last: bool = False,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> pb.PushReply:
        """Send one payload (``_send_push`` picks the transport), again while it arrives corrupted.

        Args:
            payload: 1-D uint8 CPU tensor in the manifest's layout.
            metadata: extra gRPC metadata (a sharded server's order; reply's in ``last_push_trailer``).
        Raises:
            StalePushError, InvalidPayloadError, UnknownWorkerError, PayloadTooLargeError, WorkerSupersededError,
            ServerUnavailableError (outcome unknown: retry with the same push_id).
        """
        header = pb.PushHeader(
            worker_id=worker_id,
            push_id=push_id,
            base_version=base_version,
            num_local_steps=num_local_steps,
            num_tokens=num_tokens,
            total_bytes=payload.numel(),
            crc32=crc32_of(payload),
            kind=kind,
            compute_s=compute_s,
            quorum_id=quorum_id,
            last=last,
            session_id=self._sessions.get(worker_id, 0),
        )
        tries = self._tries(f"push {push_id} of worker {worker_id}")
        rechunked = False
        while True:
            try:
                return self._send_push(payload, header, metadata, tries.bulk)
            except PayloadCorruptedError as exc:  # the chunking was right (the payload arrived whole)
                tries.failed(exc)
            except (InvalidPayloadError, PayloadTooLargeError):
                if rechunked or not self._adopt_server_chunking():
                    raise
                rechunked = True  # the refusal applied nothing: the same push id, cut anew
                log.info("the server's chunks are %d bytes now; resending push %d", self.chunk_bytes, push_id)

    def _send_push(
        self, payload: torch.Tensor, header: pb.PushHeader, metadata: tuple = (), bulk: bool = True
    ) -> pb.PushReply:
        """One try of ``push``, cut in chunks of the current ``chunk_bytes``: over the bulk
        channel when ``bulk`` and it can carry it, else one PushOne message when the payload
        fits one chunk, else a Push stream."""
        total = payload.numel()
        header.num_chunks = num_chunks_for(total, self.chunk_bytes)
        seal(header)  # header_crc32 over the final fields (wire/header_crc.py)
        timeout_s = self._push_timeout(total, header.worker_id)
        reply = None
        if bulk and self._bulk is not None and payload.is_contiguous() and not metadata:
            with over_bulk():
                reply = self._bulk.push(header, payload, timeout_s)
        if reply is None:
            metadata = self._metadata_with(metadata)
            try:
                if header.num_chunks <= 1 and self._push_one is not None:
                    request = push_request_bytes(header, payload)
                    reply, call = self._push_one.with_call(request, timeout=timeout_s, metadata=metadata)
                else:
                    messages = itertools.chain(
                        (pb.PushMessage(header=header),), chunk_messages(payload, self.chunk_bytes)
                    )
                    reply, call = self._push.with_call(messages, timeout=timeout_s, metadata=metadata)
            except grpc.RpcError as err:
                raise from_rpc_error(err) from None
            self.last_push_trailer = tuple(call.trailing_metadata() or ())
        self._told(reply.group_max_wait_s, header.worker_id)
        return reply

    def _tries(self, what: str) -> CorruptedResends:
        """The tries of one push or pull while it arrives corrupted (resend.py)."""

        def count() -> None:
            self.corrupted_transfers += 1

        return CorruptedResends(
            what,
            channel=lambda: self._bulk,
            resends=self.corrupted_resends,
            backoff_s=self.resend_backoff_s,
            address=self.address,
            on_corrupted=count,
        )

    def _adopt_server_chunking(self) -> bool:
        """After a refused push: adopt the server's chunk size (Status) if it changed; True if so."""
        try:
            chunk_bytes = self.status().run_config.chunk_bytes
        except AsyncDiLoCoError:
            return False
        if not chunk_bytes or chunk_bytes == self.chunk_bytes:
            return False
        self.chunk_bytes = chunk_bytes
        return True

    def heartbeat(self, worker_id: int, steps_per_s: float = 0.0) -> pb.HeartbeatReply:
        """Renew the lease; ``steps_per_s`` > 0 reports the measured inner-step rate (DyLU)."""
        request = pb.HeartbeatRequest(
            worker_id=worker_id, steps_per_s=steps_per_s, session_id=self._sessions.get(worker_id, 0)
        )
        reply = self._call(self._stub.Heartbeat, request)
        self._told(reply.group_max_wait_s)
        return reply

    def leave(self, worker_id: int) -> None:
        self._call(self._stub.Leave, pb.LeaveRequest(worker_id=worker_id, session_id=self._sessions.get(worker_id, 0)))

    def quorum(self, *, worker_id: int, round: int, manifest_hash: str, timeout_s: float) -> pb.QuorumReply:
        """Sync mode: ask to join the next round, a long poll of up to ``timeout_s`` seconds
        (``formed`` False when none formed)."""

        def ask(left_s: float) -> pb.QuorumReply:
            request = pb.QuorumRequest(
                worker_id=worker_id, round=round, manifest_hash=manifest_hash, timeout_s=left_s, poll=True
            )
            return self._call(self._stub.Quorum, request, left_s + self.rpc_timeout_s)

        return long_poll.poll(ask, lambda reply: reply.pending, timeout_s)

    def commit(
        self,
        *,
        worker_id: int,
        quorum_id: int,
        success: bool,
        total_weight: float = 0.0,
        num_tokens: int = 0,
        num_local_steps: int = 0,
        reason: str = "",
        timeout_s: float = 10.0,
        compute_s: float = 0.0,
    ) -> pb.CommitReply:
        """Sync mode: vote on a round, a long poll of up to ``timeout_s`` seconds for the
        decision (``decided`` False when not there yet); ``compute_s``: seconds of own compute."""

        def ask(left_s: float) -> pb.CommitReply:
            request = pb.CommitRequest(
                worker_id=worker_id,
                quorum_id=quorum_id,
                success=success,
                total_weight=total_weight,
                num_tokens=num_tokens,
                num_local_steps=num_local_steps,
                reason=reason[:1000],
                timeout_s=left_s,
                poll=True,
                compute_s=compute_s,
            )
            return self._call(self._stub.Commit, request, left_s + self.rpc_timeout_s)

        return long_poll.poll(ask, lambda reply: not reply.decided, timeout_s)

    def store(self, request: pb.StoreRequest, timeout_s: float | None = None) -> pb.StoreReply:
        """Sync mode: one rendezvous-store operation (worker/rendezvous.py). Raises
        RoundRefusedError (not a member, or the round ended), ServerUnavailableError, ..."""
        return self._call(self._stub.Store, request, timeout_s)

    def status(self) -> pb.StatusReply:
        return self._call(self._stub.Status, pb.StatusRequest())

    def report_eval(self, version: int, loss: float, num_tokens: int, evaluator: str = "") -> None:
        """Report the held-out ``loss`` (nats per token, over ``num_tokens``) of the global
        model at ``version``. Raises InvalidPayloadError, ServerUnavailableError."""
        report = pb.EvalReport(version=version, loss=loss, num_tokens=num_tokens, evaluator=evaluator)
        self._call(self._stub.ReportEval, report)
