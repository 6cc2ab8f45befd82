"""The finiteness/magnitude check runs per chunk as each chunk lands (values.py
``ValueScan``, the assembler's ``watch``), with no pass over the payload after it: a
push that passes is never scanned again, and a bad one is still refused whole."""

from __future__ import annotations

import math

import pytest
import torch

import asyncdiloco.ps.push.value_check as value_check
from asyncdiloco.errors import InvalidPayloadError
from asyncdiloco.ps.config import ServerConfig
from asyncdiloco.ps.push.value_scan import ValueScan, largest_magnitude
from asyncdiloco.ps.state import ParameterServerState
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.grpc_chunks import WireChunk
from asyncdiloco.wire.tensors import Manifest, PayloadAssembler, chunk_views, crc32_of

pytestmark = pytest.mark.timeout(60)

NUMEL = 10_000
MANIFEST = Manifest.from_named_tensors([("w", torch.zeros(NUMEL))])


@pytest.mark.parametrize("bad", [None, math.nan, math.inf, -math.inf, -7.5])
@pytest.mark.parametrize("piece", [1, 3, 4, 4097, 40_000])
def test_scan_by_pieces_equals_one_pass(bad, piece):
    x = torch.linspace(-2, 3, NUMEL)
    if bad is not None:
        x[NUMEL // 2 + 1] = bad
    buffer = x.view(torch.uint8).clone()
    scan = ValueScan(buffer)
    for start in range(0, buffer.numel(), piece):
        assert scan.largest is None  # not all scanned yet
        scan(start, min(buffer.numel(), start + piece))
    want = largest_magnitude(x)
    got = scan.largest
    assert got is not None
    assert (math.isnan(got) and math.isnan(want)) or got == want


def test_scan_needs_whole_floats():
    with pytest.raises(ValueError, match="uint8"):
        ValueScan(torch.zeros(7, dtype=torch.uint8))


def test_assembler_calls_watch_per_chunk_in_order():
    payload = torch.arange(40_000, dtype=torch.uint8)
    seen = []
    asm = PayloadAssembler(total_bytes=40_000, num_chunks=4, crc32=crc32_of(payload), chunk_bytes=10_000)
    asm.watch = lambda s, e: seen.append((s, e, bytes(asm.buffer[s:e].numpy())))
    for index, offset, data in chunk_views(payload, 10_000):
        asm.add(WireChunk(index, offset, data))
    assert [(s, e) for s, e, _ in seen] == [(0, 10_000), (10_000, 20_000), (20_000, 30_000), (30_000, 40_000)]
    assert b"".join(b for _, _, b in seen) == payload.numpy().tobytes()


def _state() -> tuple[ParameterServerState, int]:
    state = ParameterServerState(ServerConfig(port=0, chunk_bytes=4096))
    wid, _, _ = state.join(MANIFEST, "w")
    state.intake.push(
        MANIFEST.pack([torch.zeros(NUMEL)]), worker_id=wid, push_id=1, kind=pb.PUSH_KIND_INITIAL_PARAMETERS
    )
    return state, wid


def test_a_passing_push_is_not_scanned_again_after_it_landed(monkeypatch):
    state, wid = _state()

    def whole_pass(x):  # the pass after the transfer that the per-chunk scan replaced
        raise AssertionError(f"a pass over {x.numel()} values after the push landed")

    monkeypatch.setattr(value_check, "largest_magnitude", whole_pass)
    reply = state.intake.push(MANIFEST.pack([torch.full((NUMEL,), 0.25)]), worker_id=wid, push_id=2, base_version=0)
    assert reply.applied and state.version == 1
    assert state.model.theta[0].item() != 0.0


def test_a_bad_chunk_still_refuses_the_whole_push_with_nothing_changed():
    state, wid = _state()
    theta = state.model.theta.clone()
    delta = torch.full((NUMEL,), 0.25)
    delta[NUMEL - 3] = math.nan  # in the last chunk: every chunk before it landed and was scanned
    with pytest.raises(InvalidPayloadError, match="1 non-finite values"):
        state.intake.push(MANIFEST.pack([delta]), worker_id=wid, push_id=2, base_version=0)
    assert state.version == 0 and torch.equal(state.model.theta, theta)
    delta[NUMEL - 3] = 1e30
    with pytest.raises(InvalidPayloadError, match="magnitude 1e\\+30"):
        state.intake.push(MANIFEST.pack([delta]), worker_id=wid, push_id=3, base_version=0)
    assert state.version == 0 and torch.equal(state.model.theta, theta)


def test_bulk_fill_calls_watch_per_slice():
    """The bulk channel's ``fill_with`` scans each slice as it lands, as ``add`` does per chunk."""
    x = torch.linspace(-1, 1, NUMEL)
    x[17] = -9.0
    payload = x.view(torch.uint8).clone()
    asm = PayloadAssembler(total_bytes=payload.numel(), num_chunks=10, crc32=crc32_of(payload), chunk_bytes=4096)
    ranges = []
    scan = ValueScan(asm.buffer)

    def watch(start: int, end: int) -> None:
        ranges.append((start, end))
        scan(start, end)

    asm.watch = watch
    src = payload.numpy().data
    pos = 0

    def readinto(view) -> int:
        nonlocal pos
        n = min(len(view), 3000, len(src) - pos)
        view[:n] = src[pos : pos + n]
        pos += n
        return n

    asm.fill_with(readinto, slice_bytes=10_000)
    assert ranges == [(s, min(40_000, s + 10_000)) for s in range(0, 40_000, 10_000)]
    assert scan.largest == 9.0
    assert torch.equal(asm.finish(), payload)


def test_non_finite_initial_parameters_are_refused_with_advice_about_the_model_not_the_learning_rate():
    state = ParameterServerState(ServerConfig(port=0, chunk_bytes=4096))
    wid, _, _ = state.join(MANIFEST, "w")
    bad = torch.zeros(NUMEL)
    bad[7] = float("nan")
    with pytest.raises(InvalidPayloadError) as refused:
        state.intake.push(MANIFEST.pack([bad]), worker_id=wid, push_id=1, kind=pb.PUSH_KIND_INITIAL_PARAMETERS)
    message = str(refused.value)
    assert "the initial parameters from worker" in message and "check its initialization" in message
    assert "learning rate" not in message and not state.initialized
