"""Workers that resume as themselves: the server gives a named worker its id back (ps/
registry.py), leases survive a restart only as far as the wall clock allows, and a
worker's own state folder (worker/state_dir.py) brings back its inner optimizer, θ_base,
push counter and the caller's data position.

The server's side runs on ``FakeClock``s (monotonic and wall clock); the worker's side
against an in-process server. The end-to-end test (a CLI worker killed with SIGKILL and
restarted) is ``test_resume_cli.py``.
"""

from __future__ import annotations

import pathlib
import shutil

import pytest
import torch
from torch import nn

from asyncdiloco.algo.config import OuterConfig
from asyncdiloco.errors import ConfigError
from asyncdiloco.ps.config import DurabilityConfig, ServerConfig
from asyncdiloco.ps.durable.store import DurableStore
from asyncdiloco.ps.state import ParameterServerState
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.tensors import Manifest
from asyncdiloco.worker.async_worker import AsyncDiLoCoWorker
from asyncdiloco.worker.config import WorkerConfig
from asyncdiloco.worker.state_dir import STATE_FILE, WorkerStateDir
from asyncdiloco.worker.state_file import read_state
from asyncdiloco.worker.wire_buffers import WorkerWire
from tests.helpers import FakeClock, assert_same, crash, fingerprint

MANIFEST = Manifest.from_named_tensors([("w", torch.zeros(4))])
SGD1 = OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0)


def _state(folder: pathlib.Path | None = None, lease_s: float = 60.0, wall: FakeClock | None = None, **fields):
    mono, wall = FakeClock(), wall or FakeClock(1_000_000.0)
    if folder is not None:
        fields["durability"] = DurabilityConfig(checkpoint_dir=str(folder), checkpoint_every=1000)
    config = ServerConfig(port=0, lease_s=lease_s, outer=SGD1, dylu=False, **fields)
    return ParameterServerState(config, clock=mono, wall_clock=wall), mono, wall


def _init(state: ParameterServerState, name: str = "a") -> int:
    joined = state.join_worker(MANIFEST, name)
    assert joined.initialize
    state.intake.push(
        MANIFEST.pack([torch.zeros(4)]), worker_id=joined.worker_id, push_id=1, kind=pb.PUSH_KIND_INITIAL_PARAMETERS
    )
    return joined.worker_id


def _push(state: ParameterServerState, worker_id: int, push_id: int, value: float = 0.5):
    return state.intake.push(
        MANIFEST.pack([torch.full((4,), value)]),
        worker_id=worker_id,
        push_id=push_id,
        base_version=state.version,
        num_local_steps=3,
        num_tokens=10,
    )


# ------------------------------------------------------------------ the server's side
def test_a_join_under_a_known_name_gets_the_id_back_with_its_outcomes():
    state, mono, _ = _state()
    a = _init(state, "a")
    b = state.join_worker(MANIFEST, "b").worker_id
    first = _push(state, a, 2)
    mono.advance(30.0)  # a's process died; a restarted one joins under its name
    again = state.join_worker(MANIFEST, "a")
    assert (again.worker_id, again.resumed, again.last_push_id, again.initialize) == (a, True, 2, False)
    assert state.live_worker_ids() == {a, b}  # one worker a, not a dead one and a new one
    assert [w.worker_id for w in state.status().workers] == [a, b]
    retry = _push(state, a, 2, value=9.0)  # the push that was in flight: its original outcome, not applied again
    assert retry.duplicate and (retry.version, retry.staleness) == (first.version, first.staleness)
    rec = state.registry.workers.get(a)
    assert (rec.applied_pushes, rec.tokens, rec.local_steps) == (1, 10, 3)
    assert state.registry.next_worker_id == 3
    assert state.join_worker(MANIFEST, "c").last_push_id == 0  # a new worker


