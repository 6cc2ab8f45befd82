"""QuorumManager (ps/sync/quorum.py) with a fake clock: formation, joins, leases, votes."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import FakeClock

from asyncdiloco.errors import ConfigError, RoundRefusedError
from asyncdiloco.ps.config import SyncConfig
from asyncdiloco.ps.sync.quorum import QuorumManager, QuorumMiss

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def qm():
    clock = FakeClock(100.0)
    live = {1, 2, 3}
    commits = []

    def make(**kw) -> QuorumManager:
        kw.setdefault("min_workers", 2)
        kw.setdefault("join_timeout_s", 5.0)
        kw.setdefault("round_timeout_s", 20.0)
        m = QuorumManager(SyncConfig(**kw), live_workers=lambda: set(live), on_commit=commits.append, clock=clock)
        m.clock, m.live, m.commits = clock, live, commits
        return m

    return make


def commit_round(m: QuorumManager, members: list[int], quorum_id: int, weight: float = 2.0) -> None:
    m.stage_result(members[0], quorum_id, torch.ones(3))
    for w in members:
        m.vote(w, quorum_id, success=True, total_weight=weight, num_tokens=10, num_local_steps=5)


def test_first_round_forms_once_every_live_worker_asked(qm):
    m = qm()
    assert m.request(1, 0) is None
    assert m.request(2, 0) is None  # worker 3 is live and may still come
    a3 = m.request(3, 0)
    assert a3 is not None and a3.members == (1, 2, 3) and a3.rank == 2 and a3.world_size == 3
    a1 = m.request(1, 0)
    assert a1.quorum_id == a3.quorum_id == 1 and a1.rank == 0 and not a1.heal
    assert a1.deadline == m.clock.now + 20.0


def test_join_timeout_forms_without_a_missing_worker(qm):
    m = qm()
    m.request(1, 0)
    m.clock.now += 3.0
    assert m.request(2, 0) is None
    m.clock.now += 1.9  # 4.9 s after the round's first request
    m.tick()
    assert m.request(1, 0) is None
    m.clock.now += 0.2
    got = m.request(1, 0)
    assert got is not None and got.members == (1, 2)


def test_min_workers_is_required_even_after_the_join_timeout(qm):
    m = qm(min_workers=3)
    m.live.discard(3)
    m.request(1, 0)
    m.request(2, 0)
    m.clock.now += 60.0
    m.tick()
    assert m.request(1, 0) is None


def test_previous_members_form_at_once_and_a_newcomer_enters_at_the_next_boundary(qm):
    m = qm()
    m.live.discard(3)
    m.request(1, 0)
    assert m.request(2, 0).members == (1, 2)
    m.live.add(3)  # worker 3 registers while round 1 is in flight
    assert m.request(3, 0) is None  # joiners only at round boundaries
    commit_round(m, [1, 2], 1)
    assert m.round == 1
    # the previous members are all back: the quorum forms without waiting for anyone else,
    # and worker 3 (waiting since round 1) is admitted, told to heal (it holds round 0)
    m.request(1, 1)
    got = m.request(2, 1)
    assert got.members == (1, 2, 3) and got.round == 1 and not got.heal
    a3 = m.request(3, 0)
    assert a3.heal and a3.rank == 2


def test_a_registered_but_absent_newcomer_does_not_hold_up_previous_members(qm):
    m = qm()
    m.live.discard(3)
    m.request(1, 0)
    m.request(2, 0)
    commit_round(m, [1, 2], 1)
    m.live.add(3)  # registered, still training its first round
    m.request(1, 1)
    assert m.request(2, 1).members == (1, 2)


def test_a_worker_whose_lease_lapsed_is_dropped_and_not_waited_for(qm):
    m = qm()
    m.request(1, 0)
    m.request(2, 0)
    assert m.request(3, 0).members == (1, 2, 3)
    commit_round(m, [1, 2, 3], 1)
    m.request(3, 1)  # 3 asks, then its lease lapses
    m.request(1, 1)
    m.live.discard(3)
    got = m.request(2, 1)  # previous members still live (1, 2) are all here
    assert got is not None and got.members == (1, 2)


def test_commit_applies_the_staged_result_once_every_member_voted(qm):
    m = qm()
    m.request(1, 0)
    m.request(2, 0)
    m.request(3, 0)
    delta = torch.tensor([1.0, 2.0])
    m.stage_result(1, 1, delta)
    assert m.vote(1, 1, success=True, total_weight=3.0, num_tokens=7, num_local_steps=5) is None
    assert m.vote(3, 1, success=True, total_weight=3.0, num_local_steps=0) is None  # a healing member
    d = m.vote(2, 1, success=True, total_weight=3.0, num_tokens=9, num_local_steps=5)
    assert d.committed and d.round == 1 and m.round == 1 and m.rounds_committed == 1
    (done,) = m.commits
    assert done.result is delta and done.round == 1
    assert done.tokens_by_worker == {1: 7, 2: 9, 3: 0} and done.steps_by_worker == {1: 5, 2: 0 + 5, 3: 0}
    assert m.decision(1) == d


def test_a_failure_vote_aborts_at_once_and_late_voters_learn_it(qm):
    m = qm()
    for w in (1, 2, 3):
        m.request(w, 0)
    m.stage_result(1, 1, torch.ones(2))
    m.vote(1, 1, success=True, total_weight=3.0)
    d = m.vote(2, 1, success=False, reason="Connection closed by peer")
    assert not d.committed and "worker 2 failed the round: Connection closed by peer" in d.reason
    assert m.vote(3, 1, success=True, total_weight=3.0) == d  # a late success vote changes nothing
    assert m.round == 0 and m.rounds_failed == 1 and not m.commits


def test_a_missing_vote_aborts_at_the_round_deadline_and_the_next_quorum_waits_join_timeout(qm):
    m = qm()
    for w in (1, 2, 3):
        m.request(w, 0)
    m.vote(1, 1, success=False, reason="peer died")
    m.vote(2, 1, success=False, reason="peer died")
    assert m.decision(1).committed is False
    # worker 3 died mid-allreduce and never votes; its lease is still current, so the
    # next quorum waits for it up to join_timeout_s, then forms without it
    m.request(1, 0)
    assert m.request(2, 0) is None
    m.clock.now += 5.0
    assert m.request(2, 0).members == (1, 2)
    m.vote(1, 2, success=True, total_weight=2.0)
    m.clock.now += 19.9
    assert m.decision(2) is None
    m.clock.now += 0.2
    d = m.decision(2)
    assert not d.committed and "workers [2] did not vote within round_timeout_s=20 s" in d.reason


def test_a_member_that_left_is_not_waited_for(qm):
    m = qm()
    for w in (1, 2, 3):
        m.request(w, 0)
    commit_round(m, [1, 2, 3], 1)
    m.live.discard(3)  # left cleanly (or its lease lapsed)
    m.request(1, 1)
    assert m.request(2, 1).members == (1, 2)


def test_all_success_without_the_result_aborts(qm):
    m = qm()
    m.live.discard(3)
    m.request(1, 0)
    m.request(2, 0)
    m.vote(1, 1, success=True, total_weight=2.0)
    d = m.vote(2, 1, success=True, total_weight=2.0)
    assert not d.committed and "voted before uploading" in d.reason


def test_a_round_where_everyone_healed_commits_without_moving_the_round(qm):
    m = qm()
    m.live.discard(3)
    m.request(1, -1)
    assert m.request(2, -1).heal
    m.vote(1, 1, success=True, total_weight=0.0)
    d = m.vote(2, 1, success=True, total_weight=0.0)
    assert d.committed and d.round == 0 and m.commits[0].result is None and m.rounds_committed == 0


def test_results_and_votes_from_outsiders_are_refused(qm):
    m = qm()
    m.live.discard(3)
    with pytest.raises(RoundRefusedError, match="quorum 1 is unknown"):
        m.vote(1, 1, success=True)
    m.request(1, 0)
    m.request(2, 0)
    with pytest.raises(RoundRefusedError, match="only its rank 0 \\(worker 1\\) uploads"):
        m.stage_result(2, 1, torch.ones(1))
    with pytest.raises(RoundRefusedError, match="not a member of quorum 1"):
        m.vote(3, 1, success=True)
    with pytest.raises(RoundRefusedError, match="arrived but quorum 1 is the current one"):
        m.stage_result(1, 7, torch.ones(1))


def test_withdraw_forgets_a_waiting_worker(qm):
    m = qm()
    m.request(1, 0)
    m.withdraw(1)
    m.request(2, 0)
    m.clock.now += 10
    m.tick()
    assert m.request(2, 0) is None  # only one worker waits; min_workers is 2


def test_blocking_wait_quorum_and_decision_with_threads():
    live = {1, 2}
    m = QuorumManager(
        SyncConfig(min_workers=2, join_timeout_s=5.0, round_timeout_s=5.0),
        live_workers=lambda: set(live),
        on_commit=lambda done: None,
    )
    got = {}
    t = threading.Thread(target=lambda: got.setdefault(1, m.wait_quorum(1, 0, timeout_s=10.0)))
    t.start()
    got[2] = m.wait_quorum(2, 0, timeout_s=10.0)
    t.join(timeout=10)
    assert got[1].members == got[2].members == (1, 2)
    v = threading.Thread(target=lambda: got.setdefault("d", m.wait_decision(1, timeout_s=10.0)))
    v.start()
    m.vote(1, 1, success=True, total_weight=0.0)
    m.vote(2, 1, success=True, total_weight=0.0)
    v.join(timeout=10)
    assert got["d"].committed
    missed = m.wait_quorum(1, 0, timeout_s=0.05)  # alone: withdrawn after the timeout
    assert isinstance(missed, QuorumMiss) and (missed.have, missed.need) == (1, 2)


@pytest.mark.parametrize(
    "kw", [{"min_workers": 0}, {"join_timeout_s": -1.0}, {"round_timeout_s": 0.0}, {"weighting": "median"}]
)
def test_sync_config_is_validated(kw):
    with pytest.raises(ConfigError):
        SyncConfig(**kw)


def test_callers_that_time_out_and_ask_again_do_not_postpone_the_join_timeout():
    now = [0.0]
    live = {1, 2, 3}
    m = QuorumManager(
        SyncConfig(min_workers=2, join_timeout_s=4.0),
        live_workers=lambda: set(live),
        on_commit=lambda done: None,
        clock=lambda: now[0],
    )
    for w in (1, 2, 3):
        m.request(w, 0)
    m.vote(1, 1, success=False, reason="peer died")
    m.vote(2, 1, success=False, reason="peer died")  # 3 died; its lease is still current
    m.request(1, 0)
    assert isinstance(m.wait_quorum(2, 0, timeout_s=0.01), QuorumMiss)  # gave up (withdrawn)...
    now[0] += 3.0
    assert m.request(2, 0) is None  # ...and asks again: the clock of the round still runs
    now[0] += 1.0
    assert m.request(1, 0).members == (1, 2)
