"""Wire codecs: how a flat fp32 vector (a pseudo-gradient, or θ) travels as bytes, picked by
the run config (``ServerConfig.wire_codec``) for pushes and pulls; master weights stay fp32
on both sides (low-precision communication as in Streaming DiLoCo, Douillard et al. 2025,
arXiv 2501.18512, Sec. 2.3). ``raw`` (the manifest payload), ``bf16`` and ``int8``
(block-wise absmax, Dettmers et al. 2022, arXiv 2110.02861, Sec. 2); bytes, error bounds
and layout in docs/protocol.md "Codecs". ``encode`` / ``decode`` write into preallocated
tensors; non-finite input, or a value a codec cannot represent, raises
``InvalidPayloadError``.
"""

from __future__ import annotations

import math
import threading

import torch

from asyncdiloco.errors import InvalidPayloadError
from asyncdiloco.wire.tensors import Manifest

#: Codec names, as ``--wire-codec`` and ``RunConfig.wire_codec`` spell them.
WIRE_CODECS = ("raw", "bf16", "int8")
#: int8 elements per absmax block when the run config leaves it 0.
DEFAULT_BLOCK_SIZE = 4096
#: Largest block the int8 codec accepts, elements.
MAX_BLOCK_SIZE = 1 << 24
#: fp32 elements processed per slice (1 MiB): the scratch stays in cache.
_SLICE_NUMEL = 1 << 18
#: Smallest magnitude bfloat16 rounds to infinity: 2^128 · (1 − 2^-9).
_BF16_OVERFLOW = 2.0**128 * (1 - 2.0**-9)