def test_the_old_session_ends_at_once_and_the_new_one_is_a_fresh_join():
    state, mono, _ = _state(grouping="window", grace_s=1.0, local_steps=10)
    a = _init(state, "a")
    state.report_rate(a, 4.0)  # rounds of 2.5 s
    _push(state, a, 2)
    mono.advance(40.0)  # a is silent for 16 of its rounds: no group waits for it any more
    assert a not in state.registry.expected(mono())
    again = state.join_worker(MANIFEST, "a")
    rec = state.registry.workers.get(a)
    assert again.resumed and rec.alive and rec.joined_at == rec.last_seen == mono()
    assert a not in state.registry.rates.rates  # its rate is measured afresh
    assert a in state.registry.expected(mono())  # the new session has just joined


def test_a_left_or_expired_worker_resumes_and_an_empty_name_never_does():
    state, mono, _ = _state(lease_s=10.0)
    a = _init(state, "a")
    state.leave(a)
    assert state.join_worker(MANIFEST, "a").worker_id == a
    mono.advance(11.0)  # expired
    assert state.live_worker_ids() == set()
    assert state.join_worker(MANIFEST, "a").worker_id == a
    x, y = state.join_worker(MANIFEST, ""), state.join_worker(MANIFEST, "")
    assert not x.resumed and not y.resumed and x.worker_id != y.worker_id
    auto = state.registry.workers.get(x.worker_id).name  # "worker-<id>", given by the server
    z = state.join_worker(MANIFEST, auto)  # a worker that calls itself that is someone else
    assert not z.resumed and z.worker_id not in (x.worker_id, y.worker_id)


def test_a_resumed_initializer_is_told_to_initialize_again():
    state, mono, _ = _state(lease_s=10.0)
    first = state.join_worker(MANIFEST, "a")
    assert first.initialize
    other = state.join_worker(MANIFEST, "b")
    assert not other.initialize  # a is chosen and alive
    again = state.join_worker(MANIFEST, "a")  # a died before pushing; it comes back
    assert again.worker_id == first.worker_id and again.initialize


def test_a_resumed_join_refuses_another_model_once_others_hold_one():
    state, _, _ = _state()
    _init(state, "a")
    state.join_worker(MANIFEST, "b")
    other = Manifest.from_named_tensors([("w", torch.zeros(5))])
    with pytest.raises(Exception, match="manifest mismatch"):
        state.join_worker(other, "a")


# ------------------------------------------------------------ restarts of the server
def _restart(folder: pathlib.Path, wall_s: float, lease_s: float = 60.0):
    state, mono, wall = _state(folder, lease_s=lease_s, wall=FakeClock(wall_s))
    store = DurableStore(state.config.durability, state.config)
    store.open(state.durability)
    return state, store, mono, wall


def test_the_log_replays_a_resumed_join_without_wiping_its_outcomes(tmp_path):
    state, store, mono, wall = _restart(tmp_path / "ckpt", 1_000_000.0)
    a = _init(state, "a")
    b = state.join_worker(MANIFEST, "b").worker_id
    _push(state, a, 2)
    _push(state, b, 2, value=0.25)
    assert state.join_worker(MANIFEST, "a").resumed  # logged
    _push(state, a, 3)
    before = fingerprint(state)
    crash(store)
    again, store2, _, _ = _restart(tmp_path / "ckpt", wall())
    try:
        assert_same(fingerprint(again), before)
        assert sorted(again.registry.workers.get(a).outcomes) == [1, 2, 3]
        assert again.join_worker(MANIFEST, "a").last_push_id == 3  # its id, after the restart too
        assert _push(again, a, 3).duplicate
    finally:
        store2.close()


def test_a_restart_gives_no_lease_to_a_worker_dead_before_it_and_the_rest_of_it_to_others(tmp_path):
    state, store, mono, wall = _restart(tmp_path / "ckpt", 1_000_000.0)
    a = _init(state, "a")  # last seen at wall 1_000_000
    b = state.join_worker(MANIFEST, "b").worker_id
    mono.advance(40.0), wall.advance(40.0)
    state.heartbeat(b)  # b last seen at +40 (heartbeats are not logged: the checkpoint dates it)
    store.checkpoint()
    crash(store)
    again, store2, mono2, _ = _restart(tmp_path / "ckpt", wall() + 50.0)  # a silent 90 s, b 50 s; lease 60 s
    try:
        assert again.live_worker_ids() == {b}
        alive = {w.worker_id: w.alive for w in again.status().workers}
        assert alive == {a: False, b: True}
        mono2.advance(9.0)
        assert again.live_worker_ids() == {b}
        mono2.advance(2.0)  # b's 60 s are up: 50 before the restart, 11 after
        assert again.live_worker_ids() == set()
    finally:
        store2.close()


