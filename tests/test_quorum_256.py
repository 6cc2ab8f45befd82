"""A sync quorum of 256 members on one server with its default pool of 64 RPC threads.

256 clients (threads, each calling the real Quorum, Push and Commit RPCs over gRPC the
way a member does) form one quorum and commit a round. Waiting in Quorum or Commit is a
long poll (docs/protocol.md, "Long-polled waits"): it holds no server thread, so a
Status call is answered while all 256 wait, and at most a small fraction of the pool is
ever holding a waiting call.
"""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import STUCK_S, run_threads, wait_until

from asyncdiloco.ps.config import ServerConfig, SyncConfig
from asyncdiloco.ps.sync.long_poll import max_held_waits
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.tensors import Manifest
from asyncdiloco.worker.client import ParameterServerClient

pytestmark = pytest.mark.timeout(240)

MEMBERS = 256
#: Clients (channels) the members share, as members on a few hosts would.
CHANNELS = 8
MANIFEST = Manifest.from_named_tensors([("w", torch.zeros(8))])


def test_one_server_forms_a_quorum_of_256_and_commits_it(start_server):
    pool = ServerConfig().max_concurrent_rpcs  # the default pool: 64 threads
    srv = start_server(
        mode="sync",
        lease_s=600.0,
        sync=SyncConfig(min_workers=MEMBERS, join_timeout_s=600.0, round_timeout_s=600.0),
    )
    assert srv.config.max_concurrent_rpcs == pool < MEMBERS
    rounds = srv.state.rounds.quorum
    clients = [ParameterServerClient(srv.address, rpc_timeout_s=STUCK_S) for _ in range(CHANNELS)]
    try:
        ids = [clients[i % CHANNELS].join(MANIFEST, f"m{i}").worker_id for i in range(MEMBERS)]
        late = clients[0].join(MANIFEST, "late").worker_id  # live, not asking: the quorum waits for it
        clients[0].push(
            MANIFEST.pack([torch.ones(8)]), worker_id=ids[0], push_id=1, base_version=0,
            kind=pb.PUSH_KIND_INITIAL_PARAMETERS,
        )  # fmt: skip
        replies: dict[int, pb.QuorumReply] = {}

        def ask(i: int) -> None:
            replies[i] = clients[i % CHANNELS].quorum(
                worker_id=ids[i], round=0, manifest_hash=MANIFEST.manifest_hash, timeout_s=STUCK_S * 3
            )

        asking = [threading.Thread(target=ask, args=(i,), daemon=True) for i in range(MEMBERS)]
        for t in asking:
            t.start()
        wait_until(lambda: len(rounds.waiting_workers()) == MEMBERS, f"all {MEMBERS} quorum requests to wait")
        # while all 256 wait, the server still answers other calls: no thread is held by them
        status = clients[1].status()
        assert status.version == 0 and status.rounds_committed == 0
        assert srv.state.rounds.peak_held_waits <= max_held_waits(pool) < pool
        assert not replies  # nobody got a quorum yet: it waits for the late worker
        clients[0].leave(late)  # now every live worker waits: the quorum forms
        for t in asking:
            t.join(timeout=STUCK_S)
        assert not any(t.is_alive() for t in asking), "a member still waits for its quorum"

        assert all(r.formed for r in replies.values()), [r.reason for r in replies.values() if not r.formed][:3]
        assert len({r.quorum_id for r in replies.values()}) == 1
        assert {tuple(r.members) for r in replies.values()} == {tuple(sorted(ids))}
        assert sorted(r.rank for r in replies.values()) == list(range(MEMBERS))
        assert {r.world_size for r in replies.values()} == {MEMBERS}
        q = replies[0]
        rank0 = q.members[0]
        clients[0].push(  # rank 0 uploads the reduced pseudo-gradient before it votes
            torch.full((8,), 0.5).view(torch.uint8), worker_id=rank0, push_id=q.quorum_id, base_version=q.round,
            kind=pb.PUSH_KIND_ROUND_RESULT, quorum_id=q.quorum_id,
        )  # fmt: skip
        decisions: dict[int, pb.CommitReply] = {}

        def vote(i: int) -> None:
            decisions[i] = clients[i % CHANNELS].commit(
                worker_id=ids[i], quorum_id=q.quorum_id, success=True, total_weight=float(MEMBERS),
                num_tokens=10, num_local_steps=2, timeout_s=STUCK_S * 3,
            )  # fmt: skip

        run_threads([lambda i=i: vote(i) for i in range(MEMBERS)], timeout_s=STUCK_S * 2)
        assert all(d.decided and d.committed and d.round == 1 for d in decisions.values()), [
            d.reason for d in decisions.values() if not d.committed
        ][:3]
        assert len(decisions) == MEMBERS
        status = clients[1].status()
        assert status.version == 1 and status.rounds_committed == 1 and status.rounds_failed == 0
        assert srv.state.rounds.peak_held_waits <= max_held_waits(pool)
    finally:
        for c in clients:
            c.close()
