"""The hand-coded chunk messages (wire.py) against the generated protobuf code, the
receive-buffer pool and the snapshot encoding (ps/pull/encoded.py), and the lock split
(an apply in progress blocks neither bookkeeping calls nor pulls)."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncdiloco.algo.config import OuterConfig
from asyncdiloco.errors import ServerBusyError
from asyncdiloco.ps.config import ServerConfig
from asyncdiloco.ps.pull.encoded import PullSnapshots, encode_snapshot
from asyncdiloco.ps.pull.receive_pool import ReceivePool
from asyncdiloco.ps.state import ParameterServerState
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.channel import MAX_FRAME_BYTES, grpc_channel_options
from asyncdiloco.wire.grpc_chunks import (
    WireChunk,
    _handlers,
    decode_pull_message,
    decode_push_message,
    decode_push_request,
    encode_chunk,
    encode_push_request,
    push_request_bytes,
    serialize_message,
)
from asyncdiloco.wire.tensors import Manifest, crc32_of

pytestmark = pytest.mark.timeout(60)
int64s = st.integers(min_value=-(2**63), max_value=2**63 - 1)


@settings(max_examples=300, deadline=None)
@given(index=int64s, offset=int64s, data=st.binary(max_size=300))
def test_encode_chunk_is_byte_identical_to_protobuf(index, offset, data):
    expected_push = pb.PushMessage(chunk=pb.PayloadChunk(index=index, offset=offset, data=data)).SerializeToString()
    expected_pull = pb.PullMessage(chunk=pb.PayloadChunk(index=index, offset=offset, data=data)).SerializeToString()
    got = encode_chunk(index, offset, memoryview(data))
    assert got == expected_push == expected_pull


@settings(max_examples=300, deadline=None)
@given(index=int64s, offset=int64s, data=st.binary(max_size=300))
def test_decode_reads_what_protobuf_writes(index, offset, data):
    raw = pb.PushMessage(chunk=pb.PayloadChunk(index=index, offset=offset, data=data)).SerializeToString()
    for decode in (decode_push_message, decode_pull_message):
        got = decode(raw)
        assert isinstance(got, WireChunk)
        assert (got.index, got.offset, bytes(got.data)) == (index, offset, data)


def test_headers_and_odd_messages_go_through_protobuf():
    header = pb.PushMessage(header=pb.PushHeader(worker_id=3, push_id=9))
    got = decode_push_message(header.SerializeToString())
    assert isinstance(got, pb.PushMessage) and got.header.push_id == 9
    pull_header = pb.PullMessage(header=pb.PullHeader(version=4))
    assert decode_pull_message(pull_header.SerializeToString()).header.version == 4
    # an unknown field inside the chunk: protobuf keeps the fields it knows
    chunk = pb.PayloadChunk(index=2, offset=8, data=b"abcd").SerializeToString() + b"\x20\x05"
    raw = b"\x12" + bytes([len(chunk)]) + chunk
    got = decode_push_message(raw)
    assert isinstance(got, pb.PushMessage) and got.chunk.data == b"abcd"
    # a repeated scalar: the last one wins, as in protobuf
    raw = encode_chunk(1, 0, memoryview(b"x"))
    body = b"\x08\x01\x08\x07\x1a\x01x"
    raw = b"\x12" + bytes([len(body)]) + body
    assert decode_push_message(raw).index == pb.PushMessage.FromString(raw).chunk.index == 7
    # truncated bytes fail exactly as protobuf fails: a DecodeError
    with pytest.raises(DecodeError):
        decode_push_message(encode_chunk(1, 4, memoryview(b"abcdef"))[:-3])
    with pytest.raises(DecodeError):
        pb.PushMessage.FromString(encode_chunk(1, 4, memoryview(b"abcdef"))[:-3])


_headers = st.builds(
    pb.PushHeader,
    worker_id=int64s,
    push_id=int64s,
    base_version=int64s,
    total_bytes=int64s,
    num_chunks=int64s,
    crc32=st.integers(0, 2**32 - 1),
    kind=st.sampled_from([0, 1, 2, 3]),
    compute_s=st.floats(allow_nan=False),
    last=st.booleans(),
    header_crc32=st.integers(0, 2**32 - 1),
)


@settings(max_examples=300, deadline=None)
@given(header=_headers, data=st.binary(max_size=300))
def test_a_push_request_is_byte_identical_to_protobuf_and_decodes_to_a_view(header, data):
    chunk = pb.PayloadChunk(index=0, offset=0, data=data) if data else None
    expected = pb.PushRequest(header=header, chunk=chunk).SerializeToString()
    raw = encode_push_request(header, memoryview(data))
    assert raw == expected
    got = decode_push_request(raw)
    assert got.header == header
    if data:
        assert isinstance(got.chunk, WireChunk) and (got.chunk.index, got.chunk.offset) == (0, 0)
        assert bytes(got.chunk.data) == data and got.chunk.data.obj is raw  # a view, not a copy
    else:
        assert got.chunk is None


def test_a_push_request_from_a_tensor_and_odd_requests_go_through_protobuf():
    payload = torch.arange(10, dtype=torch.uint8)
    header = pb.PushHeader(worker_id=2, push_id=5, total_bytes=10, num_chunks=1)
    raw = push_request_bytes(header, payload)
    assert raw == pb.PushRequest(header=header, chunk=pb.PayloadChunk(data=bytes(range(10)))).SerializeToString()
    # the chunk before the header, an unknown field, no header: protobuf parses them
    swapped = pb.PayloadChunk(data=b"ab").SerializeToString()
    odd = b"\x12" + bytes([len(swapped)]) + swapped + pb.PushRequest(header=header).SerializeToString()
    got = decode_push_request(odd)
    assert got.header == header and bytes(got.chunk.data) == b"ab" and not isinstance(got.chunk, WireChunk)
    got = decode_push_request(raw + b"\x18\x01")
    assert got.header == header and bytes(got.chunk.data) == bytes(range(10))
    assert decode_push_request(pb.PushRequest(chunk=pb.PayloadChunk(data=b"a")).SerializeToString()).header is None
    with pytest.raises(DecodeError):
        decode_push_request(raw[:-3])


def test_serializer_passes_bytes_and_serializes_messages():
    msg = pb.PullMessage(header=pb.PullHeader(version=2))
    assert serialize_message(msg) == msg.SerializeToString()
    raw = encode_chunk(0, 0, memoryview(b"abc"))
    assert serialize_message(raw) is raw


def test_every_rpc_of_the_service_is_registered():
    service = pb.DESCRIPTOR.services_by_name["ParameterServer"]
    assert set(_handlers(object.__new__(_Servicer))) == {m.name for m in service.methods}


class _Servicer:
    def __getattr__(self, name):
        return lambda *a: None


# ------------------------------------------------------------------ pool
def test_pool_stays_within_its_budget_and_reuses_buffers():
    pool = ReceivePool(budget_bytes=100)
    a = pool.acquire(40, timeout_s=1)
    b = pool.acquire(40, timeout_s=1)
    with pytest.raises(ServerBusyError, match="receive budget of 100 bytes"):
        pool.acquire(40, timeout_s=0.01)
    pool.release(a)
    c = pool.acquire(40, timeout_s=1)
    assert c.data_ptr() == a.data_ptr()  # reused, not reallocated
    pool.release(b)
    pool.release(c)
    assert pool.peak_in_use == 2


def test_pool_frees_kept_buffers_of_another_size_beyond_its_budget():
    """An encoded run's initial parameters arrive raw (twice a bf16 push's size): their
    kept buffer must not stay beside the pushes' ones, beyond the budget, for good."""
    pool = ReceivePool(budget_bytes=100)
    pool.release(pool.acquire(100, timeout_s=1))  # the raw initial parameters' buffer, kept
    assert pool._free_bytes == 100
    half = pool.acquire(50, timeout_s=1)  # a bf16 push: 50 out + 100 kept > 100
    assert pool._free_bytes == 0 and 100 not in pool._free
    pool.release(half)
    assert pool._free_bytes == 50 and pool.acquire(50, timeout_s=1).data_ptr() == half.data_ptr()


