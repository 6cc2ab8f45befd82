"""The chunk codec: round trips (hypothesis) and refusals of malformed streams."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncdiloco.errors import InvalidPayloadError, ManifestMismatchError, PayloadTooLargeError
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.tensors import Manifest, PayloadAssembler, crc32_of, iter_chunks, num_chunks_for

DTYPES = [torch.float32, torch.bfloat16, torch.float16]

shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)  # includes () and empty dims


@st.composite
def tensors(draw):
    shape = draw(shapes)
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**31 - 1))
    t = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    if draw(st.booleans()) and t.dim() >= 2:
        t = t.transpose(0, 1)  # non-contiguous
    elif draw(st.booleans()) and t.dim() == 1 and t.numel() >= 2:
        t = t[::2]  # strided
    return t


def bits(t):
    dense = torch.empty(t.numel(), dtype=t.dtype)
    dense.copy_(t.reshape(-1))  # a size-1 dim may keep a stride ≠ 1 through .contiguous()
    return dense.view(torch.uint8)


def roundtrip(ts, chunk_bytes):
    manifest = Manifest.from_named_tensors([(f"p{i}", t) for i, t in enumerate(ts)])
    payload = manifest.pack(ts)
    asm = PayloadAssembler(
        total_bytes=manifest.total_bytes,
        num_chunks=num_chunks_for(manifest.total_bytes, chunk_bytes),
        crc32=crc32_of(payload),
        chunk_bytes=chunk_bytes,
    )
    chunks = list(iter_chunks(payload, chunk_bytes))
    assert all(len(c.data) <= chunk_bytes for c in chunks)
    for c in chunks:
        asm.add(c)
    return manifest, manifest.unpack(asm.finish())


@settings(max_examples=200, deadline=None)
@given(ts=st.lists(tensors(), min_size=0, max_size=5), chunk_bytes=st.integers(1, 64))
def test_roundtrip_is_bit_exact(ts, chunk_bytes):
    manifest, out = roundtrip(ts, chunk_bytes)
    assert len(out) == len(ts)
    for a, b in zip(ts, out):
        assert b.dtype == a.dtype and b.shape == a.shape
        assert torch.equal(bits(a), bits(b))  # bit-exact, NaN-safe


def test_misaligned_and_strided_size_one_tensors():
    # a bf16 tensor of odd length puts the next fp32 tensor at an offset ≡ 2 (mod 4),
    # and t[::2] of a length-2 tensor is "contiguous" with stride 2
    ts = [torch.randn(7).to(torch.bfloat16), torch.randn(3, 2).t(), torch.randn(2)[::2], torch.tensor(2.5)]
    manifest, out = roundtrip(ts, chunk_bytes=5)
    for a, b in zip(ts, out):
        assert torch.equal(bits(a), bits(b))
    assert torch.equal(manifest.pack_flat(manifest.unpack_flat(manifest.pack(ts)).clone()), manifest.pack(ts))


@pytest.mark.parametrize("extra", [-1, 0, 1])
def test_sizes_at_and_across_the_chunk_boundary(extra):
    chunk_bytes = 16
    t = torch.arange((chunk_bytes * 3 + extra * 4) // 4, dtype=torch.float32)
    manifest, (out,) = roundtrip([t], chunk_bytes)
    assert torch.equal(out, t)
    assert num_chunks_for(manifest.total_bytes, chunk_bytes) == (3 if extra <= 0 else 4)


@settings(max_examples=50, deadline=None)
@given(ts=st.lists(tensors(), min_size=1, max_size=4))
def test_flat_fp32_roundtrip(ts):
    manifest = Manifest.from_named_tensors([(f"p{i}", t) for i, t in enumerate(ts)])
    payload = manifest.pack(ts)
    flat = manifest.unpack_flat(payload)
    assert flat.dtype == torch.float32 and flat.numel() == manifest.numel
    assert torch.equal(manifest.pack_flat(flat.clone()), payload)


def _stream(n_bytes=40, chunk_bytes=16):
    payload = torch.arange(n_bytes, dtype=torch.uint8)
    return payload, list(iter_chunks(payload, chunk_bytes)), chunk_bytes


def _assembler(payload, chunk_bytes, **over):
    kw = dict(
        total_bytes=payload.numel(),
        num_chunks=num_chunks_for(payload.numel(), chunk_bytes),
        crc32=crc32_of(payload),
        chunk_bytes=chunk_bytes,
    )
    kw.update(over)
    return PayloadAssembler(**kw)


def test_out_of_order_chunk_refused():
    payload, chunks, cb = _stream()
    asm = _assembler(payload, cb)
    with pytest.raises(InvalidPayloadError, match="out of order: got index 1 at offset 16, expected index 0"):
        asm.add(chunks[1])


def test_missing_chunk_refused():
    payload, chunks, cb = _stream()
    asm = _assembler(payload, cb)
    for c in chunks[:-1]:
        asm.add(c)
    with pytest.raises(InvalidPayloadError, match="stream ended after 2 of 3 chunks"):
        asm.finish()


def test_extra_chunk_refused():
    payload, chunks, cb = _stream()
    asm = _assembler(payload, cb)
    for c in chunks:
        asm.add(c)
    with pytest.raises(InvalidPayloadError, match="after all 3 announced chunks"):
        asm.add(pb.PayloadChunk(index=3, offset=40, data=b"x"))


def test_oversized_chunk_refused():
    payload, _, cb = _stream()
    asm = _assembler(payload, cb)
    with pytest.raises(PayloadTooLargeError, match="limit is chunk_bytes=16"):
        asm.add(pb.PayloadChunk(index=0, offset=0, data=bytes(17)))


def test_corrupted_payload_refused_by_crc():
    payload, chunks, cb = _stream()
    asm = _assembler(payload, cb)
    bad = pb.PayloadChunk(index=0, offset=0, data=bytes(16))
    asm.add(bad)
    for c in chunks[1:]:
        asm.add(c)
    with pytest.raises(InvalidPayloadError, match="CRC-32"):
        asm.finish()


def test_wrong_chunk_count_and_size_limit_refused_up_front():
    payload, _, cb = _stream()
    with pytest.raises(InvalidPayloadError, match="num_chunks is 2; a payload of 40 bytes"):
        _assembler(payload, cb, num_chunks=2)
    with pytest.raises(PayloadTooLargeError, match="exceeds the limit of 39 bytes"):
        _assembler(payload, cb, max_bytes=39)


def test_manifest_first_difference_names_the_parameter():
    server = Manifest.from_named_tensors([("a", torch.zeros(2, 3)), ("b", torch.zeros(4))])
    worker = Manifest.from_named_tensors([("a", torch.zeros(2, 3)), ("b", torch.zeros(5))])
    with pytest.raises(ManifestMismatchError, match=r"parameter #1 'b': shape is \(5,\) on the worker but \(4,\)"):
        worker.check_same(server)
    shorter = Manifest.from_named_tensors([("a", torch.zeros(2, 3))])
    assert "1 parameters, the server 2" in shorter.first_difference(server)
    assert server.first_difference(server) is None


def test_manifest_proto_roundtrip_and_hash_check():
    m = Manifest.from_named_tensors([("w", torch.zeros(3, dtype=torch.bfloat16)), ("s", torch.zeros(()))])
    assert Manifest.from_proto(m.to_proto()) == m
    msg = m.to_proto()
    msg.manifest_hash = "0" * 64
    with pytest.raises(InvalidPayloadError, match="does not match its tensors"):
        Manifest.from_proto(msg)


def test_unsupported_dtype_refused():
    with pytest.raises(InvalidPayloadError, match="dtype torch.float64"):
        Manifest.from_named_tensors([("x", torch.zeros(2, dtype=torch.float64))])


def test_the_payload_crc32_is_zlibs_whichever_implementation_is_installed():
    import zlib

    from asyncdiloco.wire.tensors import _crc32

    data = torch.randint(0, 256, (3 * 1024 * 1024 + 7,), dtype=torch.uint8)
    view = memoryview(data.numpy())
    assert crc32_of(data) == zlib.crc32(view)
    assert _crc32(view[5:1001], 12345) == zlib.crc32(view[5:1001], 12345)  # chained, unaligned
    assert _crc32(b"") == zlib.crc32(b"") == 0


def test_fill_with_reads_a_stream_and_keeps_the_size_and_crc_checks():
    import io

    payload = torch.randint(0, 256, (1000,), dtype=torch.uint8)
    for crc, ok in ((crc32_of(payload), True), (crc32_of(payload) ^ 1, False)):
        stream = io.BytesIO(payload.numpy().tobytes())
        asm = PayloadAssembler(total_bytes=1000, num_chunks=num_chunks_for(1000, 64), crc32=crc, chunk_bytes=64)
        asm.fill_with(stream.readinto, slice_bytes=300)
        if ok:
            assert torch.equal(asm.finish(), payload)
        else:
            with pytest.raises(InvalidPayloadError, match="CRC-32"):
                asm.finish()
    short = PayloadAssembler(total_bytes=1000, num_chunks=16, crc32=0, chunk_bytes=64)
    with pytest.raises(InvalidPayloadError, match="stream ended after 999 of 1000"):
        short.fill_with(io.BytesIO(bytes(999)).readinto)
