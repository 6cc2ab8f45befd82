"""The server side of the optional bulk data channel: Push and Pull as raw bytes over TCP
beside gRPC (BulkRequest / BulkReply in the proto); a push goes to push/intake.py
``receive`` like a gRPC one. docs/architecture.md.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading

import grpc

from asyncdiloco.errors import (
    AsyncDiLoCoError,
    ConfigError,
    InvalidPayloadError,
    PayloadCorruptedError,
    UnauthenticatedError,
)
from asyncdiloco.ps.state import ParameterServerState
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.bulk_framing import ConnectionEnded, FrameError, code_value, drain, recv_frame, send_frame
from asyncdiloco.wire.listen import bind_every
from asyncdiloco.wire.security import token_matches

log = logging.getLogger(__name__)

#: Seconds a new connection has to complete TLS and send its first request (which
#: carries the token); later requests get the idle timeout (the worker lease).
_FIRST_REQUEST_S = 10.0
#: Largest slice of a payload per sendall / per CRC-32 update, bytes.
_SLICE_BYTES = 4 << 20


def _reader(conn: socket.socket):
    """``recv_into`` for ``PayloadAssembler.fill_with`` that raises when the peer is gone."""

    def readinto(view: memoryview) -> int:
        got = conn.recv_into(view)
        if got == 0:
            raise ConnectionEnded("connection closed mid-payload")
        return got

    return readinto


class _Close(Exception):
    """The connection must be closed after the reply that was just sent."""


class BulkServer:
    """Listens for bulk connections on ``host:port`` and serves them from ``state``.

    Args:
        state: the parameter server's state (shared with the gRPC servicer).
        host: interface to bind (the server's ``--host``): every address it resolves to.
        port: TCP port; 0 picks a free one (read ``.port`` after ``start``).
        token: the shared token every request must carry; None = no token.
        ssl_context: server-side TLS context (security.server_ssl_context); None = plaintext.
        max_connections: concurrent connections served; more are closed at once.
        idle_timeout_s: seconds a connection may wait for its next request, or stall
            mid-payload, before it is closed.
    """

    def __init__(
        self,
        state: ParameterServerState,
        *,
        host: str,
        port: int,
        token: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        max_connections: int = 64,
        idle_timeout_s: float = 60.0,
    ) -> None:
        self.state = state
        self.host = host
        self.port = port
        self._token = token
        self._ssl = ssl_context
        self._max_connections = max_connections
        self._idle_timeout_s = idle_timeout_s
        #: One listening socket per address of ``host``, each with its accept thread.
        self._listeners: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        #: Open connections: id -> (its socket, TLS-wrapped once the handshake is done; its thread).
        self._connections: dict[int, tuple[socket.socket, threading.Thread]] = {}
        self._next_id = 0
        self._stopping = False

    def start(self) -> BulkServer:
        """Bind ``port`` on every address ``host`` resolves to (wire/listen.py) and start
        accepting, one listener thread per address.

        Raises:
            ConfigError: one of the addresses cannot be bound (named in the message).
        """
        listeners = bind_every(self.host, self.port, what="the bulk data channel", flag="--bulk-port")
        try:
            for sock in listeners:
                sock.listen(128)
        except OSError as exc:
            for sock in listeners:
                sock.close()
            raise ConfigError(
                f"cannot listen for the bulk data channel on {self.host}:{self.port} ({exc.strerror}); choose "
                f"another --bulk-port (0 picks a free one)"
            ) from None
        self._listeners, self.port = listeners, listeners[0].getsockname()[1]
        self._threads = [
            threading.Thread(target=self._accept_loop, args=(sock,), name="ps-bulk-listener", daemon=True)
            for sock in listeners
        ]
        for thread in self._threads:
            thread.start()
        log.info("bulk data channel listening on %s:%d%s", self.host, self.port, " (TLS)" if self._ssl else "")
        return self

    def stop(self, grace_s: float | None = 1.0) -> None:
        """Stop accepting, end every connection at once (transfers in flight are cut off
        and apply nothing), and wait up to ``grace_s`` seconds (None: 5 s) for their
        threads, so that a push being applied finishes before the caller goes on."""
        grace_s = 5.0 if grace_s is None else grace_s
        self._stopping = True
        for listener in self._listeners:
            try:
                listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept() on Linux
            except OSError:
                pass
            listener.close()
        with self._lock:
            conns = list(self._connections.values())
        for conn, _ in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv
            except OSError:
                pass
        for _, thread in conns:
            thread.join(timeout=grace_s)
        for thread in self._threads:
            thread.join(timeout=grace_s)

    # -------------------------------------------------------------- accepting
    def _accept_loop(self, listener: socket.socket) -> None:
        while not self._stopping:
            try:
                conn, peer = listener.accept()
            except OSError:
                if not self._stopping:
                    log.exception("bulk data channel: accept failed; no more bulk connections are accepted")
                return
            with self._lock:
                if len(self._connections) >= self._max_connections:
                    log.warning(
                        "bulk connection from %s closed: %d connections are open (the limit, "
                        "ServerConfig.max_concurrent_rpcs); it will use gRPC",
                        peer,
                        len(self._connections),
                    )
                    conn.close()
                    continue
                cid, self._next_id = self._next_id, self._next_id + 1
                thread = threading.Thread(target=self._serve, args=(cid, conn, peer), name="ps-bulk", daemon=True)
                self._connections[cid] = (conn, thread)
            thread.start()

    def _serve(self, cid: int, conn: socket.socket, peer) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # Until a first request is answered (it carries the token), a connection gets only a
            # short time: idle unauthenticated sockets must not hold the slots for a whole lease.
            conn.settimeout(min(_FIRST_REQUEST_S, self._idle_timeout_s))
            if self._ssl is not None:
                try:
                    conn = self._ssl.wrap_socket(conn, server_side=True)  # handshake here, under the timeout
                except ssl.SSLError as exc:
                    log.warning("bulk connection from %s refused in the TLS handshake: %s", peer, exc)
                    return
                with self._lock:  # stop() must shut down the TLS socket (the plain one is detached)
                    self._connections[cid] = (conn, self._connections[cid][1])
            while True:
                try:
                    request = recv_frame(conn, pb.BulkRequest, eof_ok=True)
                except FrameError as exc:
                    self._reply(
                        conn,
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"{exc}; send length-prefixed BulkRequest frames as parameter_server.proto describes",
                        reason=InvalidPayloadError.reason,
                    )
                    return
                if request is None:
                    return
                self._handle(conn, request)  # a wrong token raises _Close
                conn.settimeout(self._idle_timeout_s)
        except _Close:
            pass
        except (ConnectionEnded, OSError) as exc:  # ssl.SSLError and timeouts are OSErrors
            log.debug("bulk connection from %s ended: %s", peer, exc)
        except Exception:  # a bug: never let it pass silently, never take the server down
            log.exception("bulk connection from %s failed", peer)
        finally:
            with self._lock:
                self._connections.pop(cid, None)
            conn.close()

    # -------------------------------------------------------------- requests
    def _reply(self, conn: socket.socket, code: grpc.StatusCode, message: str = "", **body) -> None:
        send_frame(conn, pb.BulkReply(code=code_value(code), message=message, **body))

    def _handle(self, conn: socket.socket, request: pb.BulkRequest) -> None:
        if self._token is not None and not token_matches(request.token, self._token):
            log.warning("refused a bulk request: missing or wrong token")
            self._reply(
                conn,
                grpc.StatusCode.UNAUTHENTICATED,
                "bulk channel: missing or wrong token (BulkRequest.token); start the client with the "
                "server's --token-file",
                reason=UnauthenticatedError.reason,
            )
            raise _Close
        kind = request.WhichOneof("body")
        if kind == "push":
            self._push(conn, request.push)
        elif kind == "pull":
            self._pull(conn, request.pull)
        else:
            self._reply(
                conn,
                grpc.StatusCode.INVALID_ARGUMENT,
                "a BulkRequest must carry a push or a pull",
                reason=InvalidPayloadError.reason,
            )
            raise _Close

    def _push(self, conn: socket.socket, header: pb.PushHeader) -> None:
        """A push through push/intake.py ``receive``, its payload read straight into the
        receive buffer; then its refusal (``PushIntake.refused``) or its reply."""
        total, reading = header.total_bytes, False

        def fill(assembler) -> None:
            nonlocal reading
            reading = True  # from here on the payload is being consumed
            assembler.fill_with(_reader(conn), _SLICE_BYTES)

        try:
            outcome = self.state.intake.receive(header, fill, drain=lambda: drain(conn, total))
        except OSError:
            if reading:  # (a retry's payload cut off while drained counts as nothing)
                log.warning(
                    "bulk push from worker %d cut off mid-payload (disconnected, or stalled for over "
                    "%.0f s); nothing was applied",
                    header.worker_id,
                    self._idle_timeout_s,
                )
                self.state.intake.count_rejected(header.worker_id, "cut_off")
            raise
        except AsyncDiLoCoError as exc:
            header_corrupted = not reading and isinstance(exc, PayloadCorruptedError)
            self.state.intake.refused(0 if header_corrupted else header.worker_id, exc)  # a corrupted id is untrusted
            if isinstance(exc, PayloadCorruptedError) and header_corrupted:  # total_bytes as untrusted: no drain
                self._refuse_corrupted_header(conn, exc)
            if not reading:  # refused from its header: the payload is still on the wire
                if not 0 <= total <= self.state.config.max_payload_bytes:  # too much to drain
                    self._reply(conn, exc.grpc_code, str(exc), reason=exc.reason)
                    raise _Close from None
                drain(conn, total)
            self._reply(conn, exc.grpc_code, str(exc), reason=exc.reason)
            return
        reply = self.state.intake.reply(outcome, header.worker_id, hold=not header.last)  # a last push is not held
        self._reply(conn, grpc.StatusCode.OK, push=reply)

    def _refuse_corrupted_header(self, conn: socket.socket, exc: PayloadCorruptedError) -> None:
        """Answer a push whose header arrived corrupted, then end the connection: its
        total_bytes cannot be trusted, so the payload after it cannot be drained in step.
        The reply is followed by the end of the stream (the client's next request on this
        connection meets it and is made again on a fresh one, bulk_client.py); what the
        client still sends is read and discarded until it closes (closing with bytes
        unread would reset the connection and could lose the reply first)."""
        self._reply(conn, exc.grpc_code, str(exc), reason=exc.reason)
        scratch = memoryview(bytearray(1 << 16))
        try:
            conn.shutdown(socket.SHUT_WR)
            while conn.recv_into(scratch):  # under the idle timeout, until the client closes
                pass
        except OSError:
            pass
        raise _Close

    def _pull(self, conn: socket.socket, request: pb.PullRequest) -> None:
        try:
            source = self.state.open_pull(request)
        except AsyncDiLoCoError as exc:
            self._reply(conn, exc.grpc_code, str(exc), reason=exc.reason)
            return
        try:
            self._reply(conn, grpc.StatusCode.OK, pull=source.header)
            # an encoded snapshot's own bytes, or θ's copied out chunk by chunk
            for view in source.data_views(self.state.config.chunk_bytes):
                for start in range(0, len(view), _SLICE_BYTES):  # the idle timeout applies per slice
                    conn.sendall(view[start : start + _SLICE_BYTES])
            self.state.record_pull(request.worker_id, source.header.total_bytes)
        finally:
            self.state.snapshots.close_pull(source)