def test_pool_holds_a_buffer_past_its_release_until_the_hold_ends():
    pool = ReceivePool(budget_bytes=100)
    buffer = pool.acquire(100, timeout_s=1)
    release = pool.hold(buffer[10:20])  # a view into it keeps the whole buffer
    assert release is not None and pool.hold(torch.zeros(4)) is None
    pool.release(buffer)  # the push is done; a pull still reads the old version in it
    assert pool._in_use_bytes == 100
    with pytest.raises(ServerBusyError):
        pool.acquire(100, timeout_s=0.01)
    release()
    assert pool._in_use_bytes == 0 and pool.acquire(100, timeout_s=1).data_ptr() == buffer.data_ptr()


def test_pool_always_admits_one_push_larger_than_the_budget():
    pool = ReceivePool(budget_bytes=0)
    big = pool.acquire(1000, timeout_s=1)
    waiter_got = []
    t = threading.Thread(target=lambda: waiter_got.append(pool.acquire(1000, timeout_s=10)))
    t.start()
    t.join(0.05)
    assert not waiter_got  # the second waits for the first
    pool.release(big)
    t.join(10)
    assert waiter_got and waiter_got[0].numel() == 1000


def test_snapshot_messages_are_the_pull_stream():
    payload = torch.arange(1000, dtype=torch.float32).view(torch.uint8)
    snap = encode_snapshot(7, payload, chunk_bytes=1024)
    assert snap.total_bytes == 4000 and snap.crc32 == crc32_of(payload)
    decoded = [decode_pull_message(m) for m in snap.messages]
    assert [c.offset for c in decoded] == [0, 1024, 2048, 3072]
    assert b"".join(bytes(c.data) for c in decoded) == bytes(payload.numpy())
    assert b"".join(bytes(v) for v in snap.data_views()) == bytes(payload.numpy())


