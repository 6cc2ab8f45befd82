"""Framing of the bulk data channel, shared by its server (ps/transport/bulk.py) and client (bulk_client.py).

The channel itself is described in ``proto/asyncdiloco/v1/parameter_server.proto``
(BulkRequest / BulkReply): a frame is a 4-byte little-endian length followed by one
serialized message; raw payload bytes follow a push request or a pull reply.
"""

from __future__ import annotations

import socket
import struct

import grpc

from asyncdiloco.errors import REASON_METADATA_KEY

#: Largest frame (one serialized BulkRequest or BulkReply), bytes; headers are far smaller.
MAX_FRAME_BYTES = 1 << 20

_LENGTH = struct.Struct("<I")
_CODE_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


class ConnectionEnded(ConnectionError):
    """The peer closed the connection."""


class FrameError(ConnectionEnded):
    """A frame's length is out of range or its bytes do not parse: the stream is out of
    step and the connection must be closed."""


def code_value(code: grpc.StatusCode) -> int:
    """The integer of a status code, as BulkReply.code carries it (OK = 0)."""
    return code.value[0]


def status_code(value: int) -> grpc.StatusCode:
    """BulkReply.code back to a ``grpc.StatusCode`` (UNKNOWN for a value gRPC lacks)."""
    return _CODE_BY_VALUE.get(value, grpc.StatusCode.UNKNOWN)


class BulkStatus(Exception):
    """A BulkReply's non-OK status, shaped like ``grpc.RpcError`` (``code()``,
    ``details()``, ``trailing_metadata()`` with the reason code) so
    ``errors.from_rpc_error`` maps it to the same library exception."""

    def __init__(self, value: int, message: str, reason: str = "") -> None:
        super().__init__(message)
        self._code, self._message, self._reason = status_code(value), message, reason

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._message

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((REASON_METADATA_KEY, self._reason),) if self._reason else ()


def send_frame(sock: socket.socket, message) -> None:
    """Send one length-prefixed serialized protobuf message."""
    data = message.SerializeToString()
    sock.sendall(_LENGTH.pack(len(data)) + data)


def recv_exactly(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``.

    Raises:
        ConnectionEnded: the peer closed the connection first. OSError (timeouts too).
    """
    pos, n = 0, len(view)
    while pos < n:
        got = sock.recv_into(view[pos:], n - pos)
        if got == 0:
            raise ConnectionEnded(f"connection closed after {pos} of {n} bytes")
        pos += got


def recv_frame(sock: socket.socket, message_type, *, eof_ok: bool = False):
    """Receive one frame and parse it as ``message_type``.

    Args:
        eof_ok: return None when the peer closed the connection cleanly before the
            frame began (a client that is done), instead of raising.
    Raises:
        ConnectionEnded: the connection closed mid-frame.
        FrameError: the length is outside [1, MAX_FRAME_BYTES] or the bytes do not parse.
        OSError (timeouts too).
    """
    head = bytearray(_LENGTH.size)
    got = sock.recv_into(head)
    if got == 0 and eof_ok:
        return None
    if got == 0:
        raise ConnectionEnded("connection closed before a frame")
    recv_exactly(sock, memoryview(head)[got:])
    (length,) = _LENGTH.unpack(head)
    if not 1 <= length <= MAX_FRAME_BYTES:
        raise FrameError(f"frame length {length} is outside [1, {MAX_FRAME_BYTES}]: the stream is out of step")
    body = bytearray(length)
    recv_exactly(sock, memoryview(body))
    try:
        return message_type.FromString(bytes(body))
    except Exception as exc:  # google.protobuf.message.DecodeError
        raise FrameError(f"a {message_type.__name__} frame of {length} bytes does not parse ({exc})") from None


def drain(sock: socket.socket, num_bytes: int, slice_bytes: int = 1 << 20) -> None:
    """Read and discard ``num_bytes`` (a refused push's payload), keeping the stream in step."""
    scratch = memoryview(bytearray(min(num_bytes, slice_bytes) or 1))
    left = num_bytes
    while left > 0:
        got = sock.recv_into(scratch, min(left, len(scratch)))
        if got == 0:
            raise ConnectionEnded(f"connection closed with {left} payload bytes still announced")
        left -= got
