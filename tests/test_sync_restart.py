"""A sync server restarted from its checkpoint folder goes on at its last committed round
(issue 15, item 16): committed rounds are logged before anyone learns of them, so after a
graceful stop or a kill -9 the version, θ and the outer momentum are the committed ones,
quorum ids go on, members whose θ_base is from that round go on without healing, and a
member of the round in flight at the restart starts over instead of hanging or mixing
rounds."""

from __future__ import annotations

import dataclasses
import logging
import threading

import grpc
import pytest
import torch
from helpers import STUCK_S, crash, open_durable, run_threads

from asyncdiloco.algo.config import OuterConfig
from asyncdiloco.ps import ParameterServer
from asyncdiloco.ps.config import DurabilityConfig, ServerConfig, SyncConfig
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.tensors import Manifest
from asyncdiloco.worker.config import SyncWorkerConfig, WorkerConfig
from asyncdiloco.worker.sync_worker import SyncDiLoCoWorker

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_thread")]

MANIFEST = Manifest.from_named_tensors([("w", torch.zeros(6))])
NESTEROV = OuterConfig(optimizer="nesterov", lr=0.7, momentum=0.9)


def _config(folder, port: int = 0, **sync) -> ServerConfig:
    sync.setdefault("join_timeout_s", 5.0)
    return ServerConfig(
        port=port,
        mode="sync",
        outer=NESTEROV,
        local_steps=2,
        lease_s=30.0,
        sync=SyncConfig(**sync),
        durability=DurabilityConfig(checkpoint_dir=str(folder), checkpoint_every=100, fsync=False),
    )


# ------------------------------------------------------------- the state and its folder
def _round(state, wid: int, round_: int, delta: torch.Tensor) -> int:
    """One round of a quorum of one on the state: quorum, rank 0's result, its vote."""
    q = state.request_quorum(wid, round_, MANIFEST.manifest_hash, 1.0)
    assert q is not None and q.round == round_ and not q.heal
    state.intake.push(
        delta.clone().view(torch.uint8),
        worker_id=wid,
        push_id=q.quorum_id,
        base_version=round_,
        kind=pb.PUSH_KIND_ROUND_RESULT,
        quorum_id=q.quorum_id,
    )
    decision = state.commit(
        wid, q.quorum_id, success=True, total_weight=1.0, num_tokens=10, num_local_steps=2, reason="", timeout_s=1.0
    )
    assert decision is not None and decision.committed and decision.round == round_ + 1
    return q.quorum_id


@pytest.mark.parametrize("how", ["stop", "kill -9"])
def test_the_committed_rounds_survive_a_restart_bit_for_bit(tmp_path, how):
    config = _config(tmp_path / "ckpt")
    state, store = open_durable(config)
    wid = state.join_worker(MANIFEST, "w").worker_id
    state.intake.push(MANIFEST.pack([torch.ones(6)]), worker_id=wid, push_id=1, kind=pb.PUSH_KIND_INITIAL_PARAMETERS)
    quorum_ids = [_round(state, wid, r, torch.linspace(-1, 1, 6) * (r + 1)) for r in range(3)]
    theta, momentum = state.params.clone(), state.model.outer.momentum_buffer.clone()
    if how == "stop":
        store.close()  # the final checkpoint
    else:
        crash(store)  # the rounds are only in the log

    again, store2 = open_durable(config)
    try:
        assert again.version == 3 and again.quorum.round == 3 and again.status().rounds_committed == 3
        assert torch.equal(again.params, theta) and torch.equal(again.model.outer.momentum_buffer, momentum)
        q = again.request_quorum(wid, 3, MANIFEST.manifest_hash, 1.0)  # θ_base from round 3: go on
        assert q is not None and q.round == 3 and not q.heal and q.quorum_id > max(quorum_ids)
    finally:
        store2.close()


def test_a_round_that_cannot_be_logged_aborts_and_changes_nothing(tmp_path):
    state, store = open_durable(_config(tmp_path / "ckpt"))
    try:
        wid = state.join_worker(MANIFEST, "w").worker_id
        state.intake.push(
            MANIFEST.pack([torch.ones(6)]), worker_id=wid, push_id=1, kind=pb.PUSH_KIND_INITIAL_PARAMETERS
        )
        theta = state.params.clone()
        q = state.request_quorum(wid, 0, MANIFEST.manifest_hash, 1.0)
        state.intake.push(
            torch.ones(6).view(torch.uint8),
            worker_id=wid,
            push_id=q.quorum_id,
            kind=pb.PUSH_KIND_ROUND_RESULT,
            quorum_id=q.quorum_id,
        )
        store._broken = "disk gone (test)"  # noqa: SLF001 - every append now fails
        decision = state.commit(
            wid, q.quorum_id, success=True, total_weight=1.0, num_tokens=1, num_local_steps=2, reason="", timeout_s=1
        )
        assert not decision.committed and "could not apply the round" in decision.reason
        assert state.version == 0 and torch.equal(state.params, theta) and state.quorum.round == 0
    finally:
        store._broken = None  # noqa: SLF001
        store.close()


