"""Who forms a sync quorum (ps/sync/quorum.py): joiners merge into the running group at its
next round boundary, two disjoint groups never take turns, and a wait without a quorum
says why ("quorum not reached: have 1, need 2") and is tried again H steps later.

The formation tests drive the ``QuorumManager`` with a fake clock and scripted workers
(``simulate``: each trains H steps in a fixed time, asks, votes, trains again), so they
assert over many rounds in milliseconds; one end-to-end test runs real in-process sync
workers against a real server."""

from __future__ import annotations

import dataclasses
import logging
import threading

import pytest
import torch
from helpers import STUCK_S, FakeClock, run_threads, wait_until
from torch import nn

from asyncdiloco.algo.config import OuterConfig
from asyncdiloco.ps.config import SyncConfig
from asyncdiloco.ps.sync.quorum import Assignment, QuorumManager, QuorumMiss
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.worker.client import ParameterServerClient
from asyncdiloco.worker.config import SyncWorkerConfig, WorkerConfig
from asyncdiloco.worker.sync_worker import SyncDiLoCoWorker

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_thread")]


# ------------------------------------------------------------------ simulation
@dataclasses.dataclass
class SimWorker:
    """A scripted sync worker: trains H steps in ``h_time_s``, asks for the quorum, takes
    ``allreduce_s`` to reduce, votes, waits for the decision and trains again. It joins
    (pulling the committed round, as a real join heals) ``join_delay_s`` after round
    ``joins_after_round`` committed (None: at time 0), and leaves after round
    ``leaves_after_round`` committed (None: never)."""

    wid: int
    h_time_s: float = 6.0
    joins_after_round: int | None = None
    join_delay_s: float = 0.0
    leaves_after_round: int | None = None
    state: str = "absent"
    round: int = -1
    until: float = 0.0  # end of the current phase (joining, training, reducing)
    asked_at: float = 0.0
    first_asked_at: float | None = None
    #: The id of the first quorum formed after its first request.
    first_quorum_after: int | None = None
    assignment: Assignment | None = None


@dataclasses.dataclass
class SimQuorum:
    quorum_id: int
    formed_at: float
    members: tuple[int, ...]
    heal: set[int]
    committed: bool = False


def simulate(
    workers: list[SimWorker],
    *,
    min_workers: int = 2,
    join_timeout_s: float = 3.5,
    quorum_wait_s: float = 60.0,
    allreduce_s: float = 0.3,
    until_s: float = 240.0,
    dt_s: float = 0.05,
) -> dict[int, SimQuorum]:
    """Run the scripted workers against one ``QuorumManager`` on a fake clock.

    Returns:
        Every quorum formed, by quorum id.
    """
    clock = FakeClock(0.0)
    live: set[int] = set()
    m = QuorumManager(
        SyncConfig(min_workers=min_workers, join_timeout_s=join_timeout_s, round_timeout_s=30.0),
        live_workers=lambda: set(live),
        on_commit=lambda done: None,
        clock=clock,
    )
    quorums: dict[int, SimQuorum] = {}

    def train(w: SimWorker) -> None:
        w.state, w.until = "training", clock.now + w.h_time_s

    def ask(w: SimWorker) -> None:
        got = m.request(w.wid, w.round)
        if got is not None:
            q = quorums.setdefault(got.quorum_id, SimQuorum(got.quorum_id, clock.now, got.members, set()))
            if got.heal:
                q.heal.add(w.wid)
            w.assignment, w.state, w.until = got, "reducing", clock.now + allreduce_s
        elif clock.now - w.asked_at >= quorum_wait_s:  # gave up: trains on, asks at its next sync point
            m.withdraw(w.wid)
            train(w)

    def vote(w: SimWorker) -> None:
        a = w.assignment
        assert a is not None
        weight = float(sum(member not in quorums[a.quorum_id].heal for member in a.members))  # Σ w, w = 1 or 0
        if a.rank == 0 and weight > 0:
            m.stage_result(w.wid, a.quorum_id, torch.zeros(1))
        m.vote(w.wid, a.quorum_id, success=True, total_weight=weight, num_local_steps=0 if a.heal else 1)
        w.state = "voted"

    def collect(w: SimWorker) -> None:
        a = w.assignment
        assert a is not None
        decision = m.decision(a.quorum_id)
        if decision is None:
            return
        quorums[a.quorum_id].committed = decision.committed
        w.round = decision.round if decision.committed else a.round  # a healer pulled a.round
        train(w)

    while clock.now < until_s:
        for w in workers:
            if w.state == "absent":
                if w.joins_after_round is None or m.round >= w.joins_after_round:
                    w.state, w.until = "joining", clock.now + w.join_delay_s
            elif w.state == "joining" and clock.now >= w.until:
                live.add(w.wid)
                w.round = m.round  # the join pulls the committed state
                train(w)
            elif w.leaves_after_round is not None and m.round >= w.leaves_after_round and w.state == "training":
                live.discard(w.wid)
                m.withdraw(w.wid)
                w.state = "gone"
            elif w.state == "training" and clock.now >= w.until:
                w.state, w.asked_at = "asking", clock.now
                if w.first_asked_at is None:
                    w.first_asked_at, w.first_quorum_after = clock.now, m._next_quorum_id  # noqa: SLF001
                ask(w)
            elif w.state == "asking":
                ask(w)
            elif w.state == "reducing" and clock.now >= w.until:
                vote(w)
            elif w.state == "voted":
                collect(w)
        m.tick()
        clock.advance(dt_s)
    return quorums


