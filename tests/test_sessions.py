"""Two processes under one worker name (ps/registry.py sessions, wire/names.py): the
newest Join's session wins, the older one's pushes, heartbeats and Leave are refused or
ignored, so no push is silently answered as a duplicate of the other's; names that would
break the status table or the server's log are refused on both sides."""

from __future__ import annotations

import pathlib

import pytest
import torch
from torch import nn

from asyncdiloco.algo.config import OuterConfig
from asyncdiloco.errors import ConfigError, WorkerSupersededError, quoted
from asyncdiloco.ps.config import DurabilityConfig, ServerConfig
from asyncdiloco.ps.durable.store import DurableStore
from asyncdiloco.ps.state import ParameterServerState
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.names import MAX_NAME_CHARS
from asyncdiloco.wire.tensors import Manifest
from asyncdiloco.worker.async_worker import AsyncDiLoCoWorker
from asyncdiloco.worker.client import ParameterServerClient
from asyncdiloco.worker.config import WorkerConfig
from tests.helpers import FakeClock, assert_same, crash, fingerprint

MANIFEST = Manifest.from_named_tensors([("w", torch.zeros(4))])
SGD1 = OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0)


def _state(folder: pathlib.Path | None = None) -> ParameterServerState:
    fields = {}
    if folder is not None:
        fields["durability"] = DurabilityConfig(checkpoint_dir=str(folder), checkpoint_every=1000)
    config = ServerConfig(port=0, outer=SGD1, dylu=False, grouping="off", **fields)
    return ParameterServerState(config, clock=FakeClock(), wall_clock=FakeClock(1_000_000.0))


def _push(state: ParameterServerState, worker_id: int, push_id: int, session_id: int):
    payload = MANIFEST.pack([torch.full((4,), 0.5)])
    return state.intake.push(
        payload, worker_id=worker_id, push_id=push_id, base_version=state.version, session_id=session_id
    )


def _initialized(state: ParameterServerState) -> tuple[int, int]:
    first = state.join_worker(MANIFEST, "dup")
    state.intake.push(
        MANIFEST.pack([torch.zeros(4)]),
        worker_id=first.worker_id,
        push_id=1,
        kind=pb.PUSH_KIND_INITIAL_PARAMETERS,
        session_id=first.session_id,
    )
    return first.worker_id, first.session_id


def test_a_second_join_under_a_name_supersedes_the_first_session():
    state = _state()
    wid, old = _initialized(state)
    new = state.join_worker(MANIFEST, "dup")
    assert (new.worker_id, new.resumed, old, new.session_id) == (wid, True, 1, 2)
    assert not _push(state, wid, 2, new.session_id).duplicate  # the new process's push 2
    before = fingerprint(state)
    with pytest.raises(WorkerSupersededError, match="session 1 was superseded.*--worker-name"):
        _push(state, wid, 2, old)  # the old process's own push 2: refused, not "a duplicate"
    with pytest.raises(WorkerSupersededError):
        _push(state, wid, 3, old)
    with pytest.raises(WorkerSupersededError):
        state.heartbeat(wid, session_id=old)
    state.leave(wid, session_id=old)  # the old one's Leave ends nothing
    assert_same(fingerprint(state), before)
    assert state.live_worker_ids() == {wid}
    state.heartbeat(wid, session_id=new.session_id)
    state.heartbeat(wid)  # a client without sessions (0) is not checked
    state.leave(wid, session_id=new.session_id)
    assert state.live_worker_ids() == set()


def test_a_restart_replays_the_same_sessions(tmp_path):
    folder = tmp_path / "ckpt"
    state = _state(folder)
    store = DurableStore(state.config.durability, state.config)
    store.open(state.durability)
    wid, old = _initialized(state)
    new = state.join_worker(MANIFEST, "dup")  # logged after the checkpoint
    crash(store)
    again = _state(folder)
    store2 = DurableStore(again.config.durability, again.config)
    store2.open(again.durability)
    try:
        with pytest.raises(WorkerSupersededError):
            again.heartbeat(wid, session_id=old)
        again.heartbeat(wid, session_id=new.session_id)
        store2.close()  # a final checkpoint: the next restart reads the session from it
        third = _state(folder)
        store3 = DurableStore(third.config.durability, third.config)
        store3.open(third.durability)
        with pytest.raises(WorkerSupersededError):
            third.heartbeat(wid, session_id=old)
        assert third.join_worker(MANIFEST, "dup").session_id == 3
        store3.close()
    finally:
        store2.close()


@pytest.mark.parametrize(
    ("name", "needle"),
    [
        ("a\nfake log line", "control character"),
        ("ansi\x1b[31mred", "control character"),
        ("   ", "only spaces"),
        (" lead", "starts or ends with a space"),
        ("trail ", "starts or ends with a space"),
        ("x" * (MAX_NAME_CHARS + 1), f"the limit is {MAX_NAME_CHARS}"),
    ],
)
def test_names_that_break_tables_or_logs_are_refused_on_both_sides(name, needle):
    state = _state()
    with pytest.raises(ConfigError, match=needle):
        state.join_worker(MANIFEST, name)
    assert state.registry.workers == {}
    with pytest.raises(ConfigError, match=needle):
        WorkerConfig(server="127.0.0.1:1", worker_name=name)
    assert len(quoted(name)) <= 120 and "\n" not in quoted(name)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 1)


def _train(worker: AsyncDiLoCoWorker, model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        x = torch.randn(8, 4)
        nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True)).backward()
        opt.step()
        opt.zero_grad()


def test_the_superseded_worker_stops_with_a_clear_error_and_nothing_is_lost(start_server):
    srv = start_server(outer=SGD1, local_steps=2, dylu=False, grouping="off")
    cfg = WorkerConfig(server=srv.address, worker_name="dup", heartbeat_s=30)
    first_model, second_model = _model(), _model()
    first_opt = torch.optim.SGD(first_model.parameters(), lr=0.01)
    second_opt = torch.optim.SGD(second_model.parameters(), lr=0.01)
    first = AsyncDiLoCoWorker(first_model, first_opt, cfg)
    second = AsyncDiLoCoWorker(second_model, second_opt, cfg)
    with first:
        _train(first, first_model, first_opt, 2)  # the initial model and one push
        with second:  # a second process under the same name takes the id over
            assert second.worker_id == first.worker_id
            _train(second, second_model, second_opt, 4)
            with pytest.raises(WorkerSupersededError, match="two processes must not share a worker name"):
                _train(first, first_model, first_opt, 2)
        st = srv.state.status()
    assert st.duplicate_pushes == 0  # no push of one process was answered as the other's
    assert first.stats.pushes_applied == 1 and second.stats.pushes_applied == 2
    assert st.applied_pushes == 1 + 2  # every push either process was told was applied, applied once
    with ParameterServerClient(srv.address) as client:  # a stock observer still sees one worker
        assert [w.worker_name for w in client.status().workers] == ["dup"]