def test_a_push_logged_after_the_checkpoint_dates_its_worker(tmp_path):
    state, store, mono, wall = _restart(tmp_path / "ckpt", 1_000_000.0)
    a = _init(state, "a")
    b = state.join_worker(MANIFEST, "b").worker_id
    store.checkpoint()  # both seen at 1_000_000
    mono.advance(45.0), wall.advance(45.0)
    _push(state, b, 2)  # logged with its wall-clock time
    crash(store)
    again, store2, _, _ = _restart(tmp_path / "ckpt", wall() + 30.0)  # a silent 75 s, b 30 s
    try:
        assert again.live_worker_ids() == {b}
        assert a in again.registry.workers
    finally:
        store2.close()


# ------------------------------------------------------------------- the worker's side
def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _train(worker: AsyncDiLoCoWorker, model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 4, generator=gen)
        nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True)).backward()
        opt.step()
        opt.zero_grad()


def _worker(srv, folder: pathlib.Path, name: str = "", model: nn.Module | None = None, **fields):
    model = model or _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    cfg = WorkerConfig(server=srv.address, worker_name=name, state_dir=str(folder), heartbeat_s=30, **fields)
    return AsyncDiLoCoWorker(model, opt, cfg), model, opt


def _adam_steps(opt: torch.optim.Optimizer) -> list[float]:
    return [float(s["step"]) for s in opt.state.values()]


def test_the_worker_state_round_trips_through_its_folder(start_server, tmp_path):
    srv = start_server(outer=SGD1, local_steps=3, dylu=False, grouping="off")
    folder = tmp_path / "w"
    worker, model, opt = _worker(srv, folder)
    worker.extra_state = lambda: {"position": 7}
    with worker:
        _train(worker, model, opt, 7)  # two syncs, then one step of the next round
        name, wid = worker.worker_name, worker.worker_id
    saved = read_state(folder / STATE_FILE)
    assert saved["worker_name"] == name and name.count("-") >= 2  # <host>-<pid>-<hex>, made once
    assert saved["next_push_id"] == 5 and saved["extra"] == {"position": 7}  # pushes 2, 3, then close's 4
    again, model2, opt2 = _worker(srv, folder)  # a fresh model: the state brings it back
    assert again.worker_name == name and again.restored_extra == {"position": 7}
    assert torch.equal(torch.cat([p.detach().reshape(-1) for p in model2.parameters()]), saved["theta_local"])
    assert _adam_steps(opt2) == _adam_steps(opt) == [7.0] * 4
    with again:
        assert again.worker_id == wid  # the server resumed it under its saved name
        assert again._next_push_id == 5  # noqa: SLF001
    assert [w.worker_id for w in srv.state.status().workers] == [wid]


def test_a_push_in_flight_when_the_worker_died_is_applied_once(start_server, tmp_path):
    srv = start_server(outer=SGD1, local_steps=2, dylu=False, grouping="off")
    folder = tmp_path / "w"
    worker, model, opt = _worker(srv, folder, name="w1")
    worker.join()
    real_push = worker.client.push

    def push_then_die(payload, **kw):
        reply = real_push(payload, **kw)
        if kw["push_id"] == 3:  # applied; the process dies before it reads the reply
            worker.state_dir.close()
            raise KeyboardInterrupt
        return reply

    worker.client.push = push_then_die
    _train(worker, model, opt, 2)  # push 2, saved before it was sent
    with pytest.raises(KeyboardInterrupt):
        _train(worker, model, opt, 2, seed=1)  # push 3: saved, sent, applied, reply never read
    applied = srv.state.registry.workers.get(worker.worker_id).applied_pushes
    params = srv.state.params.clone()
    again, model2, opt2 = _worker(srv, folder)
    with again:
        assert srv.state.counters.duplicate_pushes == 1  # push 3 retried from the folder: answered as before
        assert srv.state.registry.workers.get(again.worker_id).applied_pushes == applied
        assert torch.equal(srv.state.params, params)
        _train(again, model2, opt2, 2, seed=2)  # push 4: new
        assert srv.state.registry.workers.get(again.worker_id).applied_pushes == applied + 1


