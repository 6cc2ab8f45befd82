"""The wire codec the server dictates for a worker's pushes and pulls (``RunConfig.wire_codec``,
wire/codec.py) and their reusable payload buffers (docs/protocol.md, "Codecs")."""

from __future__ import annotations

import logging

import torch

from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.codec import WireCodec, codec_for, make_codec
from asyncdiloco.wire.tensors import Manifest
from asyncdiloco.worker.flat import FlatParams

log = logging.getLogger(__name__)


class WorkerWire:
    """One worker's wire codec (raw until the server says otherwise) and its ``"push"`` and
    ``"pull"`` payload buffers: uint8 (codec.wire_bytes,), pinned when the model is on CUDA,
    made on first use and remade when the codec's size changes."""

    def __init__(self, manifest: Manifest, flat: FlatParams) -> None:
        self.manifest, self.flat = manifest, flat
        self.codec: WireCodec = make_codec("raw", manifest)
        self._buffers: dict[str, torch.Tensor] = {}

    def adopt(self, run_config: pb.RunConfig) -> None:
        """Use the wire codec ``run_config`` dictates; the buffers follow its size."""
        codec = codec_for(run_config, self.manifest)
        if (codec.name, codec.wire_bytes) != (self.codec.name, self.codec.wire_bytes):
            log.info(
                "wire codec %s: %d bytes per push/pull (raw: %d)",
                codec.describe(),
                codec.wire_bytes,
                self.manifest.total_bytes,
            )
            self.codec = codec
            self._buffers.clear()

    def buffer(self, which: str) -> torch.Tensor:
        """The reusable ``"push"`` or ``"pull"`` payload buffer."""
        if which not in self._buffers:
            self._buffers[which] = self.flat.host_buffer(self.codec.wire_bytes, dtype=torch.uint8)
        return self._buffers[which]

    def encode(self, delta: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Encode a pseudo-gradient Δ = θ_base − θ_local (float32 (N,) CPU) into ``out``
        (default: the push buffer, which the next call overwrites); returns the payload.

        Raises:
            InvalidPayloadError: Δ holds values the codec cannot represent.
        """
        return self.codec.encode(delta, self.buffer("push") if out is None else out)

    def decode(self, payload: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Decode a push payload (what the server received) or a pulled one into ``out``,
        float32 (N,) CPU; returns ``out``."""
        return self.codec.decode(payload, out)