def in_order(quorums: dict[int, SimQuorum]) -> list[SimQuorum]:
    return [quorums[k] for k in sorted(quorums)]


def assert_no_disjoint_turns(quorums: list[SimQuorum]) -> None:
    """Consecutive quorums share a member: no two groups take turns."""
    for before, after in zip(quorums, quorums[1:]):
        assert set(before.members) & set(after.members), (
            f"quorum {after.quorum_id} {list(after.members)} shares no member with quorum {before.quorum_id} "
            f"{list(before.members)}: two groups take turns ({[list(q.members) for q in quorums[:12]]} ...)"
        )


def assert_joined_within_one_round(quorums: list[SimQuorum], joiner: SimWorker) -> None:
    """The first quorum formed after the joiner asked holds it (healing, if it is behind),
    and it contributes (a member that does not heal) in the quorum after that one."""
    assert joiner.first_quorum_after is not None, f"worker {joiner.wid} never asked"
    after = [q for q in quorums if q.quorum_id >= joiner.first_quorum_after]
    assert len(after) >= 2, f"too few quorums after worker {joiner.wid} asked"
    assert joiner.wid in after[0].members, (
        f"quorum {after[0].quorum_id} {list(after[0].members)}, the first after worker {joiner.wid} asked, left it out"
    )
    assert joiner.wid in after[1].members and joiner.wid not in after[1].heal, (
        f"worker {joiner.wid} does not contribute to quorum {after[1].quorum_id} "
        f"(members {list(after[1].members)}, healing {sorted(after[1].heal)})"
    )


@pytest.mark.parametrize("join_timeout_s", [3.5, 1.0])
@pytest.mark.parametrize("join_delay_s", [0.5, 2.0, 3.0, 5.5])
def test_two_joiners_merge_into_the_running_group_at_its_next_boundary(join_timeout_s, join_delay_s):
    """Issue 15 item 14: equal speeds, H steps take 6 s, two joiners arrive some seconds
    after a round. Before: {C, D} (healing) and {A, B} took turns for ever."""
    a, b = SimWorker(1), SimWorker(2)
    c, d = (SimWorker(w, joins_after_round=2, join_delay_s=join_delay_s) for w in (3, 4))
    quorums = in_order(simulate([a, b, c, d], join_timeout_s=join_timeout_s))
    assert len(quorums) >= 20
    assert_no_disjoint_turns(quorums)
    for joiner in (c, d):
        assert_joined_within_one_round(quorums, joiner)
    merged = [q for q in quorums if q.quorum_id >= max(c.first_quorum_after or 0, d.first_quorum_after or 0)]
    assert all(q.members == (1, 2, 3, 4) for q in merged[1:])
    assert all(q.committed and not q.heal for q in merged[1:-1])  # in step from then on: everybody contributes


