"""Exactly-once pushes for any replay (issue 15, item 7): a push id at or below the
worker's high-water mark is never applied again, however many newer pushes made the
server forget its outcome, in memory, across a checkpoint and across a log replay."""

from __future__ import annotations

import helpers
import pytest
import torch
from helpers import assert_same, crash, fingerprint

from asyncdiloco.algo.config import OuterConfig
from asyncdiloco.ps.books import PUSH_MEMORY
from asyncdiloco.ps.config import DurabilityConfig, ServerConfig
from asyncdiloco.ps.state import ParameterServerState
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.tensors import Manifest

pytestmark = pytest.mark.timeout(60)

MANIFEST = Manifest.from_named_tensors([("w", torch.zeros(4))])
OUTER = OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0, max_staleness=10**6)


def config(tmp_path=None, every=10**6) -> ServerConfig:
    durability = None
    if tmp_path is not None:
        durability = DurabilityConfig(checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=every, fsync=False)
    return ServerConfig(port=0, outer=OUTER, durability=durability)


def open_durable(tmp_path, every=10**6):
    return helpers.open_durable(config(tmp_path, every))


def push(state, wid, push_id, value=0.001):
    payload = MANIFEST.pack([torch.full((4,), value)])
    return state.intake.push(payload, worker_id=wid, push_id=push_id, base_version=state.version, num_local_steps=1)


def initialized(state) -> int:
    wid, init, _ = state.join(MANIFEST, "a")
    assert init
    state.intake.push(MANIFEST.pack([torch.zeros(4)]), worker_id=wid, push_id=1, kind=pb.PUSH_KIND_INITIAL_PARAMETERS)
    return wid


def push_past_the_memory(state, wid) -> int:
    """Pushes 2 .. PUSH_MEMORY + 11 applied: push 2's outcome is no longer remembered."""
    last = PUSH_MEMORY + 11
    for push_id in range(2, last + 1):
        assert push(state, wid, push_id).applied
    assert 2 not in state.registry.workers.get(wid).outcomes
    return last


def assert_not_applied_again(state, wid, push_ids) -> None:
    before = fingerprint(state)
    for push_id in push_ids:
        again = push(state, wid, push_id, value=5.0)
        assert again.duplicate and not again.applied, push_id
        assert again.version == state.version
    assert_same(before, fingerprint(state))  # θ, momentum, version, counters, outcomes: unchanged


def test_a_forgotten_push_id_is_never_applied_again():
    state = ParameterServerState(config())
    wid = initialized(state)
    last = push_past_the_memory(state, wid)
    assert state.version == last - 1
    assert_not_applied_again(state, wid, [2, 3, 10])
    reply = state.intake.reply(push(state, wid, 2), wid)  # what the wire says
    assert reply.duplicate and not reply.applied and reply.version == state.version
    assert state.counters.duplicate_pushes == 1
    assert push(state, wid, last, value=5.0).duplicate  # remembered: its original outcome
    assert push(state, wid, last + 1).applied  # the next id is new


def test_an_id_below_the_mark_that_never_arrived_is_not_applied_either():
    state = ParameterServerState(config())
    wid = initialized(state)
    push(state, wid, 2)
    push(state, wid, 5)  # 3 and 4 were skipped (say refused): a late copy must not land after 5
    assert_not_applied_again(state, wid, [3, 4])


def test_a_resumed_worker_is_told_the_mark():
    state = ParameterServerState(config())
    wid = initialized(state)
    last = push_past_the_memory(state, wid)
    state.registry.workers.get(wid).outcomes.clear()  # whatever the memory holds, the mark stays
    joined = state.join_worker(MANIFEST, "a")
    assert joined.resumed and joined.last_push_id == last


def test_the_mark_survives_a_checkpoint(tmp_path):
    state, store = open_durable(tmp_path)
    wid = initialized(state)
    push_past_the_memory(state, wid)
    store.close()  # a checkpoint: the log after it is empty
    state2, store2 = open_durable(tmp_path)
    assert_not_applied_again(state2, wid, [2, 3])
    store2.close()


def test_the_mark_survives_a_log_replay(tmp_path):
    state, store = open_durable(tmp_path)
    wid = initialized(state)
    push_past_the_memory(state, wid)
    crash(store)  # every push only in the log
    state2, store2 = open_durable(tmp_path)
    assert_same(fingerprint(state), fingerprint(state2))
    assert_not_applied_again(state2, wid, [2, 3])
    store2.close()


def test_a_worker_answered_with_a_not_applied_duplicate_drops_its_delta_and_takes_the_global_model(start_server):
    """The worker's side: a push answered ``duplicate`` and not ``applied`` (its id at or
    below the mark, outcome forgotten) is not counted as applied, θ_base is not lowered by
    it, and the model restarts from the global one: its Δ is in the server at most once."""
    from asyncdiloco.worker.async_worker import AsyncDiLoCoWorker
    from asyncdiloco.worker.config import WorkerConfig

    srv = start_server(local_steps=2, grouping="off", dylu=False, outer=OUTER)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step() -> None:
        ((model(torch.ones(8, 4)) - 1.0) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()

    with AsyncDiLoCoWorker(model, opt, WorkerConfig(server=srv.address, push_on_close=False)) as worker:
        for _ in range(4):  # pushes 2 and 3
            step()
        assert worker.stats.pushes_applied == 2
        record = srv.state.registry.workers[worker.worker_id]
        record.outcomes.clear()  # as after PUSH_MEMORY newer pushes
        worker._next_push_id = 3  # a replay of an id the server applied and forgot
        version = srv.state.version
        for _ in range(2):
            step()
        assert srv.state.version == version  # not applied again
        assert (worker.stats.pushes_applied, worker.stats.pushes_refused) == (2, 1)
        global_model = srv.state.model.theta.clone()
        local = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        assert torch.equal(local, global_model)  # restarted from the global model, nothing carried
