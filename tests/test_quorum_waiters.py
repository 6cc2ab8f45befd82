"""Held Quorum and Commit waits end with their call (quorum.py ``wait_quorum`` /
``poll_quorum`` / ``wait_decision`` with ``alive``, long_poll.py ``CallWatch`` and
``check_wait``): a cancelled call frees its thread and withdraws its request, a worker
has one held call (a newer one replaces the older), and ``timeout_s`` is bounded."""

from __future__ import annotations

import math
import threading

import grpc
import pytest
import torch
from helpers import STUCK_S, FakeClock, wait_until

from asyncdiloco.errors import InvalidPayloadError
from asyncdiloco.ps.config import SyncConfig
from asyncdiloco.ps.sync.long_poll import KEEP_S, MAX_WAIT_S, check_wait
from asyncdiloco.ps.sync.quorum import Assignment, QuorumManager, QuorumMiss
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.tensors import Manifest
from asyncdiloco.worker.client import ParameterServerClient

pytestmark = pytest.mark.timeout(60)

MANIFEST = Manifest.from_named_tensors([("w", torch.zeros(4))])


def manager(live: set[int], **kw) -> QuorumManager:
    kw.setdefault("min_workers", 2)
    kw.setdefault("join_timeout_s", 30.0)
    clock = FakeClock(100.0)
    return QuorumManager(SyncConfig(**kw), live_workers=lambda: set(live), on_commit=lambda done: None, clock=clock)


def in_thread(target) -> tuple[threading.Thread, list]:
    got: list = []
    t = threading.Thread(target=lambda: got.append(target()), daemon=True)
    t.start()
    return t, got


def test_a_cancelled_blocking_wait_ends_and_withdraws_its_request():
    m = manager({1, 2})
    cancelled = threading.Event()
    t, got = in_thread(lambda: m.wait_quorum(1, 0, STUCK_S, alive=lambda: not cancelled.is_set()))
    wait_until(lambda: 1 in m.waiting_workers(), "worker 1 waits")
    cancelled.set()
    m.notify()  # what the servicer's call-end callback does
    t.join(timeout=STUCK_S)
    assert not t.is_alive() and isinstance(got[0], QuorumMiss)
    assert m.waiting_workers() == frozenset()  # no quorum is formed with a worker that left


def test_a_newer_wait_of_the_same_worker_replaces_the_older_one():
    m = manager({1, 2, 3})
    old, old_got = in_thread(lambda: m.wait_quorum(1, 0, STUCK_S))
    wait_until(lambda: 1 in m.waiting_workers(), "worker 1 waits")
    new, new_got = in_thread(lambda: m.wait_quorum(1, 0, STUCK_S))
    old.join(timeout=STUCK_S)  # answered at once, without a quorum
    assert not old.is_alive() and isinstance(old_got[0], QuorumMiss) and old_got[0].pending
    assert "replaced by a newer Quorum call of worker 1" in old_got[0].reason
    assert m.waiting_workers() == {1}  # the request stays: the newer call holds it
    polled = m.poll_quorum(1, 0, hold_s=0.0, keep_s=KEEP_S, final=False)  # a poll replaces it too
    assert isinstance(polled, QuorumMiss)
    new.join(timeout=STUCK_S)
    assert not new.is_alive() and "replaced" in new_got[0].reason
    assert isinstance(m.poll_quorum(2, 0, hold_s=0.0, keep_s=KEEP_S, final=False), QuorumMiss)
    assert isinstance(m.poll_quorum(3, 0, hold_s=0.0, keep_s=KEEP_S, final=False), Assignment)


def test_a_cancelled_or_replaced_commit_wait_ends():
    m = manager({1, 2})
    m.request(1, 0)
    qid = m.request(2, 0).quorum_id
    m.vote(1, qid, success=True, total_weight=2.0)
    cancelled = threading.Event()
    t, got = in_thread(lambda: m.wait_decision(qid, STUCK_S, worker_id=1, alive=lambda: not cancelled.is_set()))
    cancelled.set()
    m.notify()
    t.join(timeout=STUCK_S)
    assert not t.is_alive() and got == [None]
    old, old_got = in_thread(lambda: m.wait_decision(qid, STUCK_S, worker_id=1))
    wait_until(lambda: 1 in m._commit_calls, "the commit wait is held")
    new, new_got = in_thread(lambda: m.wait_decision(qid, STUCK_S, worker_id=1))
    old.join(timeout=STUCK_S)
    assert not old.is_alive() and old_got == [None]  # the newer one waits instead
    m.vote(2, qid, success=True, total_weight=2.0)
    new.join(timeout=STUCK_S)
    assert new_got[0] is not None and new_got[0].quorum_id == qid  # decided (aborted: no result was staged)


@pytest.mark.parametrize("bad", [math.inf, math.nan, 1e300, MAX_WAIT_S * 2])
def test_an_unbounded_blocking_timeout_is_refused(bad):
    with pytest.raises(InvalidPayloadError, match=r"timeout_s is .* (finite|limit of 3600 s)"):
        check_wait(bad, poll=False, what="Quorum")
    check_wait(MAX_WAIT_S, poll=False, what="Quorum")
    if math.isfinite(bad):
        check_wait(bad, poll=True, what="Quorum")  # a long poll holds HOLD_S at most anyway


def test_quorum_calls_abandoned_by_their_client_free_the_server_threads(start_server):
    """The black-box fault: blocking Quorum calls with a huge timeout_s and a short client
    deadline used to keep every RPC thread, so Status timed out."""
    srv = start_server(mode="sync", max_concurrent_rpcs=4, sync=SyncConfig(min_workers=2, join_timeout_s=1.0))
    client = ParameterServerClient(srv.address, rpc_timeout_s=STUCK_S)
    try:
        a = client.join(MANIFEST, "a").worker_id
        client.push(MANIFEST.pack([torch.ones(4)]), worker_id=a, push_id=1, base_version=0,
                    kind=pb.PUSH_KIND_INITIAL_PARAMETERS)  # fmt: skip
        ask = pb.QuorumRequest(worker_id=a, round=0, manifest_hash=MANIFEST.manifest_hash, timeout_s=MAX_WAIT_S)
        calls = [client._stub.Quorum.future(ask, timeout=0.3) for _ in range(8)]  # twice the pool
        for call in calls:  # each ends: DEADLINE_EXCEEDED, or answered at once, replaced by a newer call
            try:
                assert not call.result().formed
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_until(lambda: srv.state.quorum.waiting_workers() == frozenset(), "the abandoned requests are withdrawn")
        assert len(client.status().workers) == 1  # a free RPC thread answers
        huge = pb.QuorumRequest(worker_id=a, round=0, manifest_hash=MANIFEST.manifest_hash, timeout_s=1e300)
        with pytest.raises(grpc.RpcError) as refused:
            client._stub.Quorum(huge, timeout=STUCK_S)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "3600" in refused.value.details()
    finally:
        client.close()