def test_joiners_at_different_times_and_speeds_all_merge():
    """Joiners one by one, at several phases of the group's round, at slightly different
    speeds (the spread stays below the join timeout)."""
    workers = [
        SimWorker(1, h_time_s=6.0),
        SimWorker(2, h_time_s=6.2),
        SimWorker(3, h_time_s=5.9, joins_after_round=1, join_delay_s=1.0),
        SimWorker(4, h_time_s=6.1, joins_after_round=3, join_delay_s=4.5),
        SimWorker(5, h_time_s=6.0, joins_after_round=3, join_delay_s=0.2),
        SimWorker(6, h_time_s=6.3, joins_after_round=6, join_delay_s=2.5),
    ]
    quorums = in_order(simulate(workers, until_s=300.0))
    assert_no_disjoint_turns(quorums)
    for joiner in workers[2:]:
        assert_joined_within_one_round(quorums, joiner)
    assert quorums[-2].members == (1, 2, 3, 4, 5, 6) and quorums[-2].committed  # the last one is in flight


def test_joiners_form_their_own_quorum_once_the_running_group_is_gone():
    """A group of newcomers waits for the running group only while it lives: once its
    members left, the newcomers form on their own."""
    a, b = SimWorker(1, leaves_after_round=4), SimWorker(2, leaves_after_round=4)
    c, d = SimWorker(3, joins_after_round=2, join_delay_s=2.0), SimWorker(4, joins_after_round=2, join_delay_s=2.0)
    quorums = in_order(simulate([a, b, c, d], until_s=120.0))
    assert_no_disjoint_turns(quorums[:4])
    assert quorums[-2].members == (3, 4) and quorums[-2].committed
    assert sum(q.members == (3, 4) for q in quorums) >= 5


# ----------------------------------------------------------- scripted, unit
@pytest.fixture
def qm():
    clock = FakeClock(100.0)
    live = {1, 2, 3, 4}

    def make(**kw) -> QuorumManager:
        kw.setdefault("min_workers", 2)
        kw.setdefault("join_timeout_s", 3.5)
        m = QuorumManager(SyncConfig(**kw), live_workers=lambda: set(live), on_commit=lambda done: None, clock=clock)
        m.clock, m.live = clock, live
        return m

    return make


def commit(m: QuorumManager, quorum_id: int, members: tuple[int, ...], contributing: int) -> None:
    if contributing:
        m.stage_result(members[0], quorum_id, torch.zeros(1))
    for w in members:
        assert m.vote(w, quorum_id, success=True, total_weight=float(contributing)) is None or w == members[-1]


def test_queued_newcomers_wait_past_the_join_timeout_for_the_running_group(qm):
    m = qm()
    m.live -= {3, 4}
    m.request(1, 0)
    first = m.request(2, 0)
    assert first.members == (1, 2)
    commit(m, first.quorum_id, first.members, 2)
    m.live |= {3, 4}  # joined meanwhile, pulled round 1, trained H steps
    assert m.request(3, 1) is None
    assert m.request(4, 1) is None
    m.clock.advance(10.0)  # far past the join timeout: 1 and 2 still train
    m.tick()
    assert m.request(3, 1) is None and m.request(4, 1) is None
    m.request(1, 1)
    got = m.request(2, 1)  # the running group's boundary: everybody waiting enters
    assert got is not None and got.members == (1, 2, 3, 4) and not got.heal
    assert not m.request(3, 1).heal  # same round: 3 and 4 contribute at once


def test_queued_newcomers_form_alone_once_the_running_group_lost_its_leases(qm):
    m = qm()
    m.live -= {3, 4}
    m.request(1, 0)
    first = m.request(2, 0)
    commit(m, first.quorum_id, first.members, 2)
    m.live |= {3, 4}
    assert m.request(3, 1) is None and m.request(4, 1) is None  # queued behind 1 and 2
    m.live -= {1, 2}  # both died: their leases lapse
    got = m.request(3, 1)  # no running group any more: every live worker waits
    assert got is not None and got.members == (3, 4)


def test_a_running_group_member_late_by_the_join_timeout_is_left_out_not_waited_for(qm):
    m = qm()
    for w in (1, 2, 3):
        m.request(w, 0)
    m.live.discard(4)
    first = m.request(1, 0) or m._assigned[1]  # noqa: SLF001 - formed on 3's request
    commit(m, 1, (1, 2, 3), 3)
    m.request(1, 1)
    m.request(2, 1)
    m.clock.advance(3.4)
    m.tick()
    assert m.request(1, 1) is None  # 3 still has 0.1 s
    m.clock.advance(0.2)
    got = m.request(1, 1)
    assert got is not None and got.members == (1, 2) and first.members == (1, 2, 3)


