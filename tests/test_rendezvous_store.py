"""Sync mode's rendezvous store: served through the authenticated gRPC port (the Store
RPC), one namespace per quorum for its members only, dropped when the round is decided;
the workers' gloo groups form over it (issue 15, item 16)."""

from __future__ import annotations

import datetime

import grpc
import pytest
import torch
import torch.distributed as dist
from helpers import FakeClock, run_threads

from asyncdiloco.errors import PayloadTooLargeError, RoundRefusedError, ServerUnavailableError, UnauthenticatedError
from asyncdiloco.ps.config import SyncConfig
from asyncdiloco.ps.sync import rendezvous
from asyncdiloco.ps.sync.rendezvous import RendezvousStore
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire._proto import parameter_server_pb2_grpc as pb_grpc
from asyncdiloco.wire.security import ClientSecurityConfig, ServerSecurityConfig
from asyncdiloco.wire.tensors import Manifest
from asyncdiloco.worker.client import ParameterServerClient
from asyncdiloco.worker.config import SyncWorkerConfig, WorkerConfig
from asyncdiloco.worker.rendezvous import ServerStore
from asyncdiloco.worker.sync_worker import SyncDiLoCoWorker

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_thread")]

MANIFEST = Manifest.from_named_tensors([("w", torch.zeros(4))])


def _req(op: int, *keys: str, quorum_id: int = 1, worker_id: int = 1, **fields) -> pb.StoreRequest:
    return pb.StoreRequest(worker_id=worker_id, quorum_id=quorum_id, op=op, keys=list(keys), **fields)


# ------------------------------------------------------------- the server's namespaces
def test_a_quorums_namespace_serves_its_members_with_torchs_semantics():
    store = RendezvousStore()
    store.open(1, (1, 2))
    assert not store.serve(_req(pb.STORE_OP_GET, "k")).found
    store.serve(_req(pb.STORE_OP_SET, "k", value=b"v"))
    assert store.serve(_req(pb.STORE_OP_GET, "k", worker_id=2)).value == b"v"
    assert store.serve(_req(pb.STORE_OP_CHECK, "k")).found and not store.serve(_req(pb.STORE_OP_CHECK, "k", "x")).found
    assert store.serve(_req(pb.STORE_OP_ADD, "n", amount=3)).count == 3
    assert store.serve(_req(pb.STORE_OP_ADD, "n", amount=-1)).count == 2
    assert store.serve(_req(pb.STORE_OP_GET, "n")).value == b"2"  # decimal ASCII, as TCPStore keeps it
    cas = pb.STORE_OP_COMPARE_SET
    assert store.serve(_req(cas, "c", expected=b"x", value=b"y")).value == b"x"  # missing, expected not empty
    assert store.serve(_req(cas, "c", expected=b"", value=b"y")).value == b"y"  # missing, expected empty: set
    assert store.serve(_req(cas, "c", expected=b"z", value=b"w")).value == b"y"  # differs: unchanged
    assert store.serve(_req(cas, "c", expected=b"y", value=b"w")).value == b"w"
    assert store.serve(_req(pb.STORE_OP_NUM_KEYS)).count == 3
    assert store.serve(_req(pb.STORE_OP_DELETE, "c")).found and not store.serve(_req(pb.STORE_OP_DELETE, "c")).found


def test_only_members_of_an_open_quorum_may_use_it_and_a_new_quorum_drops_the_old():
    store = RendezvousStore()
    store.open(1, (1, 2))
    with pytest.raises(RoundRefusedError, match=r"worker 3 is not a member of quorum 1 \(members \[1, 2\]\)"):
        store.serve(_req(pb.STORE_OP_SET, "k", worker_id=3, value=b"v"))
    with pytest.raises(RoundRefusedError, match="store of quorum 7 is closed"):
        store.serve(_req(pb.STORE_OP_GET, "k", quorum_id=7))
    store.serve(_req(pb.STORE_OP_SET, "k", value=b"v"))
    store.open(2, (2, 3))
    assert store.open_quorums == [2]  # bounded: the decided quorum's keys are gone
    with pytest.raises(RoundRefusedError, match="closed"):
        store.serve(_req(pb.STORE_OP_GET, "k"))
    store.close(2)
    assert store.open_quorums == []


