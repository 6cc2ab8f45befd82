"""Long-polled Quorum and Commit (ps/sync/long_poll.py, quorum.py ``poll_quorum``,
worker/long_poll.py): a pending request stays registered between polls and is withdrawn
when its polls stop; the holds are limited; a client from before ``poll`` still blocks."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import STUCK_S, FakeClock

from asyncdiloco.ps.config import SyncConfig
from asyncdiloco.ps.sync.long_poll import HOLD_S, KEEP_S, HeldWaits, max_held_waits
from asyncdiloco.ps.sync.quorum import Assignment, QuorumManager, QuorumMiss
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.tensors import Manifest
from asyncdiloco.worker import long_poll
from asyncdiloco.worker.client import ParameterServerClient

pytestmark = pytest.mark.timeout(60)

MANIFEST = Manifest.from_named_tensors([("w", torch.zeros(4))])


def manager(live: set[int], clock: FakeClock, **kw) -> QuorumManager:
    kw.setdefault("min_workers", 2)
    kw.setdefault("join_timeout_s", 5.0)
    return QuorumManager(SyncConfig(**kw), live_workers=lambda: set(live), on_commit=lambda done: None, clock=clock)


def poll(m: QuorumManager, worker_id: int, *, final: bool = False) -> Assignment | QuorumMiss:
    return m.poll_quorum(worker_id, 0, hold_s=0.0, keep_s=KEEP_S, final=final)


def test_a_pending_request_stays_registered_and_the_quorum_forms_between_polls():
    m = manager({1, 2, 3}, FakeClock(100.0))
    first = poll(m, 1)
    assert isinstance(first, QuorumMiss) and first.pending and first.have == 1 and first.need == 2
    assert isinstance(poll(m, 2), QuorumMiss)
    assert m.waiting_workers() == {1, 2}  # both kept, although neither call is held
    a3 = poll(m, 3)  # the last live worker: the quorum forms now
    assert isinstance(a3, Assignment) and a3.members == (1, 2, 3)
    a1 = poll(m, 1)  # collected at its next poll
    assert isinstance(a1, Assignment) and a1.quorum_id == a3.quorum_id and a1.rank == 0


def test_a_request_whose_polls_stop_is_withdrawn_after_keep_s():
    clock = FakeClock(100.0)
    m = manager({1, 2, 3}, clock, join_timeout_s=30.0)
    poll(m, 1)
    poll(m, 2)
    clock.advance(KEEP_S - 1.0)
    assert isinstance(poll(m, 2), QuorumMiss)  # worker 2 polls again (kept anew), worker 1 stopped
    clock.advance(2.0)
    m.tick()
    assert m.waiting_workers() == {2}  # worker 1 never joins a quorum it will not collect
    clock.advance(10.0)
    assert isinstance(poll(m, 3), QuorumMiss)  # worker 1 is live: not every live worker waits
    assert isinstance(poll(m, 2), QuorumMiss)
    clock.advance(5.0)  # the join timeout: the quorum forms of those still polling
    a2 = poll(m, 2)
    assert isinstance(a2, Assignment) and a2.members == (2, 3)


def test_a_final_poll_withdraws_and_a_closed_manager_answers_final():
    m = manager({1, 2, 3}, FakeClock(100.0))
    last = poll(m, 1, final=True)
    assert isinstance(last, QuorumMiss) and not last.pending and m.waiting_workers() == frozenset()
    poll(m, 2)
    m.close()
    stopping = m.poll_quorum(2, 0, hold_s=STUCK_S, keep_s=KEEP_S, final=False)  # close ends a hold at once
    assert isinstance(stopping, QuorumMiss) and not stopping.pending and "stopping" in stopping.reason


def test_a_held_poll_is_woken_by_the_formation():
    m = manager({1, 2}, FakeClock(100.0))
    got: list[Assignment | QuorumMiss] = []
    held = threading.Thread(target=lambda: got.append(m.poll_quorum(1, 0, hold_s=STUCK_S, keep_s=KEEP_S, final=False)))
    held.start()
    while 1 not in m.waiting_workers():
        threading.Event().wait(0.01)
    assert isinstance(poll(m, 2), Assignment)
    held.join(timeout=STUCK_S)
    assert isinstance(got[0], Assignment) and got[0].members == (1, 2)


def test_held_waits_grant_at_most_the_limit_and_at_most_hold_s():
    waits = HeldWaits(2)
    assert max_held_waits(64) == 8 and max_held_waits(4) == 1
    with waits.hold(30.0) as a, waits.hold(0.25) as b, waits.hold(30.0) as c:
        assert (a, b, c) == (HOLD_S, 0.25, 0.0)  # the third is answered at once
    with waits.hold(0.0) as none:
        assert none == 0.0
    with waits.hold(30.0) as again:
        assert again == HOLD_S  # given back
    assert waits.peak == 2
    with pytest.raises(ValueError, match="limit is 0"):
        HeldWaits(0)


def test_the_client_polls_until_final_and_stops_when_its_wait_is_over(monkeypatch):
    monkeypatch.setattr(long_poll, "POLL_MIN_S", 0.0)  # no pauses: the test counts asks, not time
    asked: list[float] = []
    answers = iter([True, True, False])
    assert long_poll.poll(lambda left: asked.append(left) or next(answers), bool, 30.0) is False
    assert len(asked) == 3 and all(0 < left <= 30.0 for left in asked)
    assert long_poll.poll(lambda left: True, bool, 1e-6) is True  # the wait ran out: the last reply


def test_commit_polls_count_a_vote_once_and_an_old_client_still_blocks(start_server):
    srv = start_server(mode="sync", sync=SyncConfig(min_workers=2, join_timeout_s=60.0, round_timeout_s=60.0))
    client = ParameterServerClient(srv.address, rpc_timeout_s=STUCK_S)
    try:
        a, b = (client.join(MANIFEST, name).worker_id for name in ("a", "b"))
        client.push(MANIFEST.pack([torch.ones(4)]), worker_id=a, push_id=1, base_version=0,
                    kind=pb.PUSH_KIND_INITIAL_PARAMETERS)  # fmt: skip
        # a client from before `poll`: blocks for its timeout, then a final answer
        old = pb.QuorumRequest(worker_id=a, round=0, manifest_hash=MANIFEST.manifest_hash, timeout_s=0.2)
        reply = client._stub.Quorum(old, timeout=STUCK_S)
        assert not reply.formed and not reply.pending and reply.have == 1
        replies: list[pb.QuorumReply] = []

        def ask(w: int) -> None:
            replies.append(client.quorum(worker_id=w, round=0, manifest_hash=MANIFEST.manifest_hash, timeout_s=STUCK_S))

        asking = [threading.Thread(target=ask, args=(w,)) for w in (a, b)]
        for t in asking:
            t.start()
        for t in asking:
            t.join(timeout=STUCK_S)
        assert len(replies) == 2 and all(r.formed for r in replies)
        qid = replies[0].quorum_id
        client.push(torch.ones(4).view(torch.uint8), worker_id=a, push_id=qid, base_version=0,
                    kind=pb.PUSH_KIND_ROUND_RESULT, quorum_id=qid)  # fmt: skip
        vote = pb.CommitRequest(worker_id=a, quorum_id=qid, success=True, total_weight=2.0, num_local_steps=3,
                                num_tokens=7, timeout_s=0.01, poll=True)  # fmt: skip
        for _ in range(3):  # the same vote, sent again: it counts once
            assert not client._stub.Commit(vote, timeout=STUCK_S).decided
        done = client.commit(worker_id=b, quorum_id=qid, success=True, total_weight=2.0, num_local_steps=3,
                             num_tokens=7, timeout_s=STUCK_S)  # fmt: skip
        assert done.decided and done.committed and done.round == 1
        status = client.status()
        assert status.version == 1 and status.rounds_committed == 1 and status.tokens == 14
    finally:
        client.close()
