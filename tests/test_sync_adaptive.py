"""Sync mode with per-member local steps (``--sync-local-steps adaptive``, issue 25 item 1):
each round's decision hands every member H_w = max(1, ⌊v_w / max v · H⌋) over that
round's members' rates (DyLU inside a synchronous round), H while a rate is unknown, and
``fixed`` keeps H for everyone. Rates are injected (heartbeat reports and the votes'
``compute_s``) and the state runs on a fake clock: nothing here depends on how fast the
machine is."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import STUCK_S, FakeClock, flat, load, run_threads, wait_until
from test_sync import batches, inner_opt, make_model, train

from asyncdiloco.algo.config import OuterConfig
from asyncdiloco.algo.outer import OuterOptimizer
from asyncdiloco.algo.schedule import dylu_local_steps
from asyncdiloco.ps import ParameterServerState
from asyncdiloco.ps.config import ServerConfig, SyncConfig
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.tensors import Manifest
from asyncdiloco.worker.config import SyncWorkerConfig, WorkerConfig
from asyncdiloco.worker.sync_worker import SyncDiLoCoWorker

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_thread")]

MANIFEST = Manifest.from_named_tensors([("w", torch.zeros(6))])
NESTEROV = OuterConfig(optimizer="nesterov", lr=0.7, momentum=0.9)
H = 8


# ------------------------------------------------------------------- on the state
def _state(local_steps: str, clock: FakeClock | None = None) -> ParameterServerState:
    config = ServerConfig(
        port=0,
        mode="sync",
        outer=NESTEROV,
        local_steps=H,
        lease_s=30.0,
        sync=SyncConfig(join_timeout_s=5.0, local_steps=local_steps),
    )
    # leases and round deadlines never run out on a clock that only the test moves
    return ParameterServerState(config, clock=clock or FakeClock(100.0))


def _members(state: ParameterServerState, n: int) -> list[int]:
    ids = [state.join_worker(MANIFEST, f"w{i}").worker_id for i in range(n)]
    state.intake.push(MANIFEST.pack([torch.ones(6)]), worker_id=ids[0], push_id=1, kind=pb.PUSH_KIND_INITIAL_PARAMETERS)
    return ids


def _round(state: ParameterServerState, ids: list[int], steps: dict[int, int], rates: dict[int, float], clock=None):
    """One round of every worker in ``ids``: quorum (all wait, so it forms at once; with
    ``clock``, a live worker outside ``ids`` is waited for until the fake clock passes the
    join timeout), rank 0's result, every member's vote with its steps and ``compute_s`` =
    steps / rate (none for a worker without a rate). Returns the decision."""
    got: dict[int, object] = {}

    def ask(wid: int) -> None:
        got[wid] = state.request_quorum(wid, state.version, MANIFEST.manifest_hash, STUCK_S)

    def time_out() -> None:
        wait_until(lambda: state.quorum.waiting_workers() == set(ids), "every member's quorum request")
        clock.advance(state.config.sync.join_timeout_s)

    run_threads([lambda w=w: ask(w) for w in ids] + ([time_out] if clock is not None else []))
    q = got[ids[0]]
    assert q.members == tuple(sorted(ids))
    state.intake.push(
        torch.full((6,), 0.1).view(torch.uint8),
        worker_id=q.members[0],
        push_id=q.quorum_id,
        base_version=q.round,
        kind=pb.PUSH_KIND_ROUND_RESULT,
        quorum_id=q.quorum_id,
    )
    decisions: dict[int, object] = {}

    def vote(wid: int) -> None:
        decisions[wid] = state.commit(
            wid,
            q.quorum_id,
            success=True,
            total_weight=float(len(ids)),
            num_tokens=10,
            num_local_steps=steps[wid],
            reason="",
            timeout_s=STUCK_S,
            compute_s=steps[wid] / rates[wid] if wid in rates else 0.0,
        )

    run_threads([lambda w=w: vote(w) for w in ids])
    assert len({id(d) for d in decisions.values()}) == 1  # one decision, the same for every member
    decision = decisions[ids[0]]
    assert decision is not None and decision.committed
    return decision


def _shown_local_steps(state: ParameterServerState) -> dict[int, int]:
    """H_w per worker as ``asyncdiloco status`` shows it (WorkerStatus.local_steps_per_round)."""
    return {w.worker_id: w.local_steps_per_round for w in state.status().workers}


def test_three_members_of_uneven_speed_get_h_w_in_dylus_ratio():
    state = _state("adaptive")
    a, b, c = ids = _members(state, 3)
    rates = {a: 10.0, b: 5.0, c: 2.5}
    assert state.run_config(a).sync_local_steps == "adaptive"
    for w in ids:  # the rate probe of each worker's first steps (base.py _report_rate)
        state.heartbeat(w, steps_per_s=rates[w])
    expected = {a: 8, b: 4, c: 2}  # H for the fastest, ⌊v_w / max v · H⌋ for the others
    assert expected == dylu_local_steps(rates, H)  # the simulator's rule, the same function
    assert {w: state.local_steps_for(w) for w in ids} == expected  # the probe's reply: the first round

    decision = _round(state, ids, expected, rates)
    assert dict(decision.local_steps) == expected  # every member's H_w for its next round
    assert _shown_local_steps(state) == expected

    # c got twice as fast: its next round's vote says so, and the decision after it follows
    # (the vote carries the worker's own estimate, algo/rates.py, which replaces the rate:
    # 2.5 -> 5 steps/s, H_w 2 -> 4)
    decision = _round(state, ids, expected, {**rates, c: 5.0})
    assert dict(decision.local_steps) == {a: 8, b: 4, c: 4}


def test_a_member_whose_rate_is_unknown_runs_h():
    state = _state("adaptive")
    a, b, c = ids = _members(state, 3)
    rates = {a: 10.0, b: 5.0}  # c never reports, and its vote carries no compute time
    for w, v in rates.items():
        state.heartbeat(w, steps_per_s=v)
    assert state.local_steps_for(c) == H
    decision = _round(state, ids, {a: 8, b: 4, c: H}, rates)
    assert dict(decision.local_steps) == {a: 8, b: 4, c: H}


def test_the_h_w_are_computed_over_the_rounds_members_only():
    clock = FakeClock(100.0)
    state = _state("adaptive", clock)
    a, b, c = ids = _members(state, 3)
    rates = {a: 10.0, b: 5.0, c: 20.0}
    for w in ids:
        state.heartbeat(w, steps_per_s=rates[w])
    assert {w: state.local_steps_for(w) for w in ids} == {a: 4, b: 2, c: H}  # before a round: every live worker
    # c, the fastest, is live but misses the round (it forms at the join timeout): the
    # members' next H_w come from the members' rates, a is the fastest of them
    decision = _round(state, [a, b], {a: 4, b: 2}, rates, clock=clock)
    assert dict(decision.local_steps) == {a: H, b: 4}
    assert {w: state.local_steps_for(w) for w in (a, b)} == {a: H, b: 4}


def test_fixed_gives_every_member_h_whatever_the_rates():
    state = _state("fixed")
    a, b, c = ids = _members(state, 3)
    rates = {a: 10.0, b: 5.0, c: 2.5}
    assert state.run_config(a).sync_local_steps == "fixed"
    for w in ids:
        state.heartbeat(w, steps_per_s=rates[w])
    assert {w: state.local_steps_for(w) for w in ids} == dict.fromkeys(ids, H)
    decision = _round(state, ids, dict.fromkeys(ids, H), rates)
    assert dict(decision.local_steps) == dict.fromkeys(ids, H)
    shown = {w.worker_id: (w.local_steps_per_round, w.steps_per_s) for w in state.status().workers}
    assert shown == {w: (H, pytest.approx(rates[w])) for w in ids}  # the rates are shown, H is kept


# ------------------------------------------------------------------ end to end
class _RatedWorker(SyncDiLoCoWorker):
    """A sync worker whose inner-step rate is injected (steps/s): its probe reports it and
    its votes' compute time is steps / rate, so its H_w does not depend on this machine."""

    rate = 1.0

    def _report_rate(self) -> None:
        reply = self.client.heartbeat(self.worker_id, steps_per_s=self.rate)
        self.local_steps = reply.local_steps or self.local_steps

    def _round_compute_s(self, steps: int) -> float:
        return steps / self.rate