# ------------------------------------------------------------------ locks
def _state_with_model(n=64, wire_codec="raw"):
    outer = OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0)
    state = ParameterServerState(ServerConfig(port=0, outer=outer, wire_codec=wire_codec))
    manifest = Manifest.from_named_tensors([("w", torch.zeros(n))])
    wid, initialize, _ = state.join(manifest, "w1")
    assert initialize
    state.intake.push(torch.ones(n).view(torch.uint8), worker_id=wid, push_id=1, kind=pb.PUSH_KIND_INITIAL_PARAMETERS)
    return state, wid, n


def test_bookkeeping_and_pulls_do_not_wait_for_an_apply():
    state, wid, n = _state_with_model()
    state.snapshots.release(state.snapshots.acquire())  # a pull: later applies encode the next snapshot
    state.intake.push(torch.full((n,), 0.5).view(torch.uint8), worker_id=wid, push_id=2, base_version=0)
    assert state.version == 1
    with state.locks.apply:  # as if an apply were running: these must not need it
        snap = state.snapshots.acquire()
        assert snap.version == 1
        assert torch.equal(
            torch.frombuffer(bytearray(b"".join(snap.data_views())), dtype=torch.float32), torch.full((n,), 0.5)
        )
        state.snapshots.release(snap)
        state.heartbeat(wid)
        state.status()
        state.join(Manifest.from_named_tensors([("w", torch.zeros(n))]), "w2")


def test_refused_push_returns_its_buffer_and_changes_nothing():
    state, wid, n = _state_with_model()
    before = (state.params.clone(), state.version, state.counters.applied_pushes)
    bad = torch.full((n,), float("nan")).view(torch.uint8)
    for push_id in range(2, 6):  # more refusals than the pool could hold buffers for
        with pytest.raises(Exception, match="non-finite"):
            state.intake.push(bad, worker_id=wid, push_id=push_id, base_version=0)
    assert torch.equal(state.params, before[0]) and (state.version, state.counters.applied_pushes) == before[1:]
    assert state.intake.pool._in_use == 0


