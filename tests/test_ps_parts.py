"""The server's state, part by part (ps/registry.py, push/intake.py, core.py, books.py,
durable/wal.py, durable/checkpoints.py), and the on-disk formats against a committed fixture.

``tests/data/checkpoint_v1`` was written by ``_write_run`` below, then the process
"killed" (the log after the newest checkpoint still holds records to replay). It must
keep loading, and a run of the same pushes must write the same log records and the same
checkpoint contents (but for the wall-clock times of the workers' last contacts).
"""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import torch

from asyncdiloco.algo.config import OuterConfig
from asyncdiloco.errors import (
    InvalidPayloadError,
    ModeMismatchError,
    NotInitializedError,
    StalePushError,
    UnknownWorkerError,
)
from asyncdiloco.ps.books import Counters, LoggedJoin
from asyncdiloco.ps.config import DurabilityConfig, ServerConfig
from asyncdiloco.ps.durable.store import DurableStore
from asyncdiloco.ps.durable.wal import JOIN, PUSH, encode_record, read_segment
from asyncdiloco.ps.state import ParameterServerState
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.header_crc import seal
from asyncdiloco.wire.tensors import Manifest

FIXTURE = pathlib.Path(__file__).parent / "data" / "checkpoint_v1"
MANIFEST = Manifest.from_named_tensors([("w", torch.zeros(3, 2)), ("b", torch.zeros(2, dtype=torch.bfloat16))])
OUTER = OuterConfig(optimizer="delayed_nesterov", lr=0.7, momentum=0.9, dn_buffer=2)


def _without_wall_clock(meta: dict) -> dict:
    """A log record's meta but for the wall-clock time of the contact, which differs by construction."""
    return {k: v for k, v in meta.items() if k != "seen_unix_s"}


def _config(folder: pathlib.Path | None = None, **fields) -> ServerConfig:
    if folder is not None:
        fields["durability"] = DurabilityConfig(checkpoint_dir=str(folder), checkpoint_every=4)
    fields = {"port": 0, "chunk_bytes": 1024, "lease_s": 86400, "outer": OUTER, **fields}
    return ServerConfig(**fields)


def _open(folder: pathlib.Path) -> tuple[ParameterServerState, DurableStore]:
    config = _config(folder)
    state = ParameterServerState(config, clock=lambda: 0.0)
    store = DurableStore(config.durability, config)
    store.open(state.durability)
    return state, store


def _write_run(state: ParameterServerState) -> None:
    """The pushes the fixture holds: a bf16 parameter, Delayed Nesterov, stale pushes."""
    a = state.join(MANIFEST, "a")[0]
    init = [torch.arange(6.0).view(3, 2) / 8, torch.tensor([0.5, -0.25], dtype=torch.bfloat16)]
    state.intake.push(MANIFEST.pack(init), worker_id=a, push_id=1, kind=pb.PUSH_KIND_INITIAL_PARAMETERS)
    b = state.join(MANIFEST, "b")[0]
    for k in range(5):
        delta = [torch.full((3, 2), 0.125 * (k + 1)), torch.tensor([0.0625 * k, -0.5], dtype=torch.bfloat16)]
        base = max(0, state.version - k % 2)
        wid = (a, b)[k % 2]
        state.intake.push(
            MANIFEST.pack(delta), worker_id=wid, push_id=2 + k, base_version=base, num_local_steps=3, num_tokens=7
        )


def _kill(store: DurableStore) -> None:
    """What kill -9 leaves: the files as they are, the folder lock released."""
    store.close(final_checkpoint=False)


