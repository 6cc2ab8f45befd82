"""The outer step and the next pull snapshot's copy fused in one pass per block
(snapshots.py ``step_and_encode``, buffers.py ``SnapshotBuilder``): while pulls come,
the snapshot of each new version is built block by block inside the outer step, its
bytes and CRC-32 are exactly θ's, and θ itself is bit-identical to a server without pulls."""

from __future__ import annotations

import pytest
import torch

from asyncdiloco.algo.config import OuterConfig
from asyncdiloco.algo.outer import STEP_BLOCK_ELEMS
from asyncdiloco.errors import InvalidPayloadError
from asyncdiloco.ps.buffers import SnapshotBuilder, encode_snapshot
from asyncdiloco.ps.config import ServerConfig
from asyncdiloco.ps.state import ParameterServerState
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.grpc_chunks import encode_chunk
from asyncdiloco.wire.tensors import Manifest, chunk_views, crc32_of

pytestmark = pytest.mark.timeout(60)

NUMEL = 2 * STEP_BLOCK_ELEMS + 77
MANIFEST = Manifest.from_named_tensors([("a", torch.zeros(NUMEL - 100)), ("b", torch.zeros(100))])
CHUNK = 100_003  # chunk edges fall inside blocks and inside elements


def _state(optimizer: str) -> tuple[ParameterServerState, int]:
    config = ServerConfig(port=0, chunk_bytes=CHUNK, outer=OuterConfig(optimizer=optimizer, dn_buffer=2))
    state = ParameterServerState(config)
    wid, _, _ = state.join(MANIFEST, "w")
    init = torch.linspace(-1, 1, NUMEL)
    state.push(MANIFEST.pack_flat(init), worker_id=wid, push_id=1, kind=pb.PUSH_KIND_INITIAL_PARAMETERS)
    return state, wid


@pytest.mark.parametrize("optimizer", ["nesterov", "sgd", "delayed_nesterov"])
def test_snapshot_built_in_the_step_equals_theta(optimizer, monkeypatch):
    pulled, wid = _state(optimizer)
    quiet, wid_q = _state(optimizer)
    hooks: list = []
    step = pulled.outer.step

    def spy(*args, **kwargs):
        hooks.append(kwargs.get("on_block"))
        return step(*args, **kwargs)

    monkeypatch.setattr(pulled.outer, "step", spy)
    gen = torch.Generator().manual_seed(1)
    for push_id in range(2, 6):
        delta = MANIFEST.pack_flat(torch.randn(NUMEL, generator=gen) * 0.01)
        for state, w in ((pulled, wid), (quiet, wid_q)):
            state.push(delta.clone(), worker_id=w, push_id=push_id, base_version=state.version)
        snap = pulled.acquire_snapshot()  # a pull: the next apply builds its version's snapshot
        pulled.release_snapshot(snap)
        assert snap.version == pulled.version
        payload = b"".join(bytes(v) for v in snap.data_views())
        assert payload == pulled.model.theta.numpy().tobytes()
        assert snap.crc32 == crc32_of(pulled.model.theta.view(torch.uint8))
        assert torch.equal(pulled.model.theta, quiet.model.theta)
    assert hooks[0] is None and all(h is not None for h in hooks[1:])  # fused from the first push after a pull


def test_builder_matches_the_encoder_for_any_piece_size():
    payload = torch.randint(0, 256, (1_000_003,), dtype=torch.uint8)
    ref = [encode_chunk(i, o, d) for i, o, d in chunk_views(payload, CHUNK)]
    raw = payload.numpy().data
    for piece in (1, 4096, CHUNK, CHUNK + 1, len(raw)):
        builder = SnapshotBuilder(7, len(raw), CHUNK)
        for start in range(0, len(raw), piece if piece > 1 else 333_333):
            builder.feed(raw[start : start + (piece if piece > 1 else 333_333)])
        snap = builder.finish()
        assert list(snap.messages) == ref and all(type(m) is bytes for m in snap.messages)
        assert snap.crc32 == crc32_of(payload) and snap.version == 7
    assert encode_snapshot(7, payload, CHUNK).messages == tuple(ref)


def test_builder_refuses_too_many_or_too_few_bytes():
    builder = SnapshotBuilder(1, 10, 4)
    builder.feed(memoryview(b"123456"))
    with pytest.raises(InvalidPayloadError, match="fed 6 of 10 bytes"):
        builder.finish()
    with pytest.raises(InvalidPayloadError, match="fed 12 bytes; the payload is 10"):
        builder.feed(memoryview(b"123456"))
    with pytest.raises(InvalidPayloadError, match="chunk_bytes is 0"):
        SnapshotBuilder(1, 10, 0)