def test_at_most_pull_snapshots_versions_are_kept_for_pulls(monkeypatch):
    """An encoded model's pulls are served snapshots (a raw fp32 one's read θ in place:
    test_live_pulls.py)."""
    state, wid, n = _state_with_model(wire_codec="bf16")
    state.config = dataclasses.replace(state.config)  # frozen config untouched; the limit is the store's
    state.snapshots.slots.max_snapshots = 2
    delta = torch.full((n,), 0.25).to(torch.bfloat16).view(torch.uint8)
    first = state.snapshots.acquire()  # version 0, still being pulled
    state.intake.push(delta, worker_id=wid, push_id=2, base_version=0)  # room: {v0} + 1 <= 2, encoded at once
    second = state.snapshots.acquire()
    assert (first.version, second.version) == (0, 1)
    state.intake.push(delta, worker_id=wid, push_id=3, base_version=1)  # no room: v0 and v1 are being read
    monkeypatch.setattr(state.snapshots, "wait_s", 0.05)
    stale = state.snapshots.acquire()  # the wait runs out: the newest there is, version 1
    assert stale.version == 1
    state.snapshots.release(stale)
    freed = threading.Timer(0.05, state.snapshots.release, args=(first,))
    freed.start()
    monkeypatch.setattr(state.snapshots, "wait_s", 10.0)
    third = state.snapshots.acquire()  # waits until the pull of version 0 ends, then encodes v2
    freed.join()
    assert third.version == 2
    payload = torch.frombuffer(bytearray(b"".join(third.data_views())), dtype=torch.bfloat16)
    assert torch.equal(payload.float(), state.params)
    for s in (second, third):
        state.snapshots.release(s)
    assert state.snapshots.slots._reading_versions() == 0


def test_a_stalled_pull_stops_holding_a_snapshot_slot_after_the_lease():
    now = [0.0]
    snaps = PullSnapshots(max_snapshots=1, stale_after_s=60.0, clock=lambda: now[0])
    payload = torch.zeros(8, dtype=torch.uint8)
    snaps.publish(encode_snapshot(0, payload, 1024), acquire=True)  # a pull of v0 that never ends
    assert not snaps.has_room()
    now[0] = 61.0
    assert snaps.has_room()  # the stalled reader no longer blocks a newer version


def test_a_push_waiting_for_a_buffer_stops_when_its_rpc_ends():
    pool = ReceivePool(budget_bytes=0)
    held = pool.acquire(100)
    active = [True]
    t = threading.Timer(0.1, lambda: active.__setitem__(0, False))
    t.start()
    with pytest.raises(ServerBusyError, match="ended"):
        pool.acquire(100, timeout_s=30, is_active=lambda: active[0])
    t.join()
    pool.release(held)
    assert pool._in_use == 0


def test_the_pool_ignores_buffers_it_did_not_hand_out_or_already_took_back():
    pool = ReceivePool(budget_bytes=100)
    a = pool.acquire(40)
    pool.release(torch.empty(40, dtype=torch.uint8))  # not the pool's (a round result's own buffer)
    assert pool._in_use == 1
    pool.release(a)
    pool.release(a)  # twice: the second is ignored
    assert pool._in_use == 0 and pool._in_use_bytes == 0


def test_both_ends_take_http2_frames_of_a_mebibyte():
    """A 4 MB chunk crosses HTTP/2 in 4 frames, not 256 of 16 KiB (wire/channel.py); gRPC
    accepts frames of 16 KiB up to 16 MiB - 1."""
    options = dict(grpc_channel_options(4 << 20))
    assert options["grpc.http2.max_frame_size"] == MAX_FRAME_BYTES == 1 << 20
    assert 16 * 1024 <= MAX_FRAME_BYTES <= (1 << 24) - 1