def test_keys_values_and_namespaces_are_bounded(monkeypatch):
    store = RendezvousStore()
    store.open(1, (1,))
    with pytest.raises(PayloadTooLargeError, match="store value of 1048577 bytes is over the limit of 1048576"):
        store.serve(_req(pb.STORE_OP_SET, "k", value=b"x" * (rendezvous.MAX_VALUE_BYTES + 1)))
    with pytest.raises(PayloadTooLargeError, match="store key of 1025 bytes"):
        store.serve(_req(pb.STORE_OP_GET, "k" * 1025))
    monkeypatch.setattr(rendezvous, "MAX_KEYS", 2)
    store.serve(_req(pb.STORE_OP_SET, "a", value=b"1"))
    store.serve(_req(pb.STORE_OP_SET, "b", value=b"1"))
    store.serve(_req(pb.STORE_OP_SET, "b", value=b"2"))  # replacing a key adds none
    with pytest.raises(PayloadTooLargeError, match="holds 2 keys, its limit"):
        store.serve(_req(pb.STORE_OP_SET, "c", value=b"1"))
    monkeypatch.setattr(rendezvous, "MAX_NAMESPACE_BYTES", 10)
    with pytest.raises(PayloadTooLargeError, match="would hold 12 bytes, over its limit of 10"):
        store.serve(_req(pb.STORE_OP_SET, "a", value=b"x" * 9))
    with pytest.raises(Exception, match="takes exactly one key"):
        store.serve(_req(pb.STORE_OP_SET, "a", "b", value=b"1"))


# ------------------------------------------------------------------- the worker's side
def test_a_blocking_get_polls_until_its_timeout_then_names_the_quorum():
    clock, asked = FakeClock(), []

    def call(request: pb.StoreRequest, timeout_s: float) -> pb.StoreReply:
        asked.append(request.op)
        return pb.StoreReply(found=False)

    store = ServerStore(call, worker_id=1, quorum_id=4, timeout_s=0.5, clock=clock, sleep=clock.advance)
    with pytest.raises(dist.DistStoreError, match=r"rendezvous of quorum 4: \['k'\] not set within 0.5 s"):
        store.get("k")
    assert set(asked) == {pb.STORE_OP_GET} and 5 < len(asked) < 50  # 2 ms doubling to 50 ms: a few calls
    with pytest.raises(dist.DistStoreError, match="within 0.1 s"):
        store.wait(["k"], datetime.timedelta(seconds=0.1))
    store.close()
    asked.clear()
    assert store.check(["k"]) is False and not asked  # closed: answered without a call (NCCL's monitor)
    with pytest.raises(dist.DistStoreError, match="store of quorum 4 is closed"):
        store.set("k", b"v")


def test_a_refused_call_fails_the_store_operation_with_the_servers_reason():
    def call(request: pb.StoreRequest, timeout_s: float) -> pb.StoreReply:
        raise ServerUnavailableError("the server is gone")

    store = ServerStore(call, worker_id=1, quorum_id=2, timeout_s=5.0)
    with pytest.raises(dist.DistStoreError, match="quorum 2, set 'k': the server is gone"):
        store.set("k", "v")


# ------------------------------------------------------------------------- over gRPC
@pytest.fixture
def token(tmp_path):
    path = tmp_path / "token"
    path.write_text("s3cret-token\n")
    path.chmod(0o600)
    return str(path)


