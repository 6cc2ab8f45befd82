"""The client side of the optional bulk data channel: one persistent TCP (or TLS) connection
that carries Push and Pull payloads as raw bytes beside gRPC (docs/worker.md, "The bulk
channel's client"; docs/protocol.md, "The bulk data channel").
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable

import grpc
import torch

from asyncdiloco.errors import AsyncDiLoCoError, InvalidPayloadError, from_rpc_error
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.bulk_framing import BulkStatus, ConnectionEnded, recv_frame, send_frame
from asyncdiloco.wire.header_crc import check_header
from asyncdiloco.wire.tensors import PayloadAssembler

log = logging.getLogger(__name__)

#: Bytes per sendall / per CRC-32 update of a payload.
_SLICE_BYTES = 4 << 20
#: Backoff before reconnecting after a failure, seconds (doubles up to the maximum).
_MIN_BACKOFF_S, _MAX_BACKOFF_S = 1.0, 60.0
#: A pull's payload size in bytes, or a function of its header giving it.
PayloadSize = int | Callable[[pb.PullHeader], int]
#: Codes after which the server closes the connection (ps/transport/bulk.py).
_CLOSING_CODES = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED)


class _Deadline:
    """Seconds left of one call; sets them as the socket timeout before each operation."""

    def __init__(self, timeout_s: float) -> None:
        self.end = time.monotonic() + timeout_s

    def left(self) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise TimeoutError("the bulk call's deadline passed")
        return left

    def arm(self, sock: socket.socket) -> socket.socket:
        sock.settimeout(self.left())
        return sock


class BulkChannel:
    """A persistent bulk connection to ``host:port``.

    Args:
        host: the server's host (that of its gRPC address).
        port: ``RunConfig.bulk_port``.
        token: the shared token (None: send none).
        ssl_context: client TLS context (security.client_ssl_context); None = plaintext.
        server_hostname: name to verify the server's certificate against (TLS only).
        connect_timeout_s: longest wait for a connection (and TLS handshake), seconds.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        token: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
        connect_timeout_s: float = 10.0,
    ) -> None:
        self.host, self.port = host, port
        self._token = token or ""
        self._ssl = ssl_context
        self._server_hostname = server_hostname or host
        self._connect_timeout_s = connect_timeout_s
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._retry_at = 0.0
        self._backoff_s = _MIN_BACKOFF_S
        self._down = False
        #: Calls this channel handed back to gRPC (unusable connection, backoff, or busy).
        self.fallbacks = 0

    # -------------------------------------------------------------- calls
    def push(self, header: pb.PushHeader, payload: torch.Tensor, timeout_s: float) -> pb.PushReply | None:
        """Send one push (``header`` as gRPC would, ``payload`` 1-D contiguous uint8 CPU)
        within ``timeout_s`` seconds; the reply, or None when the channel could not be used.
        A refusal raises the library's exception."""
        view = payload.numpy().data
        return self._run(lambda sock, deadline: self._push(sock, deadline, header, view), timeout_s)

    def pull(
        self,
        request: pb.PullRequest,
        total: PayloadSize,
        buffer: torch.Tensor | None,
        chunk_bytes: int,
        timeout_s: float,
    ) -> tuple[pb.PullHeader, torch.Tensor] | None:
        """Receive the payload of a pull into ``buffer`` (or a new uint8 tensor).

        Args:
            request: the PullRequest, as for the gRPC Pull.
            total: expected payload size, bytes, or a function of the header giving it
                (the size depends on the run's wire codec).
            buffer: optional 1-D uint8 tensor of ``total`` bytes to fill (ignored when
                the header says another size).
            chunk_bytes: the chunk size to check PullHeader.num_chunks against when the
                header's run config carries none.
            timeout_s: deadline of the whole call, seconds.
        Returns:
            (header, payload), or None when the channel could not be used (use gRPC).
        Raises:
            NotInitializedError, InvalidPayloadError (size or CRC-32 differ), ... as gRPC.
        """
        return self._run(
            lambda sock, deadline: self._pull(sock, deadline, request, total, buffer, chunk_bytes), timeout_s
        )

    def close(self) -> None:
        with self._lock:
            self._drop()

    def suspect(self, exc: BaseException) -> None:
        """Stop using the channel as when it is down (gRPC until the backoff passes; the
        connection is closed): every resend of a transfer over it arrived corrupted (``exc``)."""
        with self._lock:
            self._drop()
            self._mark_down(exc)

    # ----------------------------------------------------------- plumbing
    def _run(self, call, timeout_s: float):
        result = self._run_once(call, timeout_s)
        if result is None:
            self.fallbacks += 1
        return result

    def _run_once(self, call, timeout_s: float):
        if not self._lock.acquire(blocking=False):  # another thread is using the connection
            return None
        try:
            if time.monotonic() < self._retry_at:
                return None
            deadline = _Deadline(timeout_s)
            for attempt in (0, 1):
                reused = self._sock is not None
                try:
                    if self._sock is None:
                        self._sock = self._connect(deadline)
                    result = call(self._sock, deadline)
                except AsyncDiLoCoError:
                    raise
                except (OSError, ConnectionEnded) as exc:  # ssl.SSLError and timeouts are OSErrors
                    self._drop()
                    if reused and attempt == 0 and not isinstance(exc, TimeoutError):
                        log.debug("bulk connection to %s:%d was closed (%s); reconnecting", self.host, self.port, exc)
                        continue
                    self._mark_down(exc)
                    return None
                self._backoff_s, self._down = _MIN_BACKOFF_S, False
                return result
            return None  # pragma: no cover - the loop always returns
        finally:
            self._lock.release()

    def _connect(self, deadline: _Deadline) -> socket.socket:
        sock = socket.create_connection((self.host, self.port), timeout=min(deadline.left(), self._connect_timeout_s))
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._ssl is not None:
                sock = self._ssl.wrap_socket(sock, server_hostname=self._server_hostname)
        except BaseException:
            sock.close()
            raise
        return sock

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _mark_down(self, exc: BaseException) -> None:
        self._retry_at = time.monotonic() + self._backoff_s
        (log.debug if self._down else log.warning)(
            "bulk data channel %s:%d unusable (%s: %s); pushing and pulling over gRPC, trying it again in %.0f s",
            self.host,
            self.port,
            type(exc).__name__,
            exc,
            self._backoff_s,
        )
        self._down = True
        self._backoff_s = min(2 * self._backoff_s, _MAX_BACKOFF_S)

    def _reply(self, sock: socket.socket, deadline: _Deadline, body: str):
        """The next BulkReply; its status as the library exception when not OK."""
        reply = recv_frame(deadline.arm(sock), pb.BulkReply)
        if reply.code != 0:
            status = BulkStatus(reply.code, reply.message, reply.reason)
            if status.code() in _CLOSING_CODES:
                self._drop()
            raise from_rpc_error(status)
        if reply.WhichOneof("body") != body:
            raise ConnectionEnded(f"the server answered a {body} with a BulkReply carrying {reply.WhichOneof('body')}")
        return reply

    def _push(self, sock: socket.socket, deadline: _Deadline, header: pb.PushHeader, view: memoryview) -> pb.PushReply:
        send_frame(deadline.arm(sock), pb.BulkRequest(token=self._token, push=header))
        for start in range(0, len(view), _SLICE_BYTES):
            deadline.arm(sock).sendall(view[start : start + _SLICE_BYTES])
        return self._reply(sock, deadline, "push").push

    def _pull(
        self,
        sock: socket.socket,
        deadline: _Deadline,
        request: pb.PullRequest,
        size: PayloadSize,
        buffer: torch.Tensor | None,
        chunk_bytes: int,
    ) -> tuple[pb.PullHeader, torch.Tensor]:
        send_frame(deadline.arm(sock), pb.BulkRequest(token=self._token, pull=request))
        header = self._reply(sock, deadline, "pull").pull
        try:  # from here on the payload is in flight: a refusal here closes the connection
            check_header(header, f"the pull of version {header.version} (as received)")
            total, buffer = expected_payload(size, header, buffer)
            assembler = PayloadAssembler(
                total_bytes=total,
                num_chunks=header.num_chunks,
                crc32=header.crc32,
                chunk_bytes=header.run_config.chunk_bytes or chunk_bytes,
                buffer=buffer,
            )
        except AsyncDiLoCoError:
            self._drop()
            raise

        def readinto(view: memoryview) -> int:
            got = deadline.arm(sock).recv_into(view)
            if got == 0:
                raise ConnectionEnded("the server closed the connection mid-payload")
            return got

        assembler.fill_with(readinto, _SLICE_BYTES)
        return header, assembler.finish()  # InvalidPayloadError on a CRC-32 mismatch; the stream is in step


def expected_payload(
    size: PayloadSize, header: pb.PullHeader, buffer: torch.Tensor | None
) -> tuple[int, torch.Tensor | None]:
    """The size a pull's payload must have, and the buffer to receive it in.

    Args:
        size: bytes, or a function of the header giving them (the size depends on the
            run's wire codec, which the header's run config names).
        header: the pull's header, as the server sent it.
        buffer: the caller's receive buffer; dropped (None: allocate) when the header's
            codec gives another size than the one it was sized for.
    Raises:
        InvalidPayloadError: the header announces another size.
    """
    total = size(header) if callable(size) else size
    if callable(size) and buffer is not None and buffer.numel() != total:
        buffer = None  # the server's codec is not the one the buffer was sized for
    if header.total_bytes != total:
        raise InvalidPayloadError(
            f"the server sends {header.total_bytes} bytes but this model's payload is {total} bytes "
            f"(wire codec {header.run_config.wire_codec or 'raw'!r})"
        )
    return total, buffer
