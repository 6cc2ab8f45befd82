"""The bytes of a worker's ``state.pt`` (state_dir.py): ``torch.save``'s output behind a
header with its CRC-32 (docs/worker.md, "The state file").
"""

from __future__ import annotations

import io
import os
import pathlib
import struct
import zlib
from typing import IO, Any, BinaryIO, cast

import torch

#: The format this version writes (``STATE_FORMAT`` in state_dir.py).
FORMAT = 2
MAGIC = b"ADLSTATE"
_HEAD = struct.Struct("<8sIQI")  # magic, format, payload bytes, CRC-32
_COVERED = struct.Struct("<IQ")  # the header's numbers, hashed after the payload
HEADER_BYTES = _HEAD.size
_CHUNK = 1 << 20


class CorruptStateError(Exception):
    """The file's bytes are not what was saved (a checksum mismatch, a truncated or
    unparsable file). ``reason`` says what was wrong; ``name`` is the worker name read
    from what is still parsable, unverified (None: none could be read)."""

    def __init__(self, reason: str, name: str | None = None) -> None:
        super().__init__(reason)
        self.reason, self.name = reason, name


class NewerFormatError(Exception):
    """An intact file of a format this version does not read (written by a newer one)."""


class _HashingWriter:
    """A write-only file for ``torch.save`` that checksums and counts what passes through."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.crc, self.count = f, 0, 0

    def write(self, data: bytes) -> int:
        self.crc = zlib.crc32(data, self.crc)
        self.count += len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


class _Window(io.RawIOBase):
    """Bytes ``[start, start + size)`` of an open file, as a file of their own (so that
    ``torch.load`` reads the payload in place, without a copy in memory)."""

    def __init__(self, f: BinaryIO, start: int, size: int) -> None:
        super().__init__()
        self.f, self.start, self.size, self.pos = f, start, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self.size - self.pos))
        if n == 0:
            return 0
        self.f.seek(self.start + self.pos)
        got = self.f.readinto(view[:n])  # type: ignore[attr-defined]
        self.pos += got
        return got


def write_state(f: BinaryIO, state: dict[str, Any]) -> None:
    """Write ``state`` to the open, empty file ``f`` in format 2 (docs/worker.md, "The state file").

    Args:
        f: a seekable binary file opened for writing, positioned at 0.
        state: what ``torch.save`` writes (a worker's ``state_dict()``, tensors on the CPU).
    Raises:
        OSError: the file cannot be written.
    """
    f.write(bytes(HEADER_BYTES))
    out = _HashingWriter(f)
    torch.save(state, cast(IO[bytes], out))
    crc = zlib.crc32(_COVERED.pack(FORMAT, out.count), out.crc)
    f.seek(0)
    f.write(_HEAD.pack(MAGIC, FORMAT, out.count, crc))
    f.seek(0, io.SEEK_END)


def _load(f: BinaryIO | _Window) -> Any:
    return torch.load(cast(IO[bytes], f), map_location="cpu", weights_only=True)


def _name_in(f: _Window) -> str | None:
    """The worker name in an unverified payload, if it still parses (None: it does not)."""
    try:
        name = _load(f)["worker_name"]
    except Exception:  # noqa: BLE001 - a corrupt payload may fail in any way
        return None
    return name if isinstance(name, str) and name else None


def read_state(file: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and verify a ``state.pt``.

    Returns:
        The saved dict (tensors on the CPU).
    Raises:
        OSError: the file cannot be opened (e.g. permissions).
        CorruptStateError: its bytes are not what was saved.
        NewerFormatError: an intact file of another format.
    """
    with open(pathlib.Path(file), "rb") as f:
        head = f.read(HEADER_BYTES)
        if len(head) < HEADER_BYTES or not head.startswith(MAGIC):
            raise CorruptStateError(
                f"does not begin with a state header ({len(head)} bytes, {head[:8]!r}; expected {MAGIC!r})"
            )
        _, fmt, size, saved = _HEAD.unpack(head)
        found = os.fstat(f.fileno()).st_size - HEADER_BYTES
        window = _Window(f, HEADER_BYTES, found)
        if found != size:
            raise CorruptStateError(
                f"holds {found} bytes after its header, which says {size} (a truncated or damaged file)",
                _name_in(window),
            )
        crc = 0
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
        crc = zlib.crc32(_COVERED.pack(fmt, size), crc)
        if crc != saved:
            raise CorruptStateError(
                f"fails its checksum (CRC-32 {crc:08x} of its {size} bytes, {saved:08x} saved; a bit changed "
                f"on disk or in memory)",
                _name_in(window),
            )
        if fmt != FORMAT:
            raise NewerFormatError(f"has format {fmt}; this worker reads format {FORMAT}")
        state = _load(window)
    if not isinstance(state, dict):
        raise CorruptStateError(f"holds a {type(state).__name__}, not a worker's state")
    return state


def nonfinite_part(state: dict[str, Any]) -> str | None:
    """Where a saved state holds NaN or ±inf: in θ_base, θ_local (an async worker's) or a
    floating tensor of the inner optimizer's state (e.g. AdamW's ``exp_avg_sq``) — the
    state of a worker that had diverged. None: all finite.

    Returns:
        E.g. ``"theta_base (3 of 100 values, first at index 0: nan)"``, or None.
    """
    named: list[tuple[str, Any]] = [("theta_base", state.get("theta_base")), ("theta_local", state.get("theta_local"))]
    inner = state.get("inner_optimizer")
    per_param = inner.get("state", {}) if isinstance(inner, dict) else {}
    for param, entries in per_param.items() if isinstance(per_param, dict) else ():
        for key, value in entries.items() if isinstance(entries, dict) else ():
            named.append((f"inner_optimizer state of parameter {param}, {key!r}", value))
    for what, value in named:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            bad = ~torch.isfinite(value.reshape(-1))
            if bool(bad.any()):
                first = int(bad.nonzero()[0])
                example = float(value.reshape(-1)[first])
                return f"{what} ({int(bad.sum())} of {value.numel()} values, first at index {first}: {example})"
    return None
