"""Pulls of a raw fp32 model read θ in place (ps/pull/live_view.py ``LiveView``): no copy of θ per
version. Before θ changes, the version being read moves into the pushed Δ's receive
buffer block by block as the outer step goes (``begin_swap``), or is copied (the other
paths), so every pull gets exactly the bytes and CRC-32 of the version its header names,
however its reads interleave with applies; θ itself stays bit-identical to a server
without pulls, and the receive budget bounds what the old versions hold. Also: the
encoded snapshots' builder (buffers.py ``SnapshotBuilder``), used for encoded models."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import STUCK_S, FakeClock

from asyncdiloco.algo.config import OuterConfig
from asyncdiloco.algo.outer import STEP_BLOCK_ELEMS
from asyncdiloco.errors import InvalidPayloadError, ServerBusyError
from asyncdiloco.ps.config import ServerConfig
from asyncdiloco.ps.pull.encoded import SnapshotBuilder, encode_snapshot
from asyncdiloco.ps.pull.live_view import LiveView
from asyncdiloco.ps.pull.receive_pool import ReceivePool
from asyncdiloco.ps.state import ParameterServerState
from asyncdiloco.ps.sync.quorum import CommittedRound
from asyncdiloco.ps.tier.rebase import rebase_onto
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.grpc_chunks import decode_pull_message, encode_chunk
from asyncdiloco.wire.tensors import Manifest, chunk_views, crc32_of

pytestmark = pytest.mark.timeout(60)

NUMEL = 2 * STEP_BLOCK_ELEMS + 77
MANIFEST = Manifest.from_named_tensors([("a", torch.zeros(NUMEL - 100)), ("b", torch.zeros(100))])
CHUNK = 100_003  # chunk edges fall inside blocks and inside elements


def _state(optimizer: str = "nesterov", **config) -> tuple[ParameterServerState, int]:
    config = ServerConfig(port=0, chunk_bytes=CHUNK, outer=OuterConfig(optimizer=optimizer, dn_buffer=2), **config)
    state = ParameterServerState(config)
    wid, _, _ = state.join(MANIFEST, "w")
    init = torch.linspace(-1, 1, NUMEL)
    state.intake.push(MANIFEST.pack_flat(init), worker_id=wid, push_id=1, kind=pb.PUSH_KIND_INITIAL_PARAMETERS)
    return state, wid


def _delta(seed: int) -> torch.Tensor:
    return MANIFEST.pack_flat(torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed)) * 0.01)


def _push(state: ParameterServerState, wid: int, push_id: int):
    return state.intake.push(_delta(push_id), worker_id=wid, push_id=push_id, base_version=state.version)


def _pulled(state: ParameterServerState, pieces=None) -> tuple[int, bytes, int]:
    """(version, payload, CRC-32 in the header) of one whole pull over the gRPC messages."""
    source = state.open_pull(pb.PullRequest(worker_id=1))
    try:
        data = b"".join(bytes(decode_pull_message(m).data) for m in source.messages(CHUNK))
    finally:
        state.snapshots.close_pull(source)
    return source.header.version, data, source.header.crc32


@pytest.mark.parametrize("optimizer", ["nesterov", "sgd", "delayed_nesterov"])
def test_pulls_read_theta_and_the_crc_is_taken_in_the_step(optimizer, monkeypatch):
    pulled, wid = _state(optimizer)
    quiet, wid_q = _state(optimizer)
    hooks = []
    step = pulled.model.outer.step

    def spy(*args, **kwargs):
        hooks.append(kwargs.get("on_block"))
        return step(*args, **kwargs)

    monkeypatch.setattr(pulled.model.outer, "step", spy)
    for push_id in range(2, 6):
        for state, w in ((pulled, wid), (quiet, wid_q)):
            state.intake.push(_delta(push_id), worker_id=w, push_id=push_id, base_version=state.version)
        view = pulled.snapshots.acquire()
        assert isinstance(view, LiveView) and view.version == pulled.version
        assert view._crc is not None or push_id == 2  # taken in the step once pulls came
        assert b"".join(bytes(v) for v in view.data_views(CHUNK)) == pulled.model.theta.numpy().tobytes()
        assert view.crc32() == crc32_of(pulled.model.theta.view(torch.uint8))
        pulled.snapshots.release(view)
        assert torch.equal(pulled.model.theta, quiet.model.theta)
    assert hooks[0] is None and all(h is not None for h in hooks[1:])  # blocked from the first push after a pull
    assert pulled.intake.pool._in_use == 0  # nobody reads an old version: every Δ buffer went back


@pytest.mark.parametrize("optimizer", ["nesterov", "delayed_nesterov"])
def test_a_pull_across_applies_gets_exactly_its_version(optimizer):
    state, wid = _state(optimizer)
    source = state.open_pull(pb.PullRequest(worker_id=wid))
    theta_0 = state.model.theta.clone()
    messages = source.messages(CHUNK)
    got = [next(messages), next(messages)]  # part of version 0 read from θ itself
    for push_id in (2, 3, 4):  # θ moves on three times under the pull
        assert _push(state, wid, push_id).applied
    got += list(messages)
    state.snapshots.close_pull(source)
    data = b"".join(bytes(decode_pull_message(m).data) for m in got)
    assert source.header.version == 0 and data == theta_0.numpy().tobytes()
    assert source.header.crc32 == crc32_of(theta_0.view(torch.uint8))
    assert state.intake.pool._in_use == 0  # the Δ buffer holding version 0 went back with the pull
    assert _pulled(state)[1] == state.model.theta.numpy().tobytes()


def test_reads_during_the_swap_see_the_old_version_at_every_block(monkeypatch):
    """Read the whole view after every block of the step: the filled part of Δ's buffer,
    the scratch of the block in flight and the untouched rest of θ make version 0."""
    state, wid = _state("nesterov")
    view = state.snapshots.acquire()
    theta_0 = state.model.theta.numpy().tobytes()
    step = state.model.outer.step
    seen = []

    def checking_step(*args, **kwargs):
        inner = kwargs["on_block"]

        def on_block(start, end):
            inner(start, end)
            seen.append(b"".join(bytes(v) for v in view.data_views(CHUNK)) == theta_0)

        kwargs["on_block"] = on_block
        return step(*args, **kwargs)

    monkeypatch.setattr(state.model.outer, "step", checking_step)
    assert _push(state, wid, 2).applied
    assert seen == [True, True, True]  # three blocks
    assert b"".join(bytes(v) for v in view.data_views(CHUNK)) == theta_0  # and from Δ's buffer after it
    state.snapshots.release(view)
    assert state.model.theta.numpy().tobytes() != theta_0


def test_a_pull_during_the_outer_step_is_served_the_version_before(monkeypatch):
    state, wid = _state("sgd")
    _pulled(state)  # pulls are coming
    theta_0 = state.model.theta.numpy().tobytes()
    entered, release = threading.Event(), threading.Event()
    step = state.model.outer.step

    def held(*args, **kwargs):
        entered.set()
        assert release.wait(STUCK_S)
        return step(*args, **kwargs)

    monkeypatch.setattr(state.model.outer, "step", held)
    pusher = threading.Thread(target=_push, args=(state, wid, 2), daemon=True)
    pusher.start()
    assert entered.wait(STUCK_S)
    version, data, crc = _pulled(state)  # does not wait for the apply
    release.set()
    pusher.join(STUCK_S)
    assert (version, data, crc) == (0, theta_0, crc32_of(torch.frombuffer(bytearray(theta_0), dtype=torch.uint8)))
    assert _pulled(state)[0] == 1 and state.intake.pool._in_use == 0


def test_an_old_version_stays_within_the_receive_budget():
    """The version a pull still reads lives in the Δ buffer it was swapped into, counted
    in the receive budget: with room for one payload, the next push waits for that pull."""
    payload = NUMEL * 4
    state, wid = _state("sgd", receive_buffer_bytes=payload)
    source = state.open_pull(pb.PullRequest(worker_id=wid))
    assert _push(state, wid, 2).applied  # version 0 moves into push 2's buffer
    pool = state.intake.pool
    assert pool._in_use == 1 and pool._in_use_bytes == payload
    with pytest.raises(ServerBusyError, match="receive budget"):
        pool.acquire(payload, timeout_s=0.01)
    got = b"".join(bytes(decode_pull_message(m).data) for m in source.messages(CHUNK))
    state.snapshots.close_pull(source)
    assert pool._in_use == 0 and len(got) == payload
    assert _push(state, wid, 3).applied


def test_no_pull_no_copy_and_no_held_buffer():
    state, wid = _state("sgd")
    for push_id in (2, 3):
        assert _push(state, wid, push_id).applied
    view = state.snapshots._live  # a view of θ (no bytes of its own), no buffer held
    assert view is not None and view.version == 2 and view._old is None and state.intake.pool._in_use == 0
    version, data, crc = _pulled(state)
    assert version == 2 and data == state.model.theta.numpy().tobytes()
    assert crc == crc32_of(state.model.theta.view(torch.uint8))


def test_sync_rounds_and_regional_rebases_copy_out_the_version_being_read():
    sync = ParameterServerState(ServerConfig(port=0, mode="sync", chunk_bytes=CHUNK))
    wid, _, _ = sync.join(MANIFEST, "w")
    sync.intake.push(
        MANIFEST.pack_flat(torch.ones(NUMEL)), worker_id=wid, push_id=1, kind=pb.PUSH_KIND_INITIAL_PARAMETERS
    )
    regional, rwid = _state("sgd")
    for state, change in (
        (sync, lambda: sync.rounds.apply_round(CommittedRound(1, 1, torch.full((NUMEL,), 0.01), {wid: 5}, {wid: 2}))),
        (regional, lambda: rebase_onto(regional, torch.zeros(NUMEL), regional.model.theta.clone() - 1.0)),
    ):
        before = state.model.theta.numpy().tobytes()
        source = state.open_pull(pb.PullRequest(worker_id=1))
        messages = source.messages(CHUNK)
        got = [next(messages)]
        change()
        got += list(messages)
        state.snapshots.close_pull(source)
        assert state.model.theta.numpy().tobytes() != before
        assert b"".join(bytes(decode_pull_message(m).data) for m in got) == before
        assert source.header.crc32 == crc32_of(torch.frombuffer(bytearray(before), dtype=torch.uint8))


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


def test_a_stalled_pull_of_an_old_version_lets_pushes_in_after_the_lease():
    """A pull that stops reading keeps its version, but not the receive budget: once its
    hold is older than the lease and a push waits for room, the version moves into memory
    of its own and the push goes on."""
    clock = FakeClock(100.0)
    payload = NUMEL * 4
    config = ServerConfig(
        port=0, chunk_bytes=CHUNK, receive_buffer_bytes=payload, outer=OuterConfig(optimizer="sgd"), lease_s=60.0
    )
    state = ParameterServerState(config, clock=clock)
    wid, _, _ = state.join(MANIFEST, "w")
    state.intake.push(
        MANIFEST.pack_flat(torch.linspace(-1, 1, NUMEL)), worker_id=wid, push_id=1, kind=pb.PUSH_KIND_INITIAL_PARAMETERS
    )
    theta_0 = state.model.theta.numpy().tobytes()
    stalled = state.open_pull(pb.PullRequest(worker_id=wid))
    messages = stalled.messages(CHUNK)
    got = [next(messages)]
    assert _push(state, wid, 2).applied  # version 0 now lives in push 2's receive buffer
    with pytest.raises(ServerBusyError):
        state.intake.pool.acquire(payload, timeout_s=0.01)  # within the lease: the pull holds it
    for _ in range(2):  # past the lease, the worker's own kept alive
        clock.advance(30.5)
        state.heartbeat(wid)
    assert _push(state, wid, 3).applied  # the stalled pull's hold was evicted
    got += list(messages)
    state.snapshots.close_pull(stalled)
    assert b"".join(bytes(decode_pull_message(m).data) for m in got) == theta_0
    assert state.intake.pool._in_use == 0


def test_pool_evicts_a_stale_hold_when_a_push_waits():
    clock = FakeClock()
    pool = ReceivePool(budget_bytes=100, hold_lease_s=60.0, clock=clock)
    buffer = pool.acquire(100, timeout_s=1)
    evicted = []
    release = pool.hold(buffer, evict=lambda: (evicted.append(1), release()))
    pool.release(buffer)
    with pytest.raises(ServerBusyError):
        pool.acquire(100, timeout_s=0.01)
    assert not evicted
    clock.advance(61.0)
    assert pool.acquire(100, timeout_s=1).numel() == 100 and evicted == [1]


def test_concurrent_pulls_and_pushes_each_pull_is_exactly_one_version(monkeypatch):
    """Pushers and pullers in threads: every pull's bytes are θ of the version its header
    names (recorded as each version is published), and match its CRC-32; every buffer
    goes back to the pool in the end."""
    state, _ = _state("nesterov")
    versions = {0: state.model.theta.numpy().tobytes()}
    publish = state.snapshots.publish

    def recording_publish(snap):
        if isinstance(snap, LiveView):
            versions[snap.version] = state.model.theta.numpy().tobytes()
        publish(snap)

    monkeypatch.setattr(state.snapshots, "publish", recording_publish)
    workers = [state.join(MANIFEST, f"p{k}")[0] for k in range(3)]
    errors: list[BaseException] = []
    pulls: list[tuple[int, bytes, int]] = []
    done = threading.Event()

    def pusher(wid: int) -> None:
        try:
            for push_id in range(2, 10):
                state.intake.push(
                    _delta(wid * 100 + push_id), worker_id=wid, push_id=push_id, base_version=state.version
                )
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def puller() -> None:
        try:
            while not done.is_set():
                pulls.append(_pulled(state))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    pushers = [threading.Thread(target=pusher, args=(w,), daemon=True) for w in workers]
    pullers = [threading.Thread(target=puller, daemon=True) for _ in range(3)]
    for t in pullers + pushers:
        t.start()
    for t in pushers:
        t.join(STUCK_S)
    done.set()
    for t in pullers:
        t.join(STUCK_S)
    assert not errors and state.version == 24 and pulls
    for version, data, crc in pulls:
        assert data == versions[version]
        assert crc == crc32_of(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    assert state.intake.pool._in_use == 0