def test_a_folder_older_than_the_servers_newest_push_never_resends_that_id(start_server, tmp_path, caplog):
    """A save that failed (a full disk: the worker logs it and trains on) leaves the folder
    behind a push the server applied. The restarted worker must not number another Δ with
    that id (the server would answer it with the first one's outcome): it drops what it had
    not sent, counted, and goes on from the global model with new ids."""
    srv = start_server(outer=SGD1, local_steps=2, dylu=False, grouping="off")
    folder = tmp_path / "w"
    worker, model, opt = _worker(srv, folder, name="w1")
    worker.join()
    _train(worker, model, opt, 2)  # push 2, saved before it was sent

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    worker.state_dir.save = disk_full
    _train(worker, model, opt, 2, seed=1)  # push 3 applied; neither save reached the folder
    applied = srv.state.registry.workers.get(worker.worker_id).applied_pushes
    params = srv.state.params.clone()
    worker.state_dir.close()  # the process dies
    again, model2, opt2 = _worker(srv, folder)
    with caplog.at_level("WARNING"), again:
        assert "the server holds pushes of this worker past its own" in caplog.text
        assert srv.state.counters.duplicate_pushes == 0 and torch.equal(srv.state.params, params)
        assert again._next_push_id == 4  # noqa: SLF001 - after the server's newest
        assert again.stats.drops == {"not_resumed": 1}
        local = torch.cat([p.detach().reshape(-1) for p in model2.parameters()])
        assert torch.equal(local, params)  # the global model, nothing of the old folder on top
        _train(again, model2, opt2, 2, seed=2)
        assert srv.state.registry.workers.get(again.worker_id).applied_pushes == applied + 1


def test_a_state_folder_refuses_another_model_another_name_and_a_second_process(start_server, tmp_path):
    srv = start_server(outer=SGD1, local_steps=2, dylu=False, grouping="off")
    folder = tmp_path / "w"
    worker, model, opt = _worker(srv, folder, name="w1")
    with pytest.raises(ConfigError, match="in use by another running worker"):
        WorkerStateDir(folder)
    with worker:
        _train(worker, model, opt, 2)
    with pytest.raises(ConfigError, match=r"differs from the name 'w1' saved in state_dir .*--worker-name w1"):
        _worker(srv, folder, name="w2")
    torch.manual_seed(0)
    wider = nn.Sequential(nn.Linear(4, 9), nn.Tanh(), nn.Linear(9, 1))
    with pytest.raises(ConfigError, match=rf"state_dir '{folder}' belongs to a model of another layout"):
        _worker(srv, folder, model=wider)
    WorkerStateDir(folder).close()  # the refusals released the folder again


def test_the_data_stream_continues_exactly_where_its_state_was_saved():
    from asyncdiloco.job.dataset import BatchStream, CharCorpus

    corpus = CharCorpus.default()
    stream = BatchStream(corpus, 2, 8, seed=1, worker_index=2)
    for _ in range(5):
        next(stream)
    saved = stream.state_dict()
    expected = [next(stream) for _ in range(3)]
    again = BatchStream(corpus, 2, 8, seed=1, worker_index=2)
    again.load_state_dict(saved)
    assert again.position == 5
    assert all(torch.equal(a[0], b[0]) for a, b in zip((next(again) for _ in range(3)), expected))
    with pytest.raises(ConfigError, match="worker_index=2, this one has 0; start with the same --worker-index"):
        BatchStream(corpus, 2, 8, seed=1, worker_index=0).load_state_dict(saved)