def _initialized_member(srv, token: str) -> tuple[ParameterServerClient, int, pb.QuorumReply]:
    client = ParameterServerClient(srv.address, security=ClientSecurityConfig(token_file=token))
    wid = client.join(MANIFEST, "member").worker_id
    client.push(
        MANIFEST.pack([torch.ones(4)]), worker_id=wid, push_id=1, base_version=0, kind=pb.PUSH_KIND_INITIAL_PARAMETERS
    )
    q = client.quorum(worker_id=wid, round=0, manifest_hash=MANIFEST.manifest_hash, timeout_s=5.0)
    assert q.formed
    return client, wid, q


def test_the_store_needs_the_token_and_no_port_of_its_own(start_server, token):
    srv = start_server(mode="sync", sync=SyncConfig(min_workers=1), security=ServerSecurityConfig(token_file=token))
    client, wid, q = _initialized_member(srv, token)
    assert q.store_port == 0 and q.store_host == ""  # nothing but the gRPC port to reach
    set_k = _req(pb.STORE_OP_SET, "k", quorum_id=q.quorum_id, worker_id=wid, value=b"v")
    get_k = _req(pb.STORE_OP_GET, "k", quorum_id=q.quorum_id, worker_id=wid)
    stub = pb_grpc.ParameterServerStub(grpc.insecure_channel(srv.address))
    for request in (set_k, get_k):
        for metadata in ((), (("authorization", "Bearer nope"),)):
            with pytest.raises(grpc.RpcError) as info:
                stub.Store(request, timeout=5, metadata=metadata)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with ParameterServerClient(srv.address) as no_token, pytest.raises(UnauthenticatedError):
        no_token.store(get_k)
    assert srv.state.rounds.rendezvous.serve(get_k).found is False  # the refused write changed nothing
    client.store(set_k)  # the member, with the token
    assert client.store(get_k).value == b"v"
    other = ParameterServerClient(srv.address, security=ClientSecurityConfig(token_file=token))
    outsider = other.join(MANIFEST, "outsider").worker_id
    with pytest.raises(RoundRefusedError, match=f"worker {outsider} is not a member of quorum {q.quorum_id}"):
        other.store(_req(pb.STORE_OP_GET, "k", quorum_id=q.quorum_id, worker_id=outsider))
    client.commit(worker_id=wid, quorum_id=q.quorum_id, success=False, reason="test", timeout_s=5.0)
    with pytest.raises(RoundRefusedError, match="closed"):  # the round is decided: its keys are gone
        client.store(get_k)
    assert srv.state.rounds.rendezvous.open_quorums == []
    client.close()
    other.close()


def test_two_sync_workers_form_a_gloo_group_through_the_token_protected_store(start_server, token):
    srv = start_server(
        mode="sync",
        local_steps=2,
        sync=SyncConfig(min_workers=2, join_timeout_s=5.0),
        security=ServerSecurityConfig(token_file=token),
    )
    workers = []
    for _ in range(2):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        cfg = WorkerConfig(server=srv.address, security=ClientSecurityConfig(token_file=token))
        workers.append(
            SyncDiLoCoWorker(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg, sync=SyncWorkerConfig())
        )

    def train(worker: SyncDiLoCoWorker, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        with worker:
            for _ in range(4):
                worker.model(torch.randn(8, 4, generator=gen)).pow(2).mean().backward()
                worker.inner_optimizer.step()
                worker.inner_optimizer.zero_grad()

    run_threads([lambda w=w, i=i: train(w, i) for i, w in enumerate(workers)])
    rounds = [[r for r in w.stats.rounds if r["world_size"] == 2 and r["committed"]] for w in workers]
    assert rounds[0] and [r["checksum"] for r in rounds[0]] == [r["checksum"] for r in rounds[1]]
    assert (
        srv.state.status().rounds_committed
        == workers[0].stats.rounds_committed
        == workers[1].stats.rounds_committed
        == 2
    )
    assert srv.state.rounds.rendezvous.open_quorums == []  # every decided round dropped its keys