def _worker(srv, rate: float) -> _RatedWorker:
    model = make_model()
    worker = _RatedWorker(
        model,
        inner_opt(model),
        WorkerConfig(server=srv.address),
        sync=SyncWorkerConfig(allreduce_timeout_s=10.0, quorum_timeout_s=20.0),
    )
    worker.rate = rate
    return worker


def test_two_members_at_h_and_h_over_2_average_like_a_single_process_reference(start_server):
    h, rounds = 4, 3
    srv = start_server(
        mode="sync",
        outer=NESTEROV,
        local_steps=h,
        lease_s=30.0,
        sync=SyncConfig(min_workers=2, join_timeout_s=5.0, round_timeout_s=20.0, local_steps="adaptive"),
    )
    fast, slow = _worker(srv, 10.0), _worker(srv, 5.0)
    fast.join()  # the fast worker initializes the server, so its rank is 0
    slow.join()
    for w in (fast, slow):  # both rates known before the first step: the first round is sized too
        w._report_rate()
    assert (fast.local_steps, slow.local_steps) == (h, h // 2)
    run_threads([lambda: train(fast, 0, steps=h * rounds), lambda: train(slow, 1, steps=h // 2 * rounds)])
    by_id = {w.worker_id: (w.local_steps_per_round, w.steps_per_s) for w in srv.state.status().workers}
    assert by_id == {fast.worker_id: (h, pytest.approx(10.0)), slow.worker_id: (h // 2, pytest.approx(5.0))}
    for w in (fast, slow):
        w.close()

    assert [r["local_steps"] for r in fast.stats.rounds] == [h] * rounds
    assert [r["local_steps"] for r in slow.stats.rounds] == [h // 2] * rounds
    assert all(r["committed"] and r["world_size"] == 2 for w in (fast, slow) for r in w.stats.rounds)

    # the reference: replica 0 runs h steps and replica 1 h/2 per round, the mean Δ, Nesterov
    models = [make_model(), make_model()]
    opts = [inner_opt(m) for m in models]
    data = [batches(0), batches(1)]
    theta = flat(models[0]).clone()
    ref_outer = OuterOptimizer(theta, NESTEROV)
    for k in range(rounds):
        deltas = []
        for m, opt, d, steps in zip(models, opts, data, (h, h // 2)):
            for _ in range(steps):
                x, y = next(d)
                ((m(x) - y) ** 2).mean().backward()
                opt.step()
                opt.zero_grad()
            deltas.append(theta - flat(m))
        ref_outer.step((deltas[0] + deltas[1]) / 2, version=k)
        for m in models:
            load(m, theta)
    torch.testing.assert_close(srv.state.params, theta, rtol=1e-6, atol=1e-7)
    for w in (fast, slow):
        assert torch.equal(w._base, srv.state.params)  # members and server hold the same bits


def test_a_sync_worker_reports_no_rate_probe_to_a_fixed_server(start_server):
    srv = start_server(
        mode="sync",
        outer=NESTEROV,
        local_steps=3,
        lease_s=30.0,
        sync=SyncConfig(join_timeout_s=5.0, local_steps="fixed"),
    )
    model = make_model()
    probes = threading.Event()

    class Watched(SyncDiLoCoWorker):
        def _report_rate(self) -> None:
            probes.set()

    worker = Watched(model, inner_opt(model), WorkerConfig(server=srv.address), sync=SyncWorkerConfig())
    with worker:
        train(worker, 0, steps=3)
    assert worker.stats.rounds_committed == 1 and worker.local_steps == 3
    assert not probes.is_set()