def test_the_cli_refuses_a_worker_name_that_differs_from_the_saved_one(cli_exit, tmp_path):
    folder = WorkerStateDir(tmp_path / "w")
    folder.save({"format": 2, "worker_name": "gpu-a"}, {})
    folder.close()
    argv = ["worker", "--server", "127.0.0.1:1", "--max-steps", "1", "--state-dir", str(tmp_path / "w")]
    code, err = cli_exit([*argv, "--worker-name", "gpu-b"])
    assert code == 2
    assert "worker name 'gpu-b' differs from the name 'gpu-a' saved in state_dir" in err and "Traceback" not in err


def test_a_resumed_worker_keeps_what_the_server_has_not_received(start_server, tmp_path):
    srv = start_server(outer=SGD1, local_steps=3, dylu=False, grouping="off")
    folder = tmp_path / "w"
    worker, model, opt = _worker(srv, folder, name="w1")
    worker.join()
    _train(worker, model, opt, 3)  # one sync (its push saved before it was sent)
    worker._save_state()  # noqa: SLF001 - the state after the sync, as close saves it
    worker.state_dir.close()  # the process dies here
    state = read_state(folder / STATE_FILE)
    unsent = torch.linspace(-0.01, 0.01, state["theta_base"].numel())  # e.g. overlap's steps since its snapshot
    state["theta_local"] = state["theta_base"] - unsent
    state["steps_since_sync"] = 2
    again, model2, _ = _worker(srv, tmp_path / "w2", model=_model())
    again.load_state_dict(state)
    with again:
        local = torch.cat([p.detach().reshape(-1) for p in model2.parameters()])
        assert torch.allclose(local, srv.state.params - unsent, atol=1e-6)
        assert again._steps_since_sync == 2  # noqa: SLF001 - the round goes on from the saved step
    saved = read_state(tmp_path / "w2" / STATE_FILE)
    assert saved["worker_name"] == "w1"


def _denied(*args, **kwargs):
    raise PermissionError(13, "Permission denied")