# ------------------------------------------------------------------ formats
def test_a_checkpoint_and_log_written_before_the_parts_still_restore(tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(FIXTURE / "ckpt", folder)
    expected = json.loads((FIXTURE / "expected.json").read_text())
    state, store = _open(folder)  # the newest checkpoint (LSN 6) and two log records after it
    try:
        assert state.version == expected["version"]
        assert state.params is not None and state.params.tolist() == expected["params"]
        outer = state.model.outer
        assert outer.momentum_buffer.tolist() == expected["momentum"]
        assert outer.delta_buffer.tolist() == expected["dn_delta"]
        assert outer.arrivals == expected["arrivals"]
        assert (state.counters.applied_pushes, state.counters.tokens) == (
            expected["applied_pushes"],
            expected["tokens"],
        )
        assert state.counters.staleness_histogram[:4] == expected["staleness_histogram"]
        workers = {
            str(w.worker_id): [w.name, w.applied_pushes, w.tokens, w.local_steps, list(w.outcomes)]
            for w in state.registry.workers.values()
        }
        assert workers == expected["workers"]
    finally:
        store.close()


def test_the_same_run_writes_the_same_log_bytes_and_checkpoint_contents(tmp_path):
    folder = tmp_path / "ckpt"
    state, store = _open(folder)
    _write_run(state)
    _kill(store)
    old, new = FIXTURE / "ckpt", folder
    logs = sorted(p.name for p in old.glob("wal-*.log"))
    assert logs == sorted(p.name for p in new.glob("wal-*.log"))
    for name in logs:  # the same records, but for the wall-clock time
        old_records, new_records = read_segment(old / name, is_last=False), read_segment(new / name, is_last=False)
        assert len(old_records) == len(new_records), name
        for was, now in zip(old_records, new_records, strict=True):
            assert _without_wall_clock(now.meta) == _without_wall_clock(was.meta), name
            assert now.meta.keys() == was.meta.keys(), name
            assert (now.kind, now.lsn, now.payload) == (was.kind, was.lsn, was.payload), name
    for side in sorted(p.name for p in old.glob("ckpt-*.json")):
        a, b = json.loads((old / side).read_text()), json.loads((new / side).read_text())
        for meta in (a, b):  # the write time, and the checksums over it, differ by construction
            for key in ("created_unix_s", "meta_sha256", "tensor_sha256", "tensor_bytes"):
                meta.pop(key)
            for w in meta["workers"]:  # the last contact, on the wall clock
                assert isinstance(w.pop("last_seen_unix_s"), float)
        assert a == b, side
        assert list(json.loads((old / side).read_text())) == list(json.loads((new / side).read_text()))
        tensors = side.replace(".json", ".pt")
        old_t = torch.load(old / tensors, weights_only=True)
        new_t = torch.load(new / tensors, weights_only=True)
        assert old_t.keys() == new_t.keys() and all(torch.equal(old_t[k], new_t[k]) for k in old_t)


def test_a_log_record_is_the_documented_bytes():
    head, meta = encode_record(PUSH, 7, {"a": 1}, b"\x01\x02")
    assert head[:4] == b"ADWL" and head[4] == PUSH and int.from_bytes(head[5:13], "little") == 7
    assert meta == b'{"a":1}'
    assert int.from_bytes(head[13:17], "little") == len(meta) and int.from_bytes(head[17:25], "little") == 2


def test_a_torn_last_record_is_cut_off_and_the_intact_ones_read(tmp_path):
    path = tmp_path / "wal-00000000000000000001.log"
    records = [encode_record(JOIN, lsn, {"worker_id": lsn}, b"") for lsn in (1, 2)]
    data = b"".join(head + meta for head, meta in records)
    path.write_bytes(data + records[0][0][:10])  # a third append cut off mid-head
    assert [r.meta["worker_id"] for r in read_segment(path, is_last=True)] == [1, 2]
    assert path.read_bytes() == data


# ----------------------------------------------------------- the store's view
class _RecordingState:
    """Only the typed interface the store may use (journal.py ``JournaledState``)."""

    version = 0

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.journal = None

    def state_dict(self, while_locked=None):
        self.calls.append("state_dict")
        lsn = while_locked() if while_locked is not None else 0
        meta = {"version": 0, "initialized": False, "manifest": None, "workers": []}
        return meta, {}, lsn

    def load_state_dict(self, meta, tensors):
        self.calls.append("load_state_dict")

    def replay_join(self, *args, **kwargs):
        self.calls.append("replay_join")

    def replay_push(self, *args):
        self.calls.append("replay_push")

    def replay_seen(self, *args):
        self.calls.append("replay_seen")

    def attach_journal(self, journal):
        self.calls.append("attach_journal")
        self.journal = journal

    def detach_journal(self, then=None):
        self.calls.append("detach_journal")
        self.journal = None
        if then is not None:
            then()


def test_the_store_talks_to_the_state_only_through_its_interface(tmp_path):
    config = _config(tmp_path / "ckpt")
    fake = _RecordingState()
    store = DurableStore(config.durability, config)
    store.open(fake)  # an empty folder: a fresh run, checkpointed at once
    store.log_join(LoggedJoin(1, "a", True, MANIFEST, True, 0.0))
    store.close(final_checkpoint=False)
    assert fake.calls == ["attach_journal", "state_dict", "detach_journal"]
    fake2 = _RecordingState()
    store2 = DurableStore(config.durability, config)
    store2.open(fake2)  # the checkpoint, then the logged Join
    store2.close()
    assert fake2.calls == [
        "load_state_dict",
        "replay_join",
        "attach_journal",
        "state_dict",
        "state_dict",
        "detach_journal",
    ]


# ----------------------------------------------------------------- the parts
def test_the_registry_expires_leases_by_the_injected_clock():
    now = [0.0]
    state = ParameterServerState(_config(lease_s=10.0), clock=lambda: now[0])
    a = state.join(MANIFEST, "a")[0]
    now[0] = 9.0
    state.heartbeat(a)  # renewed at 9 s
    now[0] = 18.5
    assert state.live_worker_ids() == {a}
    now[0] = 19.5
    assert state.live_worker_ids() == set()
    with pytest.raises(UnknownWorkerError, match="no longer registered"):
        state.heartbeat(a)
    with pytest.raises(UnknownWorkerError, match="unknown to this server"):
        state.heartbeat(a + 1)


def test_a_gone_initializer_hands_the_initialization_to_the_next_heartbeat():
    now = [0.0]
    state = ParameterServerState(_config(lease_s=10.0), clock=lambda: now[0])
    a, init_a, _ = state.join(MANIFEST, "a")
    b, init_b, _ = state.join(MANIFEST, "b")
    assert (init_a, init_b) == (True, False)
    assert state.heartbeat(b)[2] is False  # a still holds it
    state.leave(a)
    assert state.heartbeat(b)[2] is True
    assert state.registry.initializer == b


def test_a_push_kind_of_the_other_mode_is_refused_before_its_payload_is_read():
    sync = ParameterServerState(ServerConfig(port=0, mode="sync"))
    wid = sync.join(MANIFEST, "a")[0]
    header = pb.PushHeader(worker_id=wid, push_id=1, kind=pb.PUSH_KIND_PSEUDO_GRADIENT)
    with pytest.raises(ModeMismatchError, match="this server runs --mode sync; start the worker with --mode sync"):
        sync.intake.refuse(seal(header))
    state = ParameterServerState(_config())
    wid = state.join(MANIFEST, "a")[0]
    header = pb.PushHeader(worker_id=wid, push_id=1, kind=pb.PUSH_KIND_ROUND_RESULT, quorum_id=4)
    with pytest.raises(ModeMismatchError, match="the round result of quorum 4"):
        state.intake.refuse(seal(header))
    header.kind = 9
    with pytest.raises(InvalidPayloadError, match="push kind 9 is not one of"):
        state.intake.refuse(seal(header))
    header.kind = pb.PUSH_KIND_PSEUDO_GRADIENT
    with pytest.raises(NotInitializedError):
        state.intake.refuse(seal(header))
    header.kind = pb.PUSH_KIND_INITIAL_PARAMETERS
    header.worker_id = state.join(MANIFEST, "b")[0]
    with pytest.raises(StalePushError, match=f"worker {wid} was chosen to initialize"):
        state.intake.refuse(seal(header))
    assert state.intake.pool._in_use == 0


def test_an_async_server_refuses_the_quorum_calls_after_checking_the_lease():
    state = ParameterServerState(_config())
    with pytest.raises(UnknownWorkerError):
        state.request_quorum(5, 0, "", 1.0)
    wid = state.join(MANIFEST, "a")[0]
    with pytest.raises(ModeMismatchError, match="the quorum request of worker"):
        state.request_quorum(wid, 0, "", 1.0)
    with pytest.raises(ModeMismatchError, match="the commit vote of worker"):
        state.commit(wid, 1, success=True, total_weight=1.0, num_tokens=0, num_local_steps=0, reason="", timeout_s=0.0)
    with pytest.raises(ModeMismatchError, match="a sync-state pull"):
        state.open_pull(pb.PullRequest(worker_id=wid, sync_state=True))
    assert state.quorum is None


def test_a_retried_push_is_answered_from_memory_without_its_payload():
    state = ParameterServerState(_config())
    wid = state.join(MANIFEST, "a")[0]
    init = MANIFEST.pack([torch.zeros(3, 2), torch.zeros(2, dtype=torch.bfloat16)])
    first = state.intake.push(init, worker_id=wid, push_id=1, kind=pb.PUSH_KIND_INITIAL_PARAMETERS)
    header = seal(pb.PushHeader(worker_id=wid, push_id=1, kind=pb.PUSH_KIND_INITIAL_PARAMETERS, total_bytes=10**9))
    drained = []
    again = state.intake.receive(header, fill=lambda _: pytest.fail("read"), drain=lambda: drained.append(1))
    assert again.duplicate and again.version == first.version and drained == [1]
    assert state.intake.reply(again, wid).duplicate and state.counters.duplicate_pushes == 1


def test_counters_go_through_a_checkpoint_and_fit_another_histogram_length():
    counters = Counters(4)
    counters.count_applied(1, 7)
    counters.count_applied(9, 3)  # the last bucket counts every larger τ
    counters.count_pull(100)
    meta = counters.to_meta()
    assert list(meta) == [
        "applied_pushes",
        "rejected_pushes",
        "duplicate_pushes",
        "bytes_pushed",
        "bytes_pulled",
        "pulls",
        "tokens",
    ]
    assert counters.staleness_histogram == [0, 1, 0, 1]
    restored = Counters(6)
    restored.load_meta(meta, counters.staleness_histogram)
    assert (restored.applied_pushes, restored.tokens, restored.pulls) == (2, 10, 1)
    assert restored.staleness_histogram == [0, 1, 0, 1, 0, 0]
    shorter = Counters(2)
    shorter.load_meta(meta, counters.staleness_histogram)
    assert shorter.staleness_histogram == [0, 1]
