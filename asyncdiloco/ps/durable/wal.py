"""The write-ahead log's record format: encoding, reading a segment, and replaying a
record into the state (store.py appends the records and owns the files).

A record is a fixed head, a JSON meta and a payload::

    magic "ADWL" | kind u8 | LSN u64 | meta length u32 | payload length u64 | CRC-32 u32
    meta (JSON, UTF-8) | payload (bytes)

(little-endian; the CRC-32 covers the head's fields after the magic, the meta and the
payload). ``JOIN`` records hold the worker id, name, whether it initializes and, for the
first Join, the manifest; ``PUSH`` records hold the push header's fields, τ, s(τ), the
version it produced, the live-worker count N and the wire codec, and the payload exactly
as received, with ``seen_unix_s`` (the wall-clock time: the worker's last contact).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import struct
import zlib

import torch

from asyncdiloco.errors import CheckpointError
from asyncdiloco.ps.books import AppliedAs, JournaledState, LoggedJoin
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.tensors import WIRE_DTYPES, Manifest, TensorSpec

log = logging.getLogger(__name__)

_MAGIC = b"ADWL"
# magic, record kind, LSN, meta length, payload length, CRC-32 of everything after it
_HEAD = struct.Struct("<4sBQIQI")
JOIN, PUSH = 1, 2


def manifest_to_json(manifest: Manifest) -> list:
    """``[[name, shape, dtype], ...]``, e.g. ``[["fc.weight", [4, 2], "float32"]]``."""
    return [[t.name, list(t.shape), str(t.dtype).removeprefix("torch.")] for t in manifest.tensors]


def manifest_from_json(items: list) -> Manifest:
    """The inverse of ``manifest_to_json``.

    Raises:
        CheckpointError: the stored manifest is malformed.
    """
    dtypes = {str(d).removeprefix("torch."): d for d in WIRE_DTYPES}
    try:
        return Manifest(
            tuple(TensorSpec(name, tuple(int(d) for d in shape), dtypes[dtype]) for name, shape, dtype in items)
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"stored manifest is malformed ({exc!r}); restore the folder from a backup") from None


@dataclasses.dataclass(frozen=True)
class LogRecord:
    """One intact record: ``kind`` (JOIN or PUSH), its LSN, its meta and payload bytes."""

    kind: int
    lsn: int
    meta: dict
    payload: bytes


def encode_record(kind: int, lsn: int, meta: dict, payload: memoryview | bytes) -> tuple[bytes, bytes]:
    """(head, meta bytes) of a record; the payload follows them unchanged."""
    meta_b = json.dumps(meta, separators=(",", ":")).encode()
    crc = zlib.crc32(
        payload, zlib.crc32(meta_b, zlib.crc32(struct.pack("<BQIQ", kind, lsn, len(meta_b), len(payload))))
    )
    return _HEAD.pack(_MAGIC, kind, lsn, len(meta_b), len(payload), crc & 0xFFFFFFFF), meta_b


def _check_record(data: bytes, pos: int) -> tuple[str | None, int]:
    """(problem or None, end offset) of the record starting at ``pos``."""
    if len(data) - pos < _HEAD.size:
        return "a record header is cut off", len(data)
    magic, kind, lsn, meta_len, payload_len, crc = _HEAD.unpack_from(data, pos)
    end = pos + _HEAD.size + meta_len + payload_len
    if magic != _MAGIC:
        return f"bad magic {magic!r}", end
    if end > len(data):
        return "a record is cut off", len(data)
    body_crc = zlib.crc32(memoryview(data)[pos + _HEAD.size : end], zlib.crc32(data[pos + 4 : pos + _HEAD.size - 4]))
    if body_crc & 0xFFFFFFFF != crc:
        return "CRC-32 mismatch", end
    return None, end


def _intact_record_after(data: bytes, pos: int) -> bool:
    p = data.find(_MAGIC, pos + 1)
    while p != -1:
        if _check_record(data, p)[0] is None:
            return True
        p = data.find(_MAGIC, p + 1)
    return False


def _cut_torn_tail(path: pathlib.Path, pos: int, problem: str) -> None:
    log.warning(
        "write-ahead log %s: dropping a torn record at byte %d (%s); it was never acknowledged", path.name, pos, problem
    )
    with open(path, "r+b") as f:
        f.truncate(pos)
        f.flush()
        os.fsync(f.fileno())


def read_segment(path: pathlib.Path, *, is_last: bool, repair: bool = True) -> list[LogRecord]:
    """The intact records of one log segment.

    Damage in the last segment with no intact record after it is a torn tail: the
    crash hit during that append, whose fsync never returned, so it was never
    acknowledged; it is cut off the file (``repair``), or, read-only (``repair=False``:
    the segment a running server appends to, read by an export), reading stops there and
    the file is left as it is. Any other damage is an error.

    Raises:
        CheckpointError: a damaged record that is not a torn tail.
    """
    data = path.read_bytes()
    records, pos = [], 0
    while pos < len(data):
        problem, end = _check_record(data, pos)
        if problem is not None:
            if is_last and not _intact_record_after(data, pos):
                if repair:
                    _cut_torn_tail(path, pos, problem)
                else:
                    log.info(
                        "write-ahead log %s: reading stops at byte %d (%s: an append in progress)",
                        path,
                        pos,
                        problem,
                    )
                break
            raise CheckpointError(
                f"write-ahead log {path} is damaged at byte {pos} ({problem}); the records after it cannot be "
                f"trusted: restore the folder from a backup, or move the log away to resume from the newest "
                f"checkpoint alone (losing the pushes logged after it)"
            )
        kind, lsn, meta_len = _HEAD.unpack_from(data, pos)[1:4]
        body = pos + _HEAD.size
        meta = json.loads(data[body : body + meta_len])
        records.append(LogRecord(kind, lsn, meta, data[body + meta_len : end]))
        pos = end
    return records


def push_meta(header: pb.PushHeader, applied: AppliedAs, codec: str) -> dict:
    """The meta of a PUSH record: everything its outer step depends on."""
    return {
        "worker_id": header.worker_id,
        "push_id": header.push_id,
        "base_version": header.base_version,
        "num_local_steps": header.num_local_steps,
        "num_tokens": header.num_tokens,
        "total_bytes": header.total_bytes,
        "kind": header.kind,
        "tau": applied.tau,
        "weight": applied.weight,
        "version_after": applied.version_after,
        "num_workers": applied.num_workers,
        "codec": codec,
        **({"region": True} if applied.region else {}),
        **({"closing": True} if applied.closing else {}),
    }


def replay_record(state: JournaledState, rec: LogRecord, wire_codec: str) -> None:
    """Redo one record on ``state``; ``wire_codec``: this server's (a pseudo-gradient
    record must have been encoded with it).

    Raises:
        CheckpointError: another codec, an unknown record kind, or a record that does not
        follow the state.
    """
    m = rec.meta
    if rec.kind == JOIN:
        manifest = manifest_from_json(m["manifest"]) if "manifest" in m else None
        state.replay_join(
            LoggedJoin(
                m["worker_id"],
                m["name"],
                m["initialize"],
                manifest,
                m["named"],
                m["seen_unix_s"],
                m.get("region", False),
            )
        )
        return
    if rec.kind != PUSH:
        raise CheckpointError(f"write-ahead log record {rec.lsn} has unknown kind {rec.kind}; restore from a backup")
    fields = ("worker_id", "push_id", "base_version", "num_local_steps", "num_tokens", "total_bytes", "kind")
    header = pb.PushHeader(**{f: m[f] for f in fields})
    codec = m["codec"]
    if m["kind"] == pb.PUSH_KIND_PSEUDO_GRADIENT and codec != wire_codec:
        raise CheckpointError(
            f"write-ahead log record {rec.lsn} holds a pseudo-gradient encoded with wire codec {codec!r} but "
            f"this server is configured with {wire_codec!r}; restart with "
            f"--wire-codec {codec} (replaying the log needs it) or use a fresh --checkpoint-dir"
        )
    payload = torch.frombuffer(bytearray(rec.payload), dtype=torch.uint8)
    applied = AppliedAs(
        tau=m["tau"],
        weight=m["weight"],
        version_after=m["version_after"],
        num_workers=m["num_workers"],
        region=m.get("region", False),
        closing=m.get("closing", False),
    )
    state.replay_push(header, payload, applied)
    state.replay_seen(m["worker_id"], m["seen_unix_s"])