def test_a_state_folder_this_process_cannot_write_is_a_config_error_naming_it(tmp_path, monkeypatch, cli_exit):
    """Tests run as root, who may write anywhere: the refusals are the kernel's as the
    folder's ``open`` and first save would meet them."""
    import asyncdiloco.worker.state_dir as state_dir

    folder = tmp_path / "w"
    monkeypatch.setattr(state_dir, "open", _denied, raising=False)
    with pytest.raises(ConfigError, match=rf"state_dir '{folder}' cannot be written \(Permission denied\); give"):
        WorkerStateDir(folder)
    argv = ["worker", "--server", "127.0.0.1:1", "--max-steps", "1", "--state-dir", str(folder)]
    code, err = cli_exit(argv)
    assert code == 2 and f"state_dir '{folder}' cannot be written" in err and "Traceback" not in err
    monkeypatch.undo()

    opened = WorkerStateDir(folder)
    monkeypatch.setattr(state_dir, "write_atomically", _denied)
    with pytest.raises(ConfigError, match=rf"state_dir '{folder}' cannot be written \(Permission denied\)"):
        opened.save({"format": 2, "worker_name": "a"}, {})  # the first save: the folder is unusable
    monkeypatch.undo()
    opened.save({"format": 2, "worker_name": "a"}, {})
    monkeypatch.setattr(state_dir, "write_atomically", _denied)
    with pytest.raises(PermissionError):  # a later one: the worker logs it and trains on
        opened.save({"format": 2, "worker_name": "a"}, {})
    opened.close()


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlap"])
def test_a_push_applied_just_before_the_worker_died_is_never_taken_for_a_retrained_one(start_server, tmp_path, overlap):
    """The folder as it is when the server has applied push 3 and the process dies before
    reading the reply: the push is in the folder (saved before it was sent), so the
    restarted worker retries exactly those bytes (answered as applied) and goes on from the
    data position after its steps. Were only the sync before it saved, the restarted worker
    would train those steps again and send another Δ under id 3, answered "duplicate,
    applied" with the first one's outcome: its steps would be lost or counted twice."""
    srv = start_server(outer=SGD1, local_steps=2, dylu=False, grouping="off")
    folder, at_kill = tmp_path / "w", tmp_path / "at-kill"
    worker, model, opt = _worker(srv, folder, name="w1", overlap=overlap)
    trained = {"steps": 0}
    worker.extra_state = lambda: dict(trained)

    real_push = worker.client.push

    def push_then_die(payload, **kw):
        reply = real_push(payload, **kw)
        if kw["push_id"] == 3 and not at_kill.exists():  # the server applied it; the reply is never read
            shutil.copytree(folder, at_kill, ignore=shutil.ignore_patterns("LOCK"))
        return reply

    worker.client.push = push_then_die
    worker.join()
    gen = torch.Generator().manual_seed(0)

    def train(w: AsyncDiLoCoWorker, m: nn.Module, o: torch.optim.Optimizer, steps: int) -> None:
        for _ in range(steps):
            x = torch.randn(8, 4, generator=gen)
            nn.functional.mse_loss(m(x), x.sum(dim=1, keepdim=True)).backward()
            trained["steps"] += 1  # this step is the caller's data position once step() syncs
            o.step()
            o.zero_grad()

    train(worker, model, opt, 4)  # pushes 2 and 3 (overlap: 3 in the background, started at step 4)
    if overlap:
        worker._overlap.wait()  # noqa: SLF001 - push 3 reaches the server; its outcome is never merged
    assert at_kill.exists()
    wid = worker.worker_id
    assert srv.state.registry.workers.get(wid).local_steps == 2 + 2
    worker.state_dir.close()  # the process is gone: no reply read, nothing more saved
    worker.client.close()
    srv.state.leave(wid)

    again, model2, opt2 = _worker(srv, at_kill, overlap=overlap)
    trained["steps"] = int(again.restored_extra["steps"])
    assert trained["steps"] == 4  # the data position after push 3's steps: they are not trained again
    with again:
        assert again.worker_id == wid
        train(again, model2, opt2, 3)  # new steps only
    assert srv.state.counters.duplicate_pushes == 1  # push 3, retried with its own bytes
    assert srv.state.registry.workers.get(wid).local_steps == 4 + 3  # every step trained once, counted once
    assert again.stats.pushes_refused == 0 and again.stats.pseudo_gradients_dropped == 0


def test_overlap_with_a_state_folder_encodes_each_push_once(start_server, tmp_path, monkeypatch):
    """Overlap leaves Δ's encoding to its background thread, but the write-ahead save
    encodes the push first (its bytes go into the folder): the background sends those
    bytes instead of encoding Δ a second time, and the server gets exactly what was saved."""
    srv = start_server(outer=SGD1, local_steps=2, dylu=False, grouping="off", wire_codec="bf16")
    folder = tmp_path / "w"
    encoded: list[int] = []
    real_encode = WorkerWire.encode  # counts the encodings

    def counting_encode(self, delta, out=None):
        encoded.append(1)
        return real_encode(self, delta, out)

    monkeypatch.setattr(WorkerWire, "encode", counting_encode)
    worker, model, opt = _worker(srv, folder, name="w1", overlap=True)
    sent, saved = [], []
    real_push = worker.client.push

    def recording_push(payload, **kw):
        if kw.get("kind", pb.PUSH_KIND_PSEUDO_GRADIENT) == pb.PUSH_KIND_PSEUDO_GRADIENT:
            sent.append(payload.clone())
            saved.append(read_state(folder / STATE_FILE)["pending"]["payload"])
        return real_push(payload, **kw)

    worker.client.push = recording_push
    with worker:
        _train(worker, model, opt, 6)  # three syncs, each with a new push
        worker._overlap.wait()  # noqa: SLF001
        pushes = len(sent)
    assert pushes >= 3
    assert len(encoded) == pushes  # one encoding per push (was two: the save's and the background's)
    assert all(torch.equal(a, b) for a, b in zip(sent, saved))
