"""CRC-32 of a push or pull header (``PushHeader.header_crc32``, ``PullHeader.header_crc32``).

The payload's CRC-32 (``crc32``) does not cover the header: one flipped bit in a push's
``push_id`` or ``base_version`` or in a pull's ``version`` would otherwise be taken at its
word. ``header_crc32`` is the CRC-32 (zlib's polynomial, the one the payload uses,
tensors.py) of the header serialized deterministically with ``header_crc32`` absent, 0
sent as 0xFFFFFFFF (proto3 cannot tell a 0 from a field not sent). The receiver parses
the header, re-serializes it the same way and compares: protobuf's deterministic
serialization of a parsed message gives back its fields in field-number order, so any
flipped bit that changes a field's value (or adds an unknown field) changes the bytes
and so the CRC. Every sender seals its headers, so a header without one was corrupted
in transit (a flipped tag can turn a field into a length-delimited one that swallows the
rest of the header, ``header_crc32`` included) and is refused like a wrong one.
"""

from __future__ import annotations

from typing import TypeVar

from asyncdiloco.errors import PayloadCorruptedError
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.tensors import crc32_update

_H = TypeVar("_H", pb.PushHeader, pb.PullHeader)


def header_crc(header: pb.PushHeader | pb.PullHeader) -> int:
    """CRC-32 of ``header`` serialized deterministically with ``header_crc32`` absent (uint32)."""
    saved = header.header_crc32
    header.header_crc32 = 0
    try:
        data = header.SerializeToString(deterministic=True)
    finally:
        header.header_crc32 = saved
    return crc32_update(0, data) or 0xFFFFFFFF  # never 0: that is "not sent"


def seal(header: _H) -> _H:
    """Set ``header.header_crc32`` to the header's CRC (every other field final); returns it."""
    header.header_crc32 = header_crc(header)
    return header


def check_header(header: pb.PushHeader | pb.PullHeader, what: str) -> None:
    """Refuse a header whose ``header_crc32`` is missing or differs from its CRC.

    Args:
        what: names the header in the message ("push 6 of worker 2", "the pull header").
    Raises:
        PayloadCorruptedError: the header was corrupted in transit; its fields (ids,
            versions, sizes) cannot be trusted; the same call sent again may succeed.
    """
    sent = header.header_crc32
    if not sent:  # every sender seals its headers: a flipped tag swallowed the CRC's own field
        raise PayloadCorruptedError(
            f"the header of {what} carries no header_crc32: it was corrupted in transit (every sender seals its "
            f"headers); send it again, and check the network path if this repeats"
        )
    got = header_crc(header)
    if got != sent:
        raise PayloadCorruptedError(
            f"the header of {what} has CRC-32 {got:#010x} but announced {sent:#010x}: it was corrupted in "
            f"transit (its fields cannot be trusted; nothing was applied); send it again, and check the "
            f"network path if this repeats"
        )
