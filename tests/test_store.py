"""Checkpoints and the write-ahead log (ps/durable/store.py), in-process and network-free."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
import torch
from helpers import assert_same, crash, fingerprint

from asyncdiloco.algo.config import OuterConfig
from asyncdiloco.errors import CheckpointError
from asyncdiloco.ps.config import DurabilityConfig, ServerConfig
from asyncdiloco.ps.durable.store import DurableStore
from asyncdiloco.ps.state import ParameterServerState
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.tensors import Manifest

pytestmark = pytest.mark.timeout(60)

MANIFEST = Manifest.from_named_tensors(
    [("enc.weight", torch.zeros(3, 4)), ("enc.bias", torch.zeros(3)), ("head", torch.zeros(5, dtype=torch.bfloat16))]
)


def open_server(tmp_path, *, every=100, fallback=False, outer=None):
    cfg = ServerConfig(
        port=0,
        chunk_bytes=1024,
        outer=outer or OuterConfig(optimizer="nesterov", lr=0.7, momentum=0.9, staleness="inverse"),
        durability=DurabilityConfig(
            checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=every, fallback_to_previous=fallback
        ),
    )
    state = ParameterServerState(cfg)
    store = DurableStore(cfg.durability, cfg)
    store.open(state.durability)
    return state, store


def push(state, wid, push_id, tensors, *, base_version=None, kind=pb.PUSH_KIND_PSEUDO_GRADIENT):
    return state.intake.push(
        MANIFEST.pack(tensors),
        worker_id=wid,
        push_id=push_id,
        base_version=state.version if base_version is None else base_version,
        num_local_steps=3,
        num_tokens=7,
        kind=kind,
    )


def rand_tensors(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(t.shape, generator=g).to(t.dtype) for t in MANIFEST.tensors]


def run(state, n_pushes=6, first_seed=1):
    """Two workers: one initializes, both push; returns the worker ids."""
    a, init, _ = state.join(MANIFEST, "a")
    assert init
    push(state, a, 1, rand_tensors(0), kind=pb.PUSH_KIND_INITIAL_PARAMETERS)
    b, _, _ = state.join(MANIFEST, "b")
    for k in range(n_pushes):
        wid = (a, b)[k % 2]
        push(
            state,
            wid,
            2 + k,
            [t * 0.1 for t in rand_tensors(first_seed + k)],
            base_version=max(0, state.version - k % 3),
        )
    return a, b


def test_clean_shutdown_and_restart_restore_everything(tmp_path):
    state, store = open_server(tmp_path)
    run(state)
    before = fingerprint(state)
    store.close()
    state2, store2 = open_server(tmp_path)
    assert_same(before, fingerprint(state2))
    store2.close()


def newest_checkpoint_version(tmp_path) -> int:
    return json.loads(sorted((tmp_path / "ckpt").glob("ckpt-*.json"))[-1].read_text())["version"]


@pytest.mark.parametrize(
    "outer",
    [
        OuterConfig(optimizer="nesterov", lr=0.7, momentum=0.9, staleness="inverse"),
        OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0),
        OuterConfig(optimizer="delayed_nesterov", lr=0.7, momentum=0.9, dn_buffer=0, dn_c=0.1, staleness="polynomial"),
        OuterConfig(optimizer="delayed_nesterov", lr=0.7, momentum=0.5, dn_buffer=3),
    ],
    ids=["nesterov", "sgd", "dn_workers", "dn_buffer3"],
)
def test_crash_replays_the_log_bit_identically(tmp_path, outer):
    # 11 logged pushes (the initial parameters and 10 pseudo-gradients), a checkpoint
    # every 4: the last one at version 7, so versions 8-10 exist only in the log.
    state, store = open_server(tmp_path, every=4, outer=outer)
    run(state, n_pushes=10)
    before = fingerprint(state)
    crash(store)
    assert state.version == 10 and newest_checkpoint_version(tmp_path) == 7  # three pushes to replay
    state2, store2 = open_server(tmp_path, every=4, outer=outer)
    assert_same(before, fingerprint(state2))
    # the server goes on where it stopped: same ids, next version, same outer step
    b = max(state2.registry.workers)
    assert push(state2, b, 100, rand_tensors(9)).version == state.version + 1
    push(state, b, 100, rand_tensors(9))
    assert_same(fingerprint(state), fingerprint(state2))
    crash(store2)


def test_retried_push_is_a_duplicate_across_a_crash(tmp_path):
    state, store = open_server(tmp_path)
    a, b = run(state, n_pushes=2)
    outcome = push(state, b, 50, rand_tensors(5))
    crash(store)  # say the reply never reached the worker
    state2, store2 = open_server(tmp_path)
    before = fingerprint(state2)
    again = push(state2, b, 50, rand_tensors(5), base_version=0)
    assert again.duplicate and again.version == outcome.version and again.staleness == outcome.staleness
    assert again.local_steps == outcome.local_steps
    assert_same(before, fingerprint(state2))
    store2.close()


def test_join_is_durable_and_the_initializer_is_remembered(tmp_path):
    state, store = open_server(tmp_path)
    a, init, _ = state.join(MANIFEST, "first")
    crash(store)  # before its initial parameters arrived
    state2, store2 = open_server(tmp_path)
    push(state2, a, 1, rand_tensors(0), kind=pb.PUSH_KIND_INITIAL_PARAMETERS)  # still the chosen initializer
    assert state2.initialized and state2.join(MANIFEST, "second")[0] == a + 1
    store2.close()


def test_torn_tail_record_is_dropped(tmp_path):
    state, store = open_server(tmp_path)
    run(state)
    before = fingerprint(state)
    crash(store)
    seg = sorted((tmp_path / "ckpt").glob("wal-*.log"))[-1]
    with open(seg, "ab") as f:  # half a record: the crash hit during an append
        f.write(b"ADWL\x02" + b"\x00" * 30)
    state2, store2 = open_server(tmp_path)
    assert_same(before, fingerprint(state2))
    crash(store2)
    state3, store3 = open_server(tmp_path)  # and the tail stays cut off
    assert_same(before, fingerprint(state3))
    store3.close()


def test_damaged_record_in_the_middle_stops_start_up(tmp_path):
    state, store = open_server(tmp_path)
    run(state)
    crash(store)
    seg = sorted((tmp_path / "ckpt").glob("wal-*.log"))[-1]
    data = bytearray(seg.read_bytes())
    data[40] ^= 0xFF  # inside the first record
    seg.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"write-ahead log .*wal-.* is damaged at byte 0"):
        open_server(tmp_path)


@pytest.mark.parametrize("damage", ["flip_tensor_byte", "truncate_tensors", "truncate_sidecar", "edit_sidecar"])
def test_corrupt_newest_checkpoint_stops_start_up_unless_told_to_fall_back(tmp_path, damage):
    state, store = open_server(tmp_path, every=3)
    run(state, n_pushes=7)  # checkpoints after 3 and 6 pushes, plus log records after them
    before = fingerprint(state)
    crash(store)
    folder = tmp_path / "ckpt"
    newest = sorted(folder.glob("ckpt-*.json"))[-1]
    pt = newest.with_suffix(".pt")
    if damage == "flip_tensor_byte":
        data = bytearray(pt.read_bytes())
        data[len(data) // 2] ^= 1
        pt.write_bytes(bytes(data))
    elif damage == "truncate_tensors":
        pt.write_bytes(pt.read_bytes()[:100])
    elif damage == "truncate_sidecar":
        newest.write_bytes(newest.read_bytes()[:50])
    else:
        meta = json.loads(newest.read_text())
        meta["version"] += 1
        newest.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=rf"{newest.stem}.*--fallback-to-previous"):
        open_server(tmp_path)
    state2, store2 = open_server(tmp_path, fallback=True)
    assert_same(before, fingerprint(state2))  # previous checkpoint + the log replayed from there
    store2.close()
    state3, store3 = open_server(tmp_path)  # the bad checkpoint was superseded
    assert_same(before, fingerprint(state3))
    store3.close()


def test_checkpoint_written_with_another_outer_config_is_refused(tmp_path):
    state, store = open_server(tmp_path)
    run(state)
    store.close()
    with pytest.raises(CheckpointError, match=r"outer lr=0.7 .* configured with 0.5; restart with the checkpoint's"):
        open_server(tmp_path, outer=OuterConfig(optimizer="nesterov", lr=0.5, momentum=0.9, staleness="inverse"))


def test_a_second_server_on_the_same_folder_is_refused(tmp_path):
    state, store = open_server(tmp_path)
    with pytest.raises(CheckpointError, match="is in use by another running server"):
        open_server(tmp_path)
    store.close()


def test_checkpoint_cadence_pruning_and_layout(tmp_path):
    state, store = open_server(tmp_path, every=2)
    run(state, n_pushes=9)
    folder = tmp_path / "ckpt"
    sidecars = sorted(folder.glob("ckpt-*.json"))
    assert len(sidecars) == 2 and len(list(folder.glob("ckpt-*.pt"))) == 2
    assert not list(folder.glob("*.tmp"))
    meta = json.loads(sidecars[-1].read_text())
    tensors = torch.load(folder / meta["tensor_file"], weights_only=True)
    names = [t.name for t in MANIFEST.tensors]
    assert sorted(tensors) == sorted([f"param/{n}" for n in names] + [f"momentum/{n}" for n in names])
    assert all(t.dtype == torch.float32 for t in tensors.values())  # fp32 master copy, bf16 "head" included
    assert meta["version"] == state.version == 9 and {w["name"] for w in meta["workers"]} == {"a", "b"}
    # the log holds at most the records since the older kept checkpoint
    older = json.loads(sidecars[0].read_text())["lsn"]
    firsts = sorted(int(p.stem.split("-")[1]) for p in folder.glob("wal-*.log"))
    assert firsts[0] <= older + 1
    store.close()


def test_a_log_write_failure_applies_nothing(tmp_path, monkeypatch):
    state, store = open_server(tmp_path)
    a, b = run(state)
    before = fingerprint(state)

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(CheckpointError, match="could not write the write-ahead log") as info:
        push(state, a, 77, rand_tensors(3))
    assert info.value.grpc_code.name == "UNAVAILABLE"  # the worker retries later
    assert_same(before, fingerprint(state))
    monkeypatch.undo()
    assert push(state, a, 77, rand_tensors(3)).applied  # the retry goes through
    crash(store)
    state2, store2 = open_server(tmp_path)  # and the log has no torn record in its middle
    assert state2.version == state.version
    store2.close()


def test_a_worker_that_left_before_the_checkpoint_stays_gone(tmp_path):
    state, store = open_server(tmp_path)
    a, b = run(state, n_pushes=2)
    state.leave(b)
    store.checkpoint()
    crash(store)
    state2, store2 = open_server(tmp_path)
    assert {w.worker_id: w.alive for w in state2.registry.workers.values()} == {a: True, b: False}
    store2.close()


# ------------------------------------------------------------- outer lr schedule
COSINE_OUTER = OuterConfig(
    optimizer="nesterov",
    lr=0.7,
    momentum=0.9,
    staleness="inverse",
    lr_schedule="cosine",
    lr_warmup_versions=3,
    lr_total_versions=12,
    lr_min_ratio=0.1,
)


@pytest.mark.parametrize(
    "outer",
    [
        COSINE_OUTER,
        OuterConfig(
            optimizer="delayed_nesterov",
            lr=0.7,
            momentum=0.9,
            dn_buffer=3,
            dn_c=0.1,
            lr_schedule="cosine",
            lr_warmup_versions=2,
            lr_total_versions=9,
            lr_min_ratio=0.0,
        ),
        OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0, lr_schedule="constant", lr_warmup_versions=20),
    ],
    ids=["nesterov_cosine", "dn_cosine", "sgd_warmup"],
)
def test_scheduled_outer_lr_after_a_crash_equals_the_uninterrupted_run(tmp_path, outer):
    # 7 logged pushes (the initial parameters and 6 pseudo-gradients): a checkpoint at
    # version 3, the updates at versions 3, 4, 5 only in the log. The replay must key each
    # η_v by the version it was applied at, and so must the pushes after the restart.
    state, store = open_server(tmp_path, every=4, outer=outer)
    run(state, n_pushes=6)
    crash(store)  # ``state`` goes on in memory: the uninterrupted run
    assert newest_checkpoint_version(tmp_path) == 3
    state2, store2 = open_server(tmp_path, every=4, outer=outer)
    assert_same(fingerprint(state), fingerprint(state2))
    b = max(state2.registry.workers)
    for k in range(3):  # the same pushes to both, at versions 6, 7, 8
        for s in (state, state2):
            push(s, b, 100 + k, rand_tensors(20 + k))
        assert_same(fingerprint(state), fingerprint(state2))  # θ, m (and DN's b) bit for bit
    crash(store2)


def test_push_after_a_restart_moves_theta_by_the_scheduled_lr_of_its_version(tmp_path):
    state, store = open_server(tmp_path, every=4, outer=COSINE_OUTER)
    run(state, n_pushes=6)  # versions 4-6 come back from the log
    crash(store)
    state, store = open_server(tmp_path, every=4, outer=COSINE_OUTER)
    v = state.version
    assert v == 6
    theta, m = state.params.clone().double(), state.model.outer.momentum_buffer.clone().double()
    delta = [t * 0.1 for t in rand_tensors(42)]
    push(state, max(state.registry.workers), 100, delta, base_version=v)  # τ = 0: s = 1
    d = MANIFEST.unpack_flat(MANIFEST.pack(delta)).double()
    # Nesterov with η_v = η · f(v): m ← μm + Δ; θ ← θ − η_v (Δ + μm), f(6) = 0.1 + 0.9·½(1 + cos(π·3/9))
    eta_v = 0.7 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (v - 3) / (12 - 3))))
    assert state.model.outer.lr_at(v) == pytest.approx(eta_v, rel=1e-12)
    m_new = 0.9 * m + d
    torch.testing.assert_close(state.model.outer.momentum_buffer.double(), m_new, rtol=0, atol=1e-6)
    expected = theta - eta_v * (d + 0.9 * m_new)
    torch.testing.assert_close(state.params.double(), expected, rtol=0, atol=1e-6)
    for wrong in (
        0.7,
        state.model.outer.lr_at(v - 1),
        state.model.outer.lr_at(v + 1),
    ):  # η itself, or a neighbour's η_v
        assert (state.params.double() - (theta - wrong * (d + 0.9 * m_new))).abs().max() > 1e-4
    crash(store)


def test_checkpoint_written_with_another_lr_schedule_is_refused(tmp_path):
    state, store = open_server(tmp_path, outer=COSINE_OUTER)
    run(state, n_pushes=2)
    store.close()
    other = dataclasses.replace(COSINE_OUTER, lr_total_versions=20)
    with pytest.raises(CheckpointError, match=r"outer lr_total_versions=12 .* configured with 20"):
        open_server(tmp_path, outer=other)


@pytest.mark.parametrize("checkpoint_every", [100, 2], ids=["replayed from the log", "from a checkpoint"])
def test_regional_pushes_averaged_in_survive_a_crash(tmp_path, checkpoint_every):
    """A parent's regional servers (joined with the region role) are averaged in as
    θ ← θ − s(τ)·Δ/R: the role and each push's R are in the log and the checkpoints, so a
    restart redoes the same steps and keeps averaging (momentum untouched)."""
    state, store = open_server(tmp_path, every=checkpoint_every)
    a = state.join_worker(MANIFEST, "region-a", region=True).worker_id
    push(state, a, 1, rand_tensors(0), kind=pb.PUSH_KIND_INITIAL_PARAMETERS)
    b = state.join_worker(MANIFEST, "region-b", region=True).worker_id
    theta = state.params.clone()
    for k in range(4):
        wid = (a, b)[k % 2]
        delta = [t * 0.1 for t in rand_tensors(1 + k)]
        push(state, wid, 2 + k, delta, base_version=state.version)  # τ = 0: s = 1
        theta -= MANIFEST.unpack_flat(MANIFEST.pack(delta)) / 2
    assert torch.allclose(state.params, theta, atol=1e-6)
    assert not state.model.outer.momentum_buffer.any()  # the outer optimizer never saw them
    before = fingerprint(state)
    crash(store)
    state2, store2 = open_server(tmp_path, every=checkpoint_every)
    assert_same(before, fingerprint(state2))
    assert state2.registry.workers.get(a).region and state2.registry.workers.get(b).region
    push(state2, a, 6, rand_tensors(9), base_version=state2.version)
    assert not state2.model.outer.momentum_buffer.any()
    store2.close()