class WireCodec:
    """Base: encodes a flat fp32 vector of ``numel`` elements into ``wire_bytes`` bytes.

    Attributes:
        name: "raw", "bf16" or "int8".
        numel: N, elements of the flat vector (the manifest's numel).
        wire_bytes: payload size in bytes.
        lossless: True when decode(encode(x)) == x for every finite x.
    """

    name = ""
    lossless = False

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self.numel = manifest.numel
        self.wire_bytes = 0

    def encode(self, flat: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Encode ``flat`` into ``out``.

        Args:
            flat: float32 (N,) CPU tensor (contiguous).
            out: uint8 (wire_bytes,) CPU tensor, preallocated (pinned or not).
        Returns:
            ``out``.
        Raises:
            InvalidPayloadError: wrong shapes/dtypes, or a value that is not finite (or
            not representable in the codec's format).
        """
        raise NotImplementedError

    def decode(self, payload: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Decode ``payload`` into ``out``.

        Args:
            payload: uint8 (wire_bytes,) CPU tensor.
            out: float32 (N,) CPU tensor, preallocated.
        Returns:
            ``out``.
        Raises:
            InvalidPayloadError: wrong shapes/dtypes.
        """
        raise NotImplementedError

    def describe(self) -> str:
        return self.name

    # -------------------------------------------------------------- checks
    def _check(self, flat: torch.Tensor, payload: torch.Tensor) -> None:
        if flat.dtype != torch.float32 or flat.dim() != 1 or flat.numel() != self.numel or not flat.is_contiguous():
            raise InvalidPayloadError(
                f"flat vector has dtype {flat.dtype}, shape {tuple(flat.shape)}; the {self.describe()} codec "
                f"expects a contiguous float32 ({self.numel},)"
            )
        if flat.is_cuda:
            raise InvalidPayloadError("wire codecs work on CPU tensors; copy to the (pinned) CPU buffer first")
        self._check_payload(payload)

    def _check_payload(self, payload: torch.Tensor) -> None:
        if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.numel() != self.wire_bytes:
            raise InvalidPayloadError(
                f"payload has dtype {payload.dtype} and shape {tuple(payload.shape)}; the {self.describe()} codec "
                f"expects uint8 ({self.wire_bytes},)"
            )
        if payload.is_cuda:
            raise InvalidPayloadError("wire codecs work on CPU tensors; copy to the (pinned) CPU buffer first")

    def _non_finite(self, flat: torch.Tensor) -> InvalidPayloadError:
        bad = int((~torch.isfinite(flat)).sum())
        if bad:
            return InvalidPayloadError(
                f"the vector to encode holds {bad} non-finite values (NaN/Inf); the limit is 0: "
                f"the local model diverged, lower the inner learning rate or clip gradients"
            )
        largest = float(torch.linalg.vector_norm(flat, float("inf")))
        return InvalidPayloadError(
            f"the vector to encode holds a value of magnitude {largest:.4g}, which the {self.describe()} codec "
            f"cannot represent (it would become Inf on the wire); the local model diverged: lower the inner "
            f"learning rate, or use --wire-codec raw with float32 parameters"
        )


def _all_finite(x: torch.Tensor) -> bool:
    """True when every element of ``x`` is finite (one reduction, no temporary)."""
    if x.numel() == 0:
        return True
    if math.isfinite(float(x.sum(dtype=torch.float32))):  # NaN/Inf propagate; finite ⇒ all finite
        return True
    return bool(torch.isfinite(x).all())  # the sum may overflow with finite, huge values


class RawCodec(WireCodec):
    """Each parameter in its manifest dtype: ``Manifest.pack_flat`` / ``unpack_flat``."""

    name = "raw"

    def __init__(self, manifest: Manifest) -> None:
        super().__init__(manifest)
        self.wire_bytes = manifest.total_bytes
        self.lossless = manifest.all_float32

    def encode(self, flat: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        self._check(flat, out)
        self.manifest.pack_flat(flat, out=out)
        if not _all_finite(flat) or not all(_all_finite(t) for t in self._narrow_views(out)):
            raise self._non_finite(flat)
        return out

    def decode(self, payload: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        self._check(out, payload)
        return self.manifest.unpack_flat(payload, out=out)

    def _narrow_views(self, payload: torch.Tensor) -> list[torch.Tensor]:
        """The payload's bf16/fp16 parameters (where an fp32 value may have overflowed)."""
        if self.lossless:
            return []
        views = self.manifest.unpack(payload)
        return [v for v, spec in zip(views, self.manifest.tensors) if spec.dtype != torch.float32]


class Bf16Codec(WireCodec):
    """Every element as bfloat16, round to nearest even: |x − x̂| ≤ 2^-8·|x|."""

    name = "bf16"

    def __init__(self, manifest: Manifest) -> None:
        super().__init__(manifest)
        self.wire_bytes = 2 * self.numel

    def encode(self, flat: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        self._check(flat, out)
        if self.numel == 0:
            return out
        out.view(torch.bfloat16).copy_(flat)  # torch's fp32 -> bf16 cast rounds to nearest even
        lo, hi = torch.aminmax(flat)  # one fast 1-D reduction; NaN propagates (and fails both tests)
        if not (-_BF16_OVERFLOW < float(lo) and float(hi) < _BF16_OVERFLOW):
            raise self._non_finite(flat)
        return out

    def decode(self, payload: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        self._check(out, payload)
        if self.numel:
            out.copy_(payload.view(torch.bfloat16))  # exact: every bf16 value is an fp32 value
        return out

    def values(self, payload: torch.Tensor) -> torch.Tensor:
        """The payload's values as they are, bfloat16 (N,), a view (what a decode would
        give, exactly: for the value check without decoding)."""
        self._check_payload(payload)
        return payload.view(torch.bfloat16)


class Int8Codec(WireCodec):
    """Block-wise absmax int8 with float32 scales: ``n_b`` = ⌈N / block_size⌉ float32 scales
    (absmax_b / 127, little-endian, block order), then the N int8 values q = round(x /
    scale_b) clamped to [−127, 127]. Its scratch is one preallocated ~1 MiB fp32 slice
    (the vector is worked through in slices that stay in cache), so one instance is not
    safe from two threads at once (``make_codec`` is cheap: one per thread).

    Args:
        manifest: the model.
        block_size: elements per block, in [1, 2^24]; multiples of 64 are fastest.
    """

    name = "int8"

    def __init__(self, manifest: Manifest, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        super().__init__(manifest)
        if not 1 <= block_size <= MAX_BLOCK_SIZE:
            raise InvalidPayloadError(
                f"codec_block_size is {block_size}; the int8 codec needs 1..{MAX_BLOCK_SIZE} elements per block "
                f"(default {DEFAULT_BLOCK_SIZE})"
            )
        self.block_size = block_size
        self.num_blocks = -(-self.numel // block_size)
        self.wire_bytes = 4 * self.num_blocks + self.numel
        # Blocks per slice, and the lane width of the absmax reduction: a (k, B/L, L) view
        # reduced over dim 1 reads memory contiguously in L-wide lanes, which torch
        # vectorises, where a plain (k, B) row reduction does not.
        self._blocks_per_slice = max(1, _SLICE_NUMEL // block_size)
        self._lanes = next((lanes for lanes in (64, 32) if block_size % lanes == 0), 0)
        self._scratch = torch.empty(min(self.numel, self._blocks_per_slice * block_size), dtype=torch.float32)

    def describe(self) -> str:
        return f"int8 (block_size {self.block_size})"

    def _views(self, payload: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(scales float32 (n_b,), values int8 (N,)) views of a payload."""
        return payload[: 4 * self.num_blocks].view(torch.float32), payload[4 * self.num_blocks :].view(torch.int8)

    def _slices(self):
        """(first block, blocks, first element, elements) per slice; full blocks, then the short last one."""
        full = self.numel // self.block_size
        for b0 in range(0, full, self._blocks_per_slice):
            k = min(self._blocks_per_slice, full - b0)
            yield b0, k, b0 * self.block_size, k * self.block_size
        tail = self.numel - full * self.block_size
        if tail:
            yield full, 1, full * self.block_size, tail

    def encode(self, flat: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        self._check(flat, out)
        scales, values = self._views(out)
        for b0, k, e0, n in self._slices():
            x = flat[e0 : e0 + n].view(k, n // k)  # (k, B) this slice's blocks
            work = self._scratch[:n].view(k, n // k)
            torch.abs(x, out=work)
            if self._lanes and n // k == self.block_size:
                absmax = work.view(k, -1, self._lanes).amax(dim=1).amax(dim=1)  # (k,); NaN propagates
            else:
                absmax = work.amax(dim=1)
            scale = scales[b0 : b0 + k]
            torch.div(absmax, 127.0, out=scale)  # scale_b = absmax_b / 127, float32
            divisor = torch.where(scale == 0, 1.0, scale)  # an all-zero block (or one whose scale underflows)
            torch.div(x, divisor.unsqueeze(1), out=work)
            work.round_().clamp_(-127, 127)  # round half to even
            values[e0 : e0 + n].view(k, n // k).copy_(work)
        if self.num_blocks and not bool(torch.isfinite(scales).all()):
            raise self._non_finite(flat)
        return out

    def decode(self, payload: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        self._check(out, payload)
        scales, values = self._views(payload)
        for b0, k, e0, n in self._slices():
            torch.mul(
                values[e0 : e0 + n].view(k, n // k),
                scales[b0 : b0 + k].unsqueeze(1),
                out=out[e0 : e0 + n].view(k, n // k),
            )  # x̂ = q · scale_b, one fused pass
        return out


def make_codec(name: str, manifest: Manifest, block_size: int = DEFAULT_BLOCK_SIZE) -> WireCodec:
    """The codec ``name`` for ``manifest``.

    Args:
        name: one of ``WIRE_CODECS``; "" means "raw".
        manifest: the model's manifest (fixes N and, for raw, the per-parameter dtypes).
        block_size: int8 elements per absmax block (0 = ``DEFAULT_BLOCK_SIZE``); ignored
            by raw and bf16.
    Raises:
        InvalidPayloadError: an unknown name or a block size out of range.
    """
    name = name or "raw"
    if name == "raw":
        return RawCodec(manifest)
    if name == "bf16":
        return Bf16Codec(manifest)
    if name == "int8":
        return Int8Codec(manifest, block_size or DEFAULT_BLOCK_SIZE)
    raise InvalidPayloadError(f"wire codec {name!r} is unknown; choose one of {WIRE_CODECS}")


def codec_for(run_config, manifest: Manifest) -> WireCodec:
    """The codec a ``RunConfig`` (from JoinReply, PullHeader or Status) dictates."""
    return make_codec(run_config.wire_codec, manifest, run_config.codec_block_size)


def wire_bytes_for(run_config, manifest: Manifest) -> int:
    """Payload bytes of ``manifest`` under the codec a ``RunConfig`` dictates (what
    ``codec_for(...).wire_bytes`` says, without building the codec).

    Raises:
        InvalidPayloadError: an unknown codec name or block size.
    """
    name, block = run_config.wire_codec or "raw", run_config.codec_block_size or DEFAULT_BLOCK_SIZE
    if name == "raw":
        return manifest.total_bytes
    if name == "bf16":
        return 2 * manifest.numel
    if name == "int8" and 1 <= block <= MAX_BLOCK_SIZE:
        return 4 * -(-manifest.numel // block) + manifest.numel
    return make_codec(name, manifest, block).wire_bytes  # raises for a bad name or block size


class DecodeBuffers:
    """The server's fp32 (N,) buffers for decoded pseudo-gradients: at most ``limit`` out
    at once (``take`` waits for one to come back), reused across pushes (fresh
    whole-model allocations fault every page in again). Applies run one at a time,
    so two let one push decode while another applies; more would only add memory
    (each is 4·N bytes, four times an int8 payload). Thread-safe.

    Args:
        numel: N, elements per buffer.
        limit: most buffers out at once (>= 1).
    """

    def __init__(self, numel: int, limit: int = 2) -> None:
        self.numel = numel
        self.limit = limit
        self._free: list[torch.Tensor] = []
        self._out = 0
        self._cond = threading.Condition()

    def take(self) -> torch.Tensor:
        """A float32 (N,) buffer (contents undefined); waits while ``limit`` are out."""
        with self._cond:
            self._cond.wait_for(lambda: self._out < self.limit)
            self._out += 1
            if self._free:
                return self._free.pop()
        return torch.empty(self.numel, dtype=torch.float32)

    def give(self, buf: torch.Tensor) -> None:
        """Return a buffer from ``take`` once nothing reads it any more."""
        with self._cond:
            self._out -= 1
            self._free.append(buf)
            self._cond.notify()
