"""Tensor <-> chunk-stream codec: manifests, payload packing, chunking and reassembly
(docs/protocol.md, "Payloads and chunks"). A payload is one 1-D ``torch.uint8`` CPU tensor,
filled and read without intermediate copies; tensors on CUDA are copied into a pinned CPU
payload, and decoded tensors are CPU tensors the caller moves.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import sys
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from asyncdiloco.errors import InvalidPayloadError, ManifestMismatchError, PayloadCorruptedError, PayloadTooLargeError
from asyncdiloco.wire._proto import parameter_server_pb2 as pb

log = logging.getLogger(__name__)

try:  # ISA-L's CRC-32 (python-isal): zlib's polynomial and values, SIMD, GIL released
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - isal has wheels for the usual platforms
    from zlib import crc32 as _crc32

    log.warning("isal is not installed: payload checksums fall back to zlib's CRC-32 (slower, same values)")

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("asyncdiloco's wire format is little-endian; this host is big-endian")

#: Payload bytes per chunk message: 4 MiB less 64 KiB, so that a chunk with its framing
#: (index, offset, CRC, the header fields) fits gRPC's default 4 MiB receive limit and
#: generated stubs with no channel options can push and pull (a full 4 MiB chunk was
#: 4,194,314 bytes on the wire, 10 over the limit).
DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024 - 64 * 1024

#: dtypes a parameter may have, with their wire enum.
WIRE_DTYPES: dict[torch.dtype, pb.DType] = {
    torch.float32: pb.DTYPE_FLOAT32,
    torch.bfloat16: pb.DTYPE_BFLOAT16,
    torch.float16: pb.DTYPE_FLOAT16,
}
_DTYPE_BY_WIRE = {v: k for k, v in WIRE_DTYPES.items()}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One parameter: its name, shape and dtype (also its wire dtype)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.dtype not in WIRE_DTYPES:
            raise InvalidPayloadError(
                f"parameter {self.name!r} has dtype {self.dtype}; supported dtypes are "
                f"{sorted(_DTYPE_NAMES.values())}; cast the model (e.g. model.float())"
            )
        if any(d < 0 for d in self.shape):
            raise InvalidPayloadError(f"parameter {self.name!r} has a negative dimension in shape {self.shape}")

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class Manifest:
    """The ordered parameters of a model: what a worker and the server must agree on.

    Attributes:
        tensors: the parameters in ``named_parameters()`` order.
    Derived: ``total_bytes`` (payload size), ``numel`` (fp32 elements on the server),
    ``offsets`` (byte offset of each tensor in the payload), ``manifest_hash`` (hex
    SHA-256 of names, shapes and dtypes).
    """

    tensors: tuple[TensorSpec, ...]

    @classmethod
    def from_module(cls, model: nn.Module) -> Manifest:
        """The manifest of ``model.named_parameters()`` (trainable or not, in order)."""
        return cls.from_named_tensors(model.named_parameters())

    @classmethod
    def from_named_tensors(
        cls, named: Iterator[tuple[str, torch.Tensor]] | Sequence[tuple[str, torch.Tensor]]
    ) -> Manifest:
        return cls(tuple(TensorSpec(n, tuple(t.shape), t.dtype) for n, t in named))

    @classmethod
    def from_proto(cls, msg: pb.Manifest) -> Manifest:
        """Decode a wire manifest; raises InvalidPayloadError for an unknown dtype or a
        hash that does not match the tensors."""
        specs = []
        for t in msg.tensors:
            if t.dtype not in _DTYPE_BY_WIRE:
                raise InvalidPayloadError(
                    f"manifest tensor {t.name!r} has wire dtype {t.dtype}; expected one of "
                    f"{sorted(WIRE_DTYPES.values())} (float32, bfloat16, float16)"
                )
            specs.append(TensorSpec(t.name, tuple(int(d) for d in t.shape), _DTYPE_BY_WIRE[t.dtype]))
        manifest = cls(tuple(specs))
        if msg.manifest_hash and msg.manifest_hash != manifest.manifest_hash:
            raise InvalidPayloadError(
                f"manifest_hash {msg.manifest_hash!r} does not match its tensors "
                f"(computed {manifest.manifest_hash!r}); send the hash Manifest.to_proto() computes"
            )
        return manifest

    def to_proto(self) -> pb.Manifest:
        return pb.Manifest(
            tensors=[pb.TensorSpec(name=t.name, shape=list(t.shape), dtype=WIRE_DTYPES[t.dtype]) for t in self.tensors],
            total_bytes=self.total_bytes,
            manifest_hash=self.manifest_hash,
        )

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors)

    def block_sizes(self) -> list[int]:
        """Element counts of the tensors, in manifest order (blocks of the flat vector)."""
        return [t.numel for t in self.tensors]

    @property
    def offsets(self) -> list[int]:
        out, pos = [], 0
        for t in self.tensors:
            out.append(pos)
            pos += t.nbytes
        return out

    @property
    def all_float32(self) -> bool:
        return all(t.dtype == torch.float32 for t in self.tensors)

    @property
    def manifest_hash(self) -> str:
        canon = json.dumps([[t.name, list(t.shape), _DTYPE_NAMES[t.dtype]] for t in self.tensors])
        return hashlib.sha256(canon.encode()).hexdigest()

    def first_difference(self, other: Manifest) -> str | None:
        """A sentence naming the first parameter where ``self`` (the worker's) differs
        from ``other`` (the server's), or None when they are equal."""
        for i, (a, b) in enumerate(zip(self.tensors, other.tensors)):
            for field in ("name", "shape", "dtype"):
                va, vb = getattr(a, field), getattr(b, field)
                if va != vb:
                    return f"parameter #{i} {b.name!r}: {field} is {va} on the worker but {vb} on the server"
        if len(self.tensors) != len(other.tensors):
            i = min(len(self.tensors), len(other.tensors))
            extra = (self.tensors if len(self.tensors) > i else other.tensors)[i].name
            return (
                f"the worker has {len(self.tensors)} parameters, the server {len(other.tensors)}; "
                f"first unmatched is #{i} {extra!r}"
            )
        return None

    def check_same(self, server: Manifest) -> None:
        """Raise ManifestMismatchError naming the first difference, if any."""
        diff = self.first_difference(server)
        if diff is not None:
            raise ManifestMismatchError(
                f"manifest mismatch: {diff}; start every worker with the same model "
                f"architecture and dtypes as the server's (or start a fresh server)"
            )

    # ----------------------------------------------------------------- packing
    def pack(self, tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
        """Pack ``tensors`` (any device, contiguous or not, cast to the manifest dtype)
        into a payload.

        Args:
            tensors: one tensor per manifest entry, with the manifest's shapes.
            out: optional preallocated 1-D uint8 CPU tensor of ``total_bytes`` to reuse.
        Returns:
            1-D ``torch.uint8`` CPU tensor of ``total_bytes`` (pinned when CUDA is in use).
        Raises:
            InvalidPayloadError: wrong count or shape.
        """
        if len(tensors) != len(self.tensors):
            raise InvalidPayloadError(f"got {len(tensors)} tensors for a manifest of {len(self.tensors)}")
        needs_pin = any(t.is_cuda for t in tensors)
        payload = out if out is not None else torch.empty(self.total_bytes, dtype=torch.uint8, pin_memory=needs_pin)
        self._check_payload(payload)
        for spec, off, t in zip(self.tensors, self.offsets, tensors):
            if tuple(t.shape) != spec.shape:
                raise InvalidPayloadError(
                    f"tensor {spec.name!r} has shape {tuple(t.shape)}; the manifest says {spec.shape}"
                )
            _write_typed(payload[off : off + spec.nbytes], t.detach().reshape(-1), spec.dtype, needs_pin)
        if needs_pin:
            torch.cuda.synchronize()
        return payload

    def pack_flat(self, flat: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Pack a flat fp32 vector of ``numel`` elements (the server's layout) into a
        payload, casting each slice to its manifest dtype. Returns a uint8 CPU tensor."""
        if flat.dtype != torch.float32 or flat.dim() != 1 or flat.numel() != self.numel:
            raise InvalidPayloadError(
                f"flat vector has dtype {flat.dtype}, shape {tuple(flat.shape)}; expected float32 ({self.numel},)"
            )
        if self.all_float32 and out is None:
            return flat.detach().cpu().view(torch.uint8).clone()
        payload = out if out is not None else torch.empty(self.total_bytes, dtype=torch.uint8)
        self._check_payload(payload)
        pos = 0
        for spec, off in zip(self.tensors, self.offsets):
            _write_typed(payload[off : off + spec.nbytes], flat[pos : pos + spec.numel], spec.dtype)
            pos += spec.numel
        return payload

    def unpack(self, payload: torch.Tensor) -> list[torch.Tensor]:
        """Views (or, where a dtype's alignment forbids a view, copies) of ``payload``
        as the manifest's tensors, shapes and dtypes. CPU tensors."""
        self._check_payload(payload)
        return [
            _typed_view(payload[off : off + spec.nbytes], spec.dtype).view(spec.shape)
            for spec, off in zip(self.tensors, self.offsets)
        ]

    def unpack_flat(self, payload: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The payload as one flat fp32 vector of ``numel`` elements (zero-copy when every
        tensor is fp32 and ``out`` is None)."""
        self._check_payload(payload)
        if self.all_float32 and out is None:
            return _typed_view(payload, torch.float32)
        flat = out if out is not None else torch.empty(self.numel, dtype=torch.float32)
        pos = 0
        for spec, off in zip(self.tensors, self.offsets):
            flat[pos : pos + spec.numel].copy_(_typed_view(payload[off : off + spec.nbytes], spec.dtype))
            pos += spec.numel
        return flat

    def _check_payload(self, payload: torch.Tensor) -> None:
        if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.numel() != self.total_bytes:
            raise InvalidPayloadError(
                f"payload has dtype {payload.dtype} and shape {tuple(payload.shape)}; "
                f"expected uint8 ({self.total_bytes},) for this manifest"
            )


def _typed_view(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D ``dtype`` view of a uint8 slice; a copy when the slice is misaligned."""
    if raw.numel() == 0:
        return torch.empty(0, dtype=dtype)
    try:
        return raw.view(dtype)
    except RuntimeError:  # storage offset not a multiple of the itemsize
        return raw.clone().view(dtype)


def _write_typed(raw: torch.Tensor, src: torch.Tensor, dtype: torch.dtype, non_blocking: bool = False) -> None:
    """Write 1-D ``src`` cast to ``dtype`` into the uint8 slice ``raw`` (aligned or not)."""
    if raw.numel() == 0:
        return
    try:
        raw.view(dtype).copy_(src, non_blocking=non_blocking)
    except RuntimeError:  # misaligned slice: cast into a dense CPU buffer, then copy the bytes
        dense = torch.empty(src.numel(), dtype=dtype)
        dense.copy_(src)
        raw.copy_(dense.view(torch.uint8))


# --------------------------------------------------------------------- chunking
def num_chunks_for(total_bytes: int, chunk_bytes: int) -> int:
    """How many chunks a payload of ``total_bytes`` is cut into (0 for an empty one)."""
    return -(-total_bytes // chunk_bytes)


def crc32_of(payload: torch.Tensor) -> int:
    """CRC-32 (zlib's polynomial and values) of a uint8 CPU payload.

    Computed with ISA-L (python-isal) when installed, which releases the GIL and is
    several times faster than zlib's: every push is checksummed on both sides, so with
    zlib the CRC dominates the server's own time per push (docs/performance.md)."""
    return crc32_update(0, payload.numpy())


def crc32_update(crc: int, data) -> int:
    """``crc`` extended over ``data`` (any C-contiguous buffer: bytes, memoryview, numpy)."""
    return _crc32(data, crc) & 0xFFFFFFFF


def chunk_views(payload: torch.Tensor, chunk_bytes: int) -> Iterator[tuple[int, int, memoryview]]:
    """How a uint8 CPU payload is cut for the wire: ``(index, offset, data)`` of each
    chunk, ``data`` a zero-copy view of at most ``chunk_bytes`` bytes (every chunk but
    the last exactly ``chunk_bytes``)."""
    if chunk_bytes <= 0:
        raise InvalidPayloadError(f"chunk_bytes is {chunk_bytes}; it must be > 0")
    view = payload.numpy().data  # a memoryview of the tensor's storage, no copy
    for index in range(num_chunks_for(len(view), chunk_bytes)):
        start = index * chunk_bytes
        yield index, start, view[start : start + chunk_bytes]


def iter_chunks(payload: torch.Tensor, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[pb.PayloadChunk]:
    """``chunk_views`` as protobuf ``PayloadChunk`` messages (each a copy)."""
    for index, offset, data in chunk_views(payload, chunk_bytes):
        yield pb.PayloadChunk(index=index, offset=offset, data=bytes(data))


class PayloadAssembler:
    """Reassembles one payload from its chunks, checking everything as it goes.

    Each chunk is copied straight into its place in a preallocated buffer, so a payload
    costs one copy after the network and no whole-payload intermediate.

    Args:
        total_bytes: announced payload size (must equal the manifest's).
        num_chunks: announced chunk count (must equal ceil(total_bytes / chunk_bytes)).
        crc32: announced CRC-32 of the payload.
        chunk_bytes: the chunk size in force.
        max_bytes: refuse payloads larger than this (RESOURCE_EXHAUSTED).
        buffer: optional 1-D uint8 tensor of ``total_bytes`` to fill.
    Raises:
        InvalidPayloadError / PayloadTooLargeError from the constructor, ``add`` and
        ``finish`` when the stream deviates from the header.
    """

    def __init__(
        self,
        *,
        total_bytes: int,
        num_chunks: int,
        crc32: int,
        chunk_bytes: int,
        max_bytes: int | None = None,
        buffer: torch.Tensor | None = None,
    ) -> None:
        if total_bytes < 0:
            raise InvalidPayloadError(f"total_bytes is {total_bytes}; it must be >= 0")
        if max_bytes is not None and total_bytes > max_bytes:
            raise PayloadTooLargeError(
                f"payload of {total_bytes} bytes exceeds the limit of {max_bytes} bytes; "
                f"raise the server's max_payload_bytes or send a smaller model"
            )
        expected = num_chunks_for(total_bytes, chunk_bytes)
        if num_chunks != expected:
            raise InvalidPayloadError(
                f"num_chunks is {num_chunks}; a payload of {total_bytes} bytes in chunks of "
                f"{chunk_bytes} bytes has {expected}; cut the payload with the server's chunk_bytes"
            )
        self.total_bytes = total_bytes
        self.num_chunks = num_chunks
        self.chunk_bytes = chunk_bytes
        self._crc_expected = crc32
        self._crc: int = 0
        self._next_index = 0
        self._filled: int = 0
        if buffer is None:
            buffer = torch.empty(total_bytes, dtype=torch.uint8)
        elif buffer.dtype != torch.uint8 or buffer.numel() != total_bytes:
            raise InvalidPayloadError(f"buffer has {buffer.numel()} {buffer.dtype} elements; need {total_bytes} uint8")
        self._buffer = buffer
        self._np = buffer.numpy()
        #: Optional ``(start, end) -> None``, called after bytes [start, end) of the buffer
        #: were filled, in order, while they are still in cache (the server's value scan:
        #: ps/push/value_scan.py). Whatever it raises ends the fill.
        self.watch: Callable[[int, int], None] | None = None

    @property
    def buffer(self) -> torch.Tensor:
        """The 1-D uint8 buffer the chunks are copied into."""
        return self._buffer

    def add(self, chunk: pb.PayloadChunk) -> None:
        """Copy one chunk into place; raises when it is out of order or mis-sized."""
        if self._next_index >= self.num_chunks:
            raise InvalidPayloadError(
                f"chunk index {chunk.index} arrived after all {self.num_chunks} announced chunks; "
                f"send exactly PushHeader.num_chunks chunks"
            )
        if chunk.index != self._next_index or chunk.offset != self._filled:
            raise InvalidPayloadError(
                f"chunk out of order: got index {chunk.index} at offset {chunk.offset}, expected "
                f"index {self._next_index} at offset {self._filled}; send chunks in order without gaps"
            )
        n = len(chunk.data)
        last = self._next_index == self.num_chunks - 1
        want = self.total_bytes - self._filled if last else self.chunk_bytes
        if n != want:
            if n > self.chunk_bytes:
                raise PayloadTooLargeError(
                    f"chunk {chunk.index} holds {n} bytes; the limit is chunk_bytes={self.chunk_bytes}; "
                    f"cut the payload with the server's chunk_bytes"
                )
            raise InvalidPayloadError(
                f"chunk {chunk.index} holds {n} bytes; expected {want} "
                f"(chunk_bytes={self.chunk_bytes}, total_bytes={self.total_bytes})"
            )
        self._np[self._filled : self._filled + n] = memoryview(chunk.data)
        self._crc = crc32_update(self._crc, chunk.data)
        if self.watch is not None:
            self.watch(self._filled, self._filled + n)
        self._filled += n
        self._next_index += 1

    def fill_with(self, readinto: Callable[[memoryview], int], slice_bytes: int = 1 << 20) -> None:
        """Fill the whole payload from a byte stream instead of chunks (the bulk channel).

        Reads straight into the buffer, ``slice_bytes`` at a time, and folds each slice
        into the CRC-32 while it is still in cache; ``finish`` then checks size and CRC as
        for chunks.

        Args:
            readinto: writes up to ``len(view)`` bytes into ``view`` and returns how many
                (0 = the stream ended), e.g. ``socket.recv_into``.
            slice_bytes: bytes per CRC update, > 0.
        Raises:
            InvalidPayloadError: chunks were already added, or the stream ended early.
            Whatever ``readinto`` raises (e.g. OSError), with the payload incomplete.
        """
        if self._next_index or self._filled:
            raise InvalidPayloadError("fill_with needs an empty assembler; chunks were already added")
        view = self._np.data  # a memoryview of the buffer, no copy
        while self._filled < self.total_bytes:
            end = min(self._filled + slice_bytes, self.total_bytes)
            pos: int = self._filled
            while pos < end:
                n = readinto(view[pos:end])
                if n == 0:
                    raise InvalidPayloadError(
                        f"stream ended after {pos} of {self.total_bytes} payload bytes; resend the whole payload"
                    )
                pos += n
            self._crc = _crc32(view[self._filled : end], self._crc)
            if self.watch is not None:
                self.watch(self._filled, end)
            self._filled = end
        self._next_index = self.num_chunks

    def finish(self) -> torch.Tensor:
        """The complete payload; raises InvalidPayloadError if chunks are missing, PayloadCorruptedError
        if the CRC-32 differs."""
        if self._next_index != self.num_chunks or self._filled != self.total_bytes:
            raise InvalidPayloadError(
                f"stream ended after {self._next_index} of {self.num_chunks} chunks "
                f"({self._filled} of {self.total_bytes} bytes); resend the whole payload"
            )
        crc = self._crc & 0xFFFFFFFF
        if crc != self._crc_expected:
            raise PayloadCorruptedError(
                f"payload CRC-32 is {crc:#010x} but the header announced {self._crc_expected:#010x}; "
                f"the payload was corrupted in transit: resend it"
            )
        return self._buffer