# ------------------------------------------------------------ workers across a restart
def _worker(address: str, cls=SyncDiLoCoWorker, **kw) -> SyncDiLoCoWorker:
    torch.manual_seed(0)  # every replica starts from the same parameters
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    cfg = WorkerConfig(server=address, initial_backoff_s=0.05, max_backoff_s=0.2)
    sync = SyncWorkerConfig(allreduce_timeout_s=10.0, quorum_timeout_s=20.0)
    return cls(model, torch.optim.AdamW(model.parameters(), lr=0.02), cfg, sync=sync, **kw)


def _train(worker: SyncDiLoCoWorker, seed: int, until_round: int, between=None) -> None:
    gen = torch.Generator().manual_seed(seed)
    paused = between is None
    with worker:
        while worker.round < until_round:
            x = torch.randn(16, 4, generator=gen)
            ((worker.model(x) - x.sum(1, keepdim=True)) ** 2).mean().backward()
            worker.inner_optimizer.step()
            worker.inner_optimizer.zero_grad()
            if not paused and worker.round >= 2:  # between rounds 2 and 3: the test restarts the server
                paused = True
                between.wait(STUCK_S)
                between.wait(STUCK_S)


def _check_went_on(workers, srv: ParameterServer, until_round: int) -> None:
    """Rounds monotone on every member, never mixed (equal θ_base per round), and every
    θ_base the committed global model."""
    for w in workers:
        rounds = [r["round"] for r in w.stats.rounds]
        assert rounds == sorted(rounds) and rounds[-1] >= until_round, rounds
        assert torch.equal(w._base, srv.state.params)  # noqa: SLF001 - θ_base, float32 (N,)
    by_round: dict[int, set[int]] = {}
    for w in workers:
        for r in w.stats.rounds:
            if r["committed"]:
                by_round.setdefault(r["round"], set()).add(r["checksum"])
    assert all(len(sums) == 1 for sums in by_round.values()), by_round


class _Runner:
    """The members' training loops on threads (helpers.run_threads), in the background;
    ``join`` re-raises what a loop raised."""

    def __init__(self, loops) -> None:
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, args=(loops,), daemon=True)
        self.thread.start()

    def _run(self, loops) -> None:
        try:
            run_threads(loops)
        except BaseException as exc:  # noqa: BLE001 - re-raised by join on the test's thread
            self.errors.append(exc)

    def join(self) -> None:
        self.thread.join(STUCK_S)
        assert not self.thread.is_alive(), "a member is stuck"
        if self.errors:
            raise self.errors[0]


def _restart(srv: ParameterServer, kill: bool) -> ParameterServer:
    """Stop ``srv`` (gracefully, or as kill -9 leaves it) and start a new server on its
    port and folder."""
    config, port = srv.config, srv.port
    if kill:
        srv.state.quorum.close()
        srv._server.stop(None).wait()  # noqa: SLF001 - the process is gone: no final checkpoint
        srv._server = None  # noqa: SLF001
        crash(srv.store)
    else:
        srv.stop(None)
    return ParameterServer(dataclasses.replace(config, port=port)).start()


def test_members_go_on_at_the_restored_round_after_a_restart_between_rounds(tmp_path):
    srv = ParameterServer(_config(tmp_path / "ckpt", min_workers=2)).start()
    workers = [_worker(srv.address) for _ in range(2)]
    between = threading.Barrier(3)
    try:
        runner = _Runner([lambda w=w, i=i: _train(w, i, until_round=4, between=between) for i, w in enumerate(workers)])
        between.wait(STUCK_S)  # both members committed round 2 and train on locally
        assert srv.state.version == 2
        srv = _restart(srv, kill=False)
        assert srv.state.version == 2 and srv.state.quorum.round == 2
        between.wait(STUCK_S)
        runner.join()
        _check_went_on(workers, srv, until_round=4)
        assert not any(r["heal"] for w in workers for r in w.stats.rounds)  # the restart cost no heal
        assert srv.state.version == 4
    finally:
        srv.stop(None)


