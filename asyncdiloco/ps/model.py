"""The global model on the server: θ (float32, (N,), manifest order), the outer optimizer and
its state, the version V, the manifest and the run's wire codec. θ changes under the
``apply`` lock, ``version`` and ``manifest`` under ``books``; callers take them.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

from asyncdiloco.algo.outer import BlockDelta, OuterOptimizer, make_outer_optimizer
from asyncdiloco.ps.config import ServerConfig
from asyncdiloco.wire.codec import Bf16Codec, DecodeBuffers, WireCodec, make_codec
from asyncdiloco.wire.tensors import Manifest

log = logging.getLogger(__name__)

#: Names of the outer optimizer's state vectors in checkpoints, and their attributes.
OUTER_BUFFERS = (("momentum", "momentum_buffer"), ("dn_delta", "delta_buffer"))


class GlobalModel:
    """θ, the outer optimizer, the version and the manifest (see the module docstring).

    Args:
        config: the outer optimizer, the wire codec and its block size.
    """

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        #: The workers' model layout; provisional until the initial parameters arrive.
        self.manifest: Manifest | None = None
        #: θ, float32 (N,); None until a worker pushed the initial parameters.
        self.params: torch.Tensor | None = None
        self.outer: OuterOptimizer | None = None
        #: V: pseudo-gradients applied (async) or rounds committed (sync).
        self.version = 0
        self._codec: WireCodec | None = None
        self._decode_buffers: DecodeBuffers | None = None
        self._pack_scratch: torch.Tensor | None = None  # θ packed to the wire layout

    @property
    def initialized(self) -> bool:
        """True once a worker pushed the initial parameters."""
        return self.params is not None

    @property
    def known_manifest(self) -> Manifest:
        """The manifest, where one must exist (a worker joined)."""
        assert self.manifest is not None, "no worker has joined yet"
        return self.manifest

    @property
    def theta(self) -> torch.Tensor:
        """θ, float32 (N,), where the model must be initialized."""
        assert self.params is not None, "the global model is not initialized"
        return self.params

    @property
    def optimizer(self) -> OuterOptimizer:
        """The outer optimizer, where the model must be initialized."""
        assert self.outer is not None, "the global model is not initialized"
        return self.outer

    # ------------------------------------------------------------- wire codec
    def wire_codec(self) -> WireCodec:
        """The run's wire codec for the current manifest (rebuilt if the provisional
        manifest was replaced). Its decode is thread-safe; its encode is used only by the
        snapshot builder, one at a time."""
        codec = self._codec
        if codec is None or codec.manifest is not self.manifest:
            codec = make_codec(self.config.wire_codec, self.known_manifest, self.config.codec_block_size)
            self._decode_buffers = DecodeBuffers(codec.numel)
            self._codec = codec
        return codec

    def pseudo_gradient_bytes(self) -> tuple[int, str]:
        """(bytes, how they are laid out) of a pseudo-gradient push's payload."""
        manifest = self.known_manifest
        if self.config.wire_codec == "raw":
            return manifest.total_bytes, "(see the manifest from Join)"
        codec = self.wire_codec()
        return codec.wire_bytes, (
            f"encoded with this run's wire codec {codec.describe()} (raw: {manifest.total_bytes} "
            f"bytes); encode pushes with the codec in RunConfig.wire_codec from Join"
        )

    @contextlib.contextmanager
    def decoded_pseudo_gradient(self, payload: torch.Tensor) -> Iterator[torch.Tensor]:
        """Δ, float32 (N,), of a pseudo-gradient payload (uint8, the wire codec's layout):
        a view of the payload for raw fp32 models, else decoded into one of at most two
        pooled buffers (memory stays bounded), given back when the block ends."""
        manifest = self.known_manifest
        if self.config.wire_codec == "raw" and manifest.all_float32:
            yield manifest.unpack_flat(payload)  # a view
            return
        codec = self.wire_codec()
        assert self._decode_buffers is not None
        buffers = self._decode_buffers
        buffer = buffers.take()
        try:
            yield codec.decode(payload, buffer)  # (N,) fp32
        finally:
            buffers.give(buffer)

    def pseudo_gradient_blocks(self, payload: torch.Tensor) -> tuple[BlockDelta, torch.Tensor] | None:
        """For a bf16 run on a CPU θ: (Δ decoded block by block inside the outer step,
        its values as bf16 (N,) for the value check), so no fp32 (N,) decode buffer is
        taken; None for the other codecs (``decoded_pseudo_gradient``)."""
        codec = self.wire_codec()
        if not isinstance(codec, Bf16Codec) or self.theta.device.type != "cpu":
            return None
        values = codec.values(payload)

        def decode(start: int, end: int, out: torch.Tensor) -> torch.Tensor:
            return out.copy_(values[start:end])  # exact: every bf16 value is an fp32 value

        return BlockDelta(codec.numel, decode), values

    def pulls_raw_theta(self) -> bool:
        """True when a pull's payload is θ's own bytes (raw codec, every tensor fp32)."""
        return self.config.wire_codec == "raw" and self.manifest is not None and self.manifest.all_float32

    def pull_payload(self) -> torch.Tensor:
        """θ in the wire layout, uint8: a view of θ for raw fp32 models, else encoded into
        a reused buffer (raw: the manifest's dtypes). ``apply`` lock held."""
        theta = self.theta
        if self.pulls_raw_theta():
            return theta.view(torch.uint8)  # no intermediate copy
        codec = self.wire_codec()
        if self._pack_scratch is None or self._pack_scratch.numel() != codec.wire_bytes:
            self._pack_scratch = torch.empty(codec.wire_bytes, dtype=torch.uint8)
        return codec.encode(theta, self._pack_scratch)

    # ------------------------------------------------------------ outer steps
    def initialize(self, delta: torch.Tensor, worker_id: int) -> None:
        """The initial parameters (float32 (N,)) become θ; a fresh outer optimizer
        (``apply`` lock held)."""
        params = delta.clone()
        outer = make_outer_optimizer(params, self.config.outer, self.known_manifest.block_sizes())
        self.params, self.outer = params, outer
        log.info("global model initialized by worker %d (%d parameters)", worker_id, delta.numel())

    def outer_buffers(self) -> dict[str, torch.Tensor]:
        """The outer optimizer's state vectors, flat fp32 (N,) each, by checkpoint name:
        m (``momentum``) and, for Delayed Nesterov, the arrival buffer b (``dn_delta``)."""
        out = {}
        for kind, attr in OUTER_BUFFERS:
            vec = getattr(self.outer, attr, None)
            if vec is not None:
                out[kind] = vec
        return out