def test_a_wait_without_a_quorum_says_have_and_need():
    """Issue 15 item 15, the server's side: one worker, --min-workers 2."""
    m = QuorumManager(SyncConfig(min_workers=2, join_timeout_s=0.0), live_workers=lambda: {7}, on_commit=print)
    missed = m.wait_quorum(7, 0, timeout_s=0.01)
    assert isinstance(missed, QuorumMiss)
    assert (missed.have, missed.need, missed.queued) == (1, 2, False)
    assert missed.reason.startswith("quorum not reached: have 1, need 2 (--min-workers 2")


def test_a_wait_behind_the_running_group_says_queued(qm):
    m = qm()
    m.live -= {3, 4}
    m.request(1, 0)
    got = m.request(2, 0)
    missed = m.wait_quorum(3, 0, timeout_s=0.01)  # the round of 1 and 2 is in flight
    assert isinstance(missed, QuorumMiss) and missed.queued and "queued" in missed.reason
    commit(m, got.quorum_id, got.members, 2)
    m.live.add(3)
    missed = m.wait_quorum(3, 1, timeout_s=0.01)  # 1 and 2 train
    assert missed.queued and "waiting for the running group (workers [1, 2]" in missed.reason


# ------------------------------------------------------------ end to end
def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))


def new_worker(srv, **sync) -> SyncDiLoCoWorker:
    model = make_model()
    sync.setdefault("allreduce_timeout_s", 10.0)
    sync.setdefault("quorum_timeout_s", STUCK_S)
    return SyncDiLoCoWorker(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        WorkerConfig(server=srv.address),
        sync=SyncWorkerConfig(**sync),
    )


def train(worker: SyncDiLoCoWorker, index: int, until, compute_s: float = 0.0) -> None:
    """The user's loop: ``compute_s`` stands for each inner step's compute time."""
    gen = torch.Generator().manual_seed(index)
    pause = threading.Event()
    while not until():
        x = torch.randn(8, 4, generator=gen)
        ((worker.model(x) - x.sum(1, keepdim=True)) ** 2).mean().backward()
        worker.inner_optimizer.step()
        worker.inner_optimizer.zero_grad()
        pause.wait(compute_s)


def test_real_joiners_merge_into_the_running_group_end_to_end(start_server):
    """Issue 15 item 14 with real workers, gloo groups and a real server: H steps take
    three times the join timeout, and two joiners start one inner step into the group's
    round, so they ask after the group's boundary. Both must contribute to a committed
    round, and no two consecutive quorums may be disjoint (before: {C, D} healed alone,
    the join timeout after they asked, and the two pairs took turns)."""
    H, step_s = 3, 0.3
    srv = start_server(
        mode="sync",
        outer=OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0),
        local_steps=H,
        lease_s=30.0,
        sync=SyncConfig(min_workers=2, join_timeout_s=0.3, round_timeout_s=20.0),
    )
    a, b = new_worker(srv), new_worker(srv)
    a.join()
    b.join()
    joiners: list[SyncDiLoCoWorker] = []
    quorum = srv.state.quorum
    assert quorum is not None

    def contributed(w: SyncDiLoCoWorker) -> bool:
        return any(r["committed"] and not r["heal"] for r in w.stats.rounds)

    def done() -> bool:  # both joiners contributed; else stop after a bounded number of rounds
        return (len(joiners) == 2 and all(contributed(w) for w in joiners)) or quorum.round >= 12

    def joiner(index: int) -> None:
        wait_until(lambda: a.stats.rounds_committed >= 1 and a.stats.inner_steps > H, "a step into round 2")
        w = new_worker(srv)
        joiners.append(w)
        with w:
            train(w, index, done, compute_s=step_s)

    def group_member(w: SyncDiLoCoWorker, index: int) -> None:
        train(w, index, done, compute_s=step_s)
        w.close()

    run_threads([lambda: group_member(a, 0), lambda: group_member(b, 1), lambda: joiner(2), lambda: joiner(3)])
    members: dict[int, set[int]] = {}
    for w in (a, b, *joiners):
        for r in w.stats.rounds:
            members.setdefault(r["quorum_id"], set()).add(w.worker_id)
    ids = sorted(members)
    for before, after in zip(ids, ids[1:]):
        assert members[before] & members[after], f"quorums {before} and {after} are disjoint: {members}"
    for w in joiners:
        assert contributed(w), f"joiner {w.worker_id} never contributed: {w.stats.rounds}"


