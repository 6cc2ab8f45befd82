"""The hot path of the wire: the chunk messages ``PushMessage{chunk}``, ``PullMessage{chunk}``
and PushOne's ``PushRequest{header, chunk}`` encoded and decoded by hand, byte for byte what
the generated protobuf code writes, at one copy per side instead of about four (a decoded
chunk's ``data`` is a zero-copy ``memoryview``); every other message goes through the
generated classes (docs/protocol.md "Payloads and chunks"). The chunk field is ``0x12 varint(len(body))
body``, ``body = [0x08 varint(index)] [0x10 varint(offset)] [0x1a varint(len(data)) data]``
(proto3 omits defaults); a ``PushRequest`` puts ``0x0a varint(len(header)) header`` first.
``add_parameter_server`` registers the service with these codecs; ``push_callable``,
``push_one_callable`` and ``pull_callable`` are the client's side.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import grpc
import torch

from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.tensors import chunk_views

SERVICE = "asyncdiloco.v1.ParameterServer"
_CHUNK_TAG = 0x12  # field 2 (chunk), wire type 2 (length-delimited), in PushMessage and PullMessage
_INDEX_TAG, _OFFSET_TAG, _DATA_TAG = 0x08, 0x10, 0x1A  # PayloadChunk fields 1, 2 (varint), 3 (bytes)


@dataclasses.dataclass(frozen=True)
class WireChunk:
    """A decoded ``PayloadChunk``; ``data`` is a read-only view into the received bytes
    (valid as long as the object lives). Quacks like ``pb.PayloadChunk`` for
    ``PayloadAssembler.add``."""

    index: int
    offset: int
    data: memoryview


def _varint(value: int) -> bytes:
    if value < 0:  # int64 fields encode negatives as 10-byte two's complement
        value += 1 << 64
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def chunk_prefix(index: int, offset: int, nbytes: int) -> bytes:
    """The bytes of ``PushMessage(chunk=PayloadChunk(index, offset, data))`` (equally a
    ``PullMessage``) that come before ``data`` when ``data`` is ``nbytes`` long: the
    message is ``chunk_prefix(...) + data``, byte-identical to the generated code."""
    head = bytearray()
    if index:
        head += b"\x08" + _varint(index)
    if offset:
        head += b"\x10" + _varint(offset)
    if nbytes:
        head += b"\x1a" + _varint(nbytes)
    return b"\x12" + _varint(len(head) + nbytes) + bytes(head)


def encode_chunk(index: int, offset: int, data: memoryview) -> bytes:
    """Serialise ``PushMessage(chunk=PayloadChunk(index, offset, data))`` (equally a
    ``PullMessage``), byte-identical to the generated code, copying ``data`` once.

    Args:
        index: 0-based chunk position. offset: byte offset of ``data`` in the payload.
        data: the chunk's bytes (any C-contiguous buffer, e.g. a slice of a payload's
            ``memoryview``).
    """
    n = data.nbytes
    prefix = chunk_prefix(index, offset, n)
    return b"".join((prefix, data)) if n else prefix


def chunk_messages(payload: torch.Tensor, chunk_bytes: int) -> Iterator[bytes]:
    """A uint8 CPU payload as serialised chunk messages (``encode_chunk`` of each of its
    ``chunk_views``), one copy each."""
    for index, offset, data in chunk_views(payload, chunk_bytes):
        yield encode_chunk(index, offset, data)


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("truncated or overlong varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def _as_int64(value: int) -> int:
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >> 63 else value


def _decode_chunk(data: bytes, start: int = 0) -> WireChunk | None:
    """The chunk in a serialised ``Push``/``PullMessage`` (or the chunk field that makes
    up ``data[start:]`` of a ``PushRequest``), or None when the bytes are anything else (a
    header, unknown fields, malformed bytes): the caller then lets protobuf parse them,
    so the outcome for odd input is exactly protobuf's."""
    if len(data) <= start or data[start] != _CHUNK_TAG:
        return None
    try:
        length, pos = _read_varint(data, start + 1)
        end = pos + length
        if end != len(data):
            return None
        index = offset = 0
        view = memoryview(b"")
        while pos < end:
            tag = data[pos]
            pos += 1
            if tag == _INDEX_TAG:
                index, pos = _read_varint(data, pos)
            elif tag == _OFFSET_TAG:
                offset, pos = _read_varint(data, pos)
            elif tag == _DATA_TAG:
                n, pos = _read_varint(data, pos)
                if pos + n > end:
                    return None
                view = memoryview(data)[pos : pos + n]
                pos += n
            else:
                return None
    except ValueError:
        return None
    return WireChunk(_as_int64(index), _as_int64(offset), view)


def decode_push_message(data: bytes) -> WireChunk | pb.PushMessage:
    """gRPC request deserializer of Push: a ``WireChunk`` for chunk messages, else the
    parsed ``pb.PushMessage`` (raises ``DecodeError`` like protobuf on garbage)."""
    chunk = _decode_chunk(data)
    return chunk if chunk is not None else pb.PushMessage.FromString(data)


def decode_pull_message(data: bytes) -> WireChunk | pb.PullMessage:
    """gRPC response deserializer of Pull; see ``decode_push_message``."""
    chunk = _decode_chunk(data)
    return chunk if chunk is not None else pb.PullMessage.FromString(data)


@dataclasses.dataclass(frozen=True)
class WirePushRequest:
    """A decoded ``PushRequest`` (PushOne): the header, and the payload's only chunk
    (None for an empty payload; a ``WireChunk`` viewing the received bytes when the
    request is in the canonical layout, else protobuf's ``PayloadChunk``)."""

    header: pb.PushHeader | None
    chunk: WireChunk | pb.PayloadChunk | None


