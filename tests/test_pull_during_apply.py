"""A pull never waits for an apply (issue 15, item 8): while an outer step runs (held
here on an Event, not by a sleep), a pull is served at once the newest complete
snapshot, of the version the apply started from."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from helpers import STUCK_S

from asyncdiloco.algo.config import OuterConfig
from asyncdiloco.ps.config import ServerConfig
from asyncdiloco.ps.state import ParameterServerState
from asyncdiloco.ps.sync.quorum import CommittedRound
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.tensors import Manifest

pytestmark = pytest.mark.timeout(60)

MANIFEST = Manifest.from_named_tensors([("w", torch.zeros(1000))])
#: How long a pull may take before it counts as waiting (it takes milliseconds; the apply
#: it must not wait for is held until the test lets it go).
PULL_BOUND_S = 10.0


def push(state, wid, push_id):
    payload = MANIFEST.pack([torch.full((1000,), 0.01)])
    return state.intake.push(payload, worker_id=wid, push_id=push_id, base_version=state.version, num_local_steps=1)


def pull_version(state) -> int:
    snap = state.snapshots.acquire()
    state.snapshots.release(snap)
    return snap.version


def started(state) -> int:
    wid, init, _ = state.join(MANIFEST, "a")
    assert init
    state.intake.push(
        MANIFEST.pack([torch.zeros(1000)]), worker_id=wid, push_id=1, kind=pb.PUSH_KIND_INITIAL_PARAMETERS
    )
    return wid


class HeldApply:
    """A push whose outer step waits until ``release`` (the seam: the optimizer's step)."""

    def __init__(self, state, monkeypatch, wid, push_id) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        original = state.model.outer.step

        def held_step(*args, **kwargs):
            self.entered.set()
            assert self.release.wait(STUCK_S), "the test never let the apply go"
            original(*args, **kwargs)

        monkeypatch.setattr(state.model.outer, "step", held_step)
        self.outcome: list = []
        self.thread = threading.Thread(target=lambda: self.outcome.append(push(state, wid, push_id)), daemon=True)
        self.thread.start()
        assert self.entered.wait(STUCK_S), "the push never reached its outer step"

    def finish(self):
        self.release.set()
        self.thread.join(STUCK_S)
        assert self.outcome and self.outcome[0].applied
        return self.outcome[0]


def pull_while(state, held: HeldApply) -> int | None:
    """The version a pull gets while ``held`` is in its outer step; None if it waited."""
    got: list[int] = []
    t = threading.Thread(target=lambda: got.append(pull_version(state)), daemon=True)
    t.start()
    t.join(PULL_BOUND_S)
    waited = t.is_alive()
    held.finish()
    t.join(STUCK_S)
    return None if waited else got[0]


@pytest.mark.parametrize("pushes_since_the_last_pull", [0, 1, 3])
def test_a_pull_during_an_apply_gets_the_version_it_started_from(monkeypatch, pushes_since_the_last_pull):
    state = ParameterServerState(ServerConfig(port=0, outer=OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0)))
    wid = started(state)
    assert pull_version(state) == 0  # pulls are being served
    for push_id in range(2, 2 + pushes_since_the_last_pull):
        push(state, wid, push_id)  # no pull of these versions: nothing asked for their snapshots
    version = state.version
    held = HeldApply(state, monkeypatch, wid, 100)
    assert pull_while(state, held) == version  # at once, and the version before the apply
    assert state.version == version + 1
    assert pull_version(state) == version + 1  # and then the new one


def test_many_pulls_during_an_apply_none_waits(monkeypatch):
    state = ParameterServerState(ServerConfig(port=0))
    wid = started(state)
    pull_version(state)
    push(state, wid, 2)
    push(state, wid, 3)
    held = HeldApply(state, monkeypatch, wid, 4)
    got: list[int] = []
    threads = [threading.Thread(target=lambda: got.append(pull_version(state)), daemon=True) for _ in range(4)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + PULL_BOUND_S
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert sorted(got) == [2, 2, 2, 2]
    finally:
        held.finish()


def test_a_pull_during_a_sync_rounds_outer_step_gets_the_round_before(monkeypatch):
    state = ParameterServerState(ServerConfig(port=0, mode="sync"))
    wid = started(state)
    assert pull_version(state) == 0
    entered, release = threading.Event(), threading.Event()
    original = state.model.outer.step

    def held_step(*args, **kwargs):
        entered.set()
        assert release.wait(STUCK_S), "the test never let the round go"
        original(*args, **kwargs)

    monkeypatch.setattr(state.model.outer, "step", held_step)
    done = CommittedRound(
        quorum_id=1, round=1, result=torch.full((1000,), 0.01), tokens_by_worker={wid: 5}, steps_by_worker={wid: 2}
    )
    commit = threading.Thread(target=state.rounds.apply_round, args=(done,), daemon=True)
    commit.start()
    assert entered.wait(STUCK_S)
    got: list[int] = []
    pull = threading.Thread(target=lambda: got.append(pull_version(state)), daemon=True)
    pull.start()
    pull.join(PULL_BOUND_S)
    waited = pull.is_alive()
    release.set()
    commit.join(STUCK_S)
    pull.join(STUCK_S)
    assert not waited and got == [0]  # at once, the round before
    assert state.version == 1 and pull_version(state) == 1