class _PausedInRound(SyncDiLoCoWorker):
    """Waits, before its allreduce of round 3, until the test has restarted the server."""

    def __init__(self, *args, reached: threading.Event, go_on: threading.Event, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reached, self.go_on = reached, go_on

    def _allreduce(self, q: pb.QuorumReply) -> None:
        if q.round == 2 and not self.reached.is_set():
            self.reached.set()
            assert self.go_on.wait(STUCK_S)
        super()._allreduce(q)


def test_a_round_in_flight_at_a_kill_is_started_over_and_the_logged_rounds_stay(tmp_path):
    srv = ParameterServer(_config(tmp_path / "ckpt", min_workers=1)).start()
    reached, go_on = threading.Event(), threading.Event()
    paused = _worker(srv.address, _PausedInRound, reached=reached, go_on=go_on)
    other = _worker(srv.address)
    try:
        runner = _Runner([lambda: _train(paused, 0, until_round=4), lambda: _train(other, 1, until_round=4)])
        assert reached.wait(STUCK_S)  # round 3's quorum formed; the other member waits in the rendezvous
        assert srv.state.version == 2
        srv = _restart(srv, kill=True)  # rounds 1 and 2 are only in the log
        assert srv.state.version == 2 and srv.state.quorum.round == 2
        grpc.channel_ready_future(paused.client._channel).result(STUCK_S)  # noqa: SLF001 - reconnected
        go_on.set()  # its rendezvous and vote reach a server that never saw the quorum: refused
        runner.join()
        _check_went_on([paused, other], srv, until_round=4)
        seen = [(r["round"], r["committed"]) for r in paused.stats.rounds]
        at = seen.index((2, False))  # its round in flight: refused by the new server, so aborted here
        assert seen[at - 1] == (2, True) and seen[at + 1] == (3, True)  # started over from round 2
        assert "round refused" in paused.stats.rounds[at]["reason"]
    finally:
        go_on.set()
        srv.stop(None)


def test_a_server_restarted_without_its_folder_says_so_and_the_members_heal_to_it(start_server, caplog):
    """No --checkpoint-dir: the new server starts empty, a member re-initializes it, and
    each member, whose round is now ahead of the server's, heals to it with a warning."""
    srv = start_server(mode="sync", outer=NESTEROV, local_steps=2, lease_s=30.0, sync=SyncConfig(min_workers=1))
    worker = _worker(srv.address)
    between = threading.Barrier(2)
    runner = _Runner([lambda: _train(worker, 0, until_round=4, between=between)])
    between.wait(STUCK_S)  # round 2 committed
    port = srv.port
    srv.stop(None)
    with caplog.at_level(logging.WARNING, logger="asyncdiloco.worker.sync_worker"):
        srv = start_server(
            port=port, mode="sync", outer=NESTEROV, local_steps=2, lease_s=30.0, sync=SyncConfig(min_workers=1)
        )
        between.wait(STUCK_S)
        runner.join()
    assert "the server's committed round 0 is behind this worker's 2" in caplog.text
    assert [r["round"] for r in worker.stats.rounds] == [1, 2, 1, 2, 3, 4]  # the new server's rounds
    assert torch.equal(worker._base, srv.state.params)  # noqa: SLF001 - θ_base, the new server's model


def test_a_sync_server_restores_an_async_runs_checkpoint_and_log(tmp_path):
    """A folder an async server wrote (its checkpoint has no rounds part, its log holds
    pseudo-gradients) restarts in sync mode at the async run's version and θ, rounds
    starting there; no KeyError from the missing part."""
    folder = str(tmp_path / "ckpt")
    first = ParameterServer(
        ServerConfig(port=0, mode="async", outer=NESTEROV, durability=DurabilityConfig(checkpoint_dir=folder))
    ).start()
    try:
        wid = first.state.join(MANIFEST, "w")[0]
        first.state.intake.push(
            MANIFEST.pack_flat(torch.zeros(6)), worker_id=wid, push_id=1, kind=pb.PUSH_KIND_INITIAL_PARAMETERS
        )
        first.state.intake.push(MANIFEST.pack_flat(torch.ones(6)), worker_id=wid, push_id=2, num_local_steps=1)
        theta = first.state.params.clone()
    finally:
        first.stop(None)
    second = ParameterServer(_config(folder)).start()
    try:
        assert second.state.version == 1
        assert torch.equal(second.state.params, theta)
        assert second.state.rounds is not None and second.state.rounds.sync_state()[0] == 1
    finally:
        second.stop(None)