_HEADER_TAG = 0x0A  # PushRequest field 1 (header), wire type 2


def encode_push_request(header: pb.PushHeader, data: memoryview) -> bytes:
    """Serialise ``PushRequest(header, chunk=PayloadChunk(0, 0, data))``, byte-identical
    to the generated code (deterministic: field 1, then field 2), copying ``data`` once.

    Args:
        header: the push's header, sealed (num_chunks and header_crc32 set).
        data: the whole payload (a C-contiguous buffer of at most chunk_bytes bytes; empty:
            no chunk field, as protobuf writes an empty sub-message it was not given).
    """
    head = header.SerializeToString(deterministic=True)
    parts = [b"\x0a" + _varint(len(head)), head]
    n = data.nbytes
    if n:
        parts += (chunk_prefix(0, 0, n), data)
    return b"".join(parts)


def push_request_bytes(header: pb.PushHeader, payload: torch.Tensor) -> bytes:
    """``encode_push_request`` of a uint8 CPU payload (1-D, contiguous)."""
    return encode_push_request(header, payload.numpy().data)  # a view of the tensor's storage, no copy


def decode_push_request(data: bytes) -> WirePushRequest:
    """gRPC request deserializer of PushOne: the header parsed by protobuf (a few dozen
    bytes), the chunk a zero-copy view; any other layout is parsed by protobuf whole
    (raises ``DecodeError`` like protobuf on garbage)."""
    if data and data[0] == _HEADER_TAG:
        try:
            length, pos = _read_varint(data, 1)
        except ValueError:
            length, pos = -1, 0
        end = pos + length
        if length >= 0 and end <= len(data):
            chunk = _decode_chunk(data, end)
            if chunk is not None or end == len(data):
                header = pb.PushHeader.FromString(memoryview(data)[pos:end])
                return WirePushRequest(header, chunk)
    request = pb.PushRequest.FromString(data)
    return WirePushRequest(
        request.header if request.HasField("header") else None,
        request.chunk if request.HasField("chunk") else None,
    )


def serialize_message(message: bytes | pb.PushMessage | pb.PullMessage) -> bytes:
    """gRPC serializer for Push requests and Pull responses: bytes from ``encode_chunk``
    pass through untouched; protobuf messages are serialised."""
    return message if isinstance(message, bytes) else message.SerializeToString()


def is_chunk(message: object) -> bool:
    return isinstance(message, WireChunk)


# ---------------------------------------------------------------- registration
def _handlers(servicer) -> dict[str, grpc.RpcMethodHandler]:
    unary = grpc.unary_unary_rpc_method_handler
    plain: dict[str, tuple[Any, Any]] = {  # RPC -> (request class, reply class), generated
        "Join": (pb.JoinRequest, pb.JoinReply),
        "Heartbeat": (pb.HeartbeatRequest, pb.HeartbeatReply),
        "Leave": (pb.LeaveRequest, pb.LeaveReply),
        "Status": (pb.StatusRequest, pb.StatusReply),
        "Quorum": (pb.QuorumRequest, pb.QuorumReply),
        "Commit": (pb.CommitRequest, pb.CommitReply),
        "ReportEval": (pb.EvalReport, pb.EvalReply),
        "Store": (pb.StoreRequest, pb.StoreReply),
    }
    handlers = {
        name: unary(
            getattr(servicer, name), request_deserializer=req.FromString, response_serializer=rep.SerializeToString
        )
        for name, (req, rep) in plain.items()
    }
    handlers["Push"] = grpc.stream_unary_rpc_method_handler(
        servicer.Push, request_deserializer=decode_push_message, response_serializer=pb.PushReply.SerializeToString
    )
    handlers["PushOne"] = unary(
        servicer.PushOne, request_deserializer=decode_push_request, response_serializer=pb.PushReply.SerializeToString
    )
    handlers["Pull"] = grpc.unary_stream_rpc_method_handler(
        servicer.Pull, request_deserializer=pb.PullRequest.FromString, response_serializer=serialize_message
    )
    return handlers


def add_parameter_server(servicer, server: grpc.Server) -> None:
    """Register ``servicer`` (a ``ParameterServerServicer``) on ``server`` with the
    hand-coded chunk codecs. Every RPC of the .proto's service is registered (a test
    checks the list against the service descriptor)."""
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, _handlers(servicer)),))


def push_callable(channel: grpc.Channel) -> grpc.StreamUnaryMultiCallable:
    """Client side of Push: requests are ``pb.PushMessage`` or ``encode_chunk`` bytes."""
    return channel.stream_unary(
        f"/{SERVICE}/Push", request_serializer=serialize_message, response_deserializer=pb.PushReply.FromString
    )


def push_one_callable(channel: grpc.Channel) -> grpc.UnaryUnaryMultiCallable:
    """Client side of PushOne: the request is ``push_request_bytes``'s, sent as it is."""
    return channel.unary_unary(
        f"/{SERVICE}/PushOne", request_serializer=_passthrough, response_deserializer=pb.PushReply.FromString
    )


def _passthrough(message: bytes) -> bytes:
    return message


def pull_callable(channel: grpc.Channel) -> grpc.UnaryStreamMultiCallable:
    """Client side of Pull: responses are a ``pb.PullMessage`` (the header) then ``WireChunk``s."""
    return channel.unary_stream(
        f"/{SERVICE}/Pull",
        request_serializer=pb.PullRequest.SerializeToString,
        response_deserializer=decode_pull_message,
    )