def test_a_missed_quorum_is_tried_again_at_the_next_sync_point_with_the_reason(start_server, caplog):
    """Issue 15 item 15: one worker, --min-workers 2. Before: the reply said only
    formed=false, the log "no quorum within 4 s", and after the first miss every inner
    step asked for a quorum again."""
    H = 3
    srv = start_server(
        mode="sync",
        outer=OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0),
        local_steps=H,
        sync=SyncConfig(min_workers=2, join_timeout_s=0.0),
    )
    worker = new_worker(srv)
    asked: list[tuple[int, pb.QuorumReply]] = []  # (inner steps at the call, the reply)
    real_quorum = worker.client.quorum

    def quorum(**kw):  # the real call, with a short wait: the server answers a miss at once
        reply = real_quorum(**{**kw, "timeout_s": 0.05})
        asked.append((worker.stats.inner_steps, reply))
        return reply

    worker.client.quorum = quorum
    caplog.set_level(logging.WARNING, logger="asyncdiloco.worker.sync_worker")
    with worker:
        train(worker, 0, lambda: worker.stats.inner_steps >= 4 * H)
    assert [at for at, _ in asked] == [H, 2 * H, 3 * H, 4 * H]  # one try per sync point, not per step
    assert all(reply.reason.startswith("quorum not reached: have 1, need 2") for _, reply in asked)
    assert worker.stats.rounds_skipped == 4
    logged = [r.getMessage() for r in caplog.records if "no quorum" in r.getMessage()]
    assert len(logged) == 4 and "quorum not reached: have 1, need 2" in logged[0]


def test_a_queued_joiner_asks_again_until_the_running_group_reaches_its_boundary(start_server):
    """A worker told ``queued`` waits on (up to twice its own H-step time) rather than
    training steps that its heal would drop; a plain miss ends the wait at once."""
    srv = start_server(
        mode="sync",
        outer=OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0),
        local_steps=2,
        sync=SyncConfig(min_workers=2, join_timeout_s=0.0),
    )
    worker = new_worker(srv)
    replies = [
        pb.QuorumReply(formed=False, queued=True, have=1, need=2, reason="waiting for the running group"),
        pb.QuorumReply(formed=False, queued=True, have=1, need=2, reason="waiting for the running group"),
        pb.QuorumReply(formed=False, have=1, need=2, reason="quorum not reached: have 1, need 2"),
    ]
    timeouts: list[float] = []

    def quorum(**kw):
        timeouts.append(kw["timeout_s"])
        return replies[len(timeouts) - 1]

    with worker:
        worker.client.quorum = quorum
        worker._steps_began_at -= 1000.0  # noqa: SLF001 - its H steps took 1000 s: a long wait is allowed
        assert worker._wait_for_quorum() is None  # noqa: SLF001
    assert len(timeouts) == 3 and timeouts[0] == STUCK_S and 2000.0 <= timeouts[1] < 2000.0 + STUCK_S
    assert worker.stats.rounds_skipped == 1


def test_the_quorum_reply_carries_have_need_and_the_reason(start_server):
    """The reply a stock client gets (Quorum over gRPC)."""
    srv = start_server(
        mode="sync",
        outer=OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0),
        local_steps=2,
        sync=SyncConfig(min_workers=2, join_timeout_s=0.0),
    )
    worker = new_worker(srv)
    worker.join()  # registers and initializes the global model
    client = ParameterServerClient(srv.address)
    try:
        reply = client.quorum(
            worker_id=worker.worker_id, round=0, manifest_hash=worker.manifest.manifest_hash, timeout_s=0.05
        )
    finally:
        client.close()
        worker.close()
    assert not reply.formed and (reply.have, reply.need, reply.queued) == (1, 2, False)
    assert reply.reason.startswith("quorum not reached: have 1, need 2 (--min-workers 2")
