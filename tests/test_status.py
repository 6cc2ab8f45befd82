"""The status numbers the state reports (ps/core.py, ps/registry.py ``statuses``):
the push rate over the last minute, each worker's state and staleness, on a fake clock."""

from __future__ import annotations

import torch
from helpers import FakeClock

from asyncdiloco.algo.config import OuterConfig
from asyncdiloco.ps.config import ServerConfig
from asyncdiloco.ps.state import ParameterServerState
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.tensors import Manifest

MANIFEST = Manifest.from_named_tensors([("w", torch.zeros(4))])


def _state(clock: FakeClock, **fields) -> ParameterServerState:
    config = ServerConfig(port=0, grouping="off", dylu=False, outer=OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0))
    return ParameterServerState(ServerConfig(**{**config.__dict__, **fields}), clock=clock)


def _initialized(state: ParameterServerState, name: str = "a") -> int:
    wid = state.join(MANIFEST, name)[0]
    state.intake.push(MANIFEST.pack([torch.zeros(4)]), worker_id=wid, push_id=1, kind=pb.PUSH_KIND_INITIAL_PARAMETERS)
    return wid


def _push(state: ParameterServerState, wid: int, push_id: int, base_version: int) -> None:
    state.intake.push(MANIFEST.pack([torch.ones(4)]), worker_id=wid, push_id=push_id, base_version=base_version)


def test_pushes_per_s_is_over_the_last_minute_or_since_the_start():
    clock = FakeClock(1000.0)
    state = _state(clock)
    wid = _initialized(state)
    assert state.status().pushes_per_s == 0.0
    clock.advance(10)
    for i in range(3):
        _push(state, wid, 2 + i, state.version)
    assert state.status().pushes_per_s == 3 / 10  # younger than a minute: since the start
    clock.advance(20)
    assert state.status().pushes_per_s == 3 / 30
    clock.advance(45)  # the pushes are 65 s old now
    assert state.status().pushes_per_s == 0.0


def test_each_worker_reports_its_staleness_and_its_state():
    clock = FakeClock()
    state = _state(clock, lease_s=100.0)
    a = _initialized(state, "a")
    b = state.join(MANIFEST, "b")[0]
    c = state.join(MANIFEST, "c")[0]
    _push(state, a, 2, 0)  # τ 0
    _push(state, a, 3, 0)  # τ 1
    _push(state, b, 1, 0)  # τ 2
    state.leave(c)
    rows = {w.worker_name: w for w in state.status().workers}
    assert (rows["a"].mean_staleness, rows["a"].last_staleness) == (0.5, 1)
    assert (rows["b"].mean_staleness, rows["b"].last_staleness) == (2.0, 2)
    assert (rows["a"].state, rows["b"].state, rows["c"].state) == ("training", "training", "left")
    clock.advance(99)  # no rates known: a group waits for live workers until they are silent for long
    state.heartbeat(a)
    clock.advance(2)  # b's lease lapsed, a's is current
    rows = {w.worker_name: w for w in state.status().workers}
    assert (rows["b"].state, rows["c"].state) == ("expired", "left")
    assert rows["a"].state == "training"


def test_a_live_worker_that_stopped_pushing_is_silent():
    clock = FakeClock()
    state = _state(clock, lease_s=1000.0)
    a = _initialized(state, "a")
    state.report_rate(a, 10.0)  # H_w = 20 steps at 10 steps/s: a round of 2 s
    _push(state, a, 2, 0)
    assert state.status().workers[0].state == "training"
    clock.advance(60)  # far beyond two rounds
    state.heartbeat(a)
    assert state.status().workers[0].state == "silent"


def test_staleness_and_left_survive_a_checkpoint_and_a_resumed_worker_is_no_longer_left():
    clock = FakeClock()
    state = _state(clock, lease_s=100.0)
    a = _initialized(state, "a")
    b = state.join(MANIFEST, "b")[0]
    _push(state, a, 2, 0)  # τ 0
    _push(state, b, 1, 0)  # τ 1
    _push(state, b, 2, 0)  # τ 2
    state.leave(b)
    meta, tensors, _ = state.durability.state_dict()
    restored = _state(clock, lease_s=100.0)
    restored.durability.load_state_dict(meta, tensors)
    rows = {w.worker_name: w for w in restored.status().workers}
    assert (rows["b"].mean_staleness, rows["b"].last_staleness, rows["b"].state) == (1.5, 2, "left")
    assert rows["a"].mean_staleness == 0.0 and rows["a"].state == "training"
    assert restored.join(MANIFEST, "b")[0] == b  # b comes back under its name: training again, its τ kept
    row = next(w for w in restored.status().workers if w.worker_name == "b")
    assert (row.state, row.mean_staleness) == ("training", 1.5)


def test_a_torchrun_group_shows_its_rank_count_until_it_rejoins_alone():
    from asyncdiloco.tools.status_view import render, status_dict

    state = _state(FakeClock())
    _initialized(state, "solo")
    state.join_worker(MANIFEST, "box", ranks=4)
    rows = {w.worker_name: w.ranks for w in state.status().workers}
    assert rows == {"solo": 1, "box": 4}
    text = render(status_dict(state.status()))
    assert "box (4 ranks)" in text and "solo (" not in text
    state.join_worker(MANIFEST, "box")  # the same name, now one process
    assert {w.worker_name: w.ranks for w in state.status().workers}["box"] == 1
