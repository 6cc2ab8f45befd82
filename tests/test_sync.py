"""Sync mode end to end in one process: a real gRPC server (serving the rendezvous store) on
127.0.0.1 and SyncDiLoCoWorkers on threads, each building real gloo process groups."""

from __future__ import annotations

import threading

import grpc
import pytest
import torch
from faults import FailAt, Fault, FaultySyncWorker
from helpers import STUCK_S, flat, load, run_threads
from torch import nn

from asyncdiloco.algo.config import OuterConfig
from asyncdiloco.algo.outer import OuterOptimizer
from asyncdiloco.errors import InvalidPayloadError, ManifestMismatchError, ModeMismatchError, RoundRefusedError
from asyncdiloco.ps import ParameterServer
from asyncdiloco.ps.config import ServerConfig, SyncConfig
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.header_crc import seal
from asyncdiloco.wire.tensors import Manifest
from asyncdiloco.worker.async_worker import AsyncDiLoCoWorker
from asyncdiloco.worker.client import ParameterServerClient
from asyncdiloco.worker.config import SyncWorkerConfig, WorkerConfig
from asyncdiloco.worker.sync_worker import SyncDiLoCoWorker

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_thread")]

W_TRUE = torch.tensor([[1.0, -2.0, 0.5, 3.0]])


@pytest.fixture
def make_server(start_server):
    def make(*, outer: OuterConfig, local_steps: int, **sync) -> ParameterServer:
        sync.setdefault("join_timeout_s", 5.0)
        sync.setdefault("round_timeout_s", 20.0)
        sync.setdefault("local_steps", "fixed")  # these tests count H steps per member (test_sync_adaptive: H_w)
        return start_server(mode="sync", outer=outer, local_steps=local_steps, lease_s=30.0, sync=SyncConfig(**sync))

    return make


def make_model(width: int = 4) -> nn.Module:
    torch.manual_seed(0)  # every replica starts from the same parameters
    return nn.Sequential(nn.Linear(width, 8), nn.Tanh(), nn.Linear(8, 1))


def batches(index: int, width: int = 4):
    gen = torch.Generator().manual_seed(100 + index)
    while True:
        x = torch.randn(16, width, generator=gen)
        yield x, x[:, :4] @ W_TRUE.T


def inner_opt(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.02)


def train(worker: SyncDiLoCoWorker, index: int, steps: int | None = None, until=None, width: int = 4) -> None:
    """The user's plain loop; the worker syncs inside ``inner.step()`` every H steps."""
    data = batches(index, width)
    done = 0
    while (steps is None or done < steps) and (until is None or not until()):
        x, y = next(data)
        loss = ((worker.model(x) - y) ** 2).mean()
        loss.backward()
        worker.inner_optimizer.step()
        worker.inner_optimizer.zero_grad()
        done += 1


def new_worker(srv: ParameterServer, model=None, **sync) -> SyncDiLoCoWorker:
    model = model if model is not None else make_model()
    sync.setdefault("allreduce_timeout_s", 10.0)
    sync.setdefault("quorum_timeout_s", 20.0)
    return SyncDiLoCoWorker(model, inner_opt(model), WorkerConfig(server=srv.address), sync=SyncWorkerConfig(**sync))


def committed_checksums(workers) -> dict[int, set[int]]:
    """round -> the set of θ_base checksums the members reported after committing it."""
    by_round: dict[int, set[int]] = {}
    for w in workers:
        for r in w.stats.rounds:
            if r["committed"]:
                by_round.setdefault(r["round"], set()).add(r["checksum"])
    return by_round


@pytest.mark.parametrize(
    "outer",
    [
        OuterConfig(optimizer="nesterov", lr=0.7, momentum=0.9),
        # η_v keyed by the round each update starts from, on the server and on every member (via RunConfig)
        OuterConfig(
            optimizer="nesterov",
            lr=0.7,
            momentum=0.9,
            lr_schedule="cosine",
            lr_warmup_versions=1,
            lr_total_versions=4,
            lr_min_ratio=0.1,
        ),
    ],
    ids=["constant", "cosine"],
)
def test_two_workers_sync_diloco_equal_a_single_process_reference(make_server, outer):
    H, K = 3, 4
    srv = make_server(outer=outer, local_steps=H, min_workers=2)
    workers = [new_worker(srv), new_worker(srv)]
    workers[0].join()  # worker 0 initializes the server, so its rank is 0
    workers[1].join()
    run_threads([lambda i=i: train(workers[i], i, steps=H * K) for i in range(2)])
    for w in workers:
        w.close()
    assert [w.stats.rounds_committed for w in workers] == [K, K]
    assert all(r["world_size"] == 2 for w in workers for r in w.stats.rounds)

    # the reference: two replicas, averaged pseudo-gradients, Nesterov through OuterOptimizer
    models = [make_model(), make_model()]
    opts = [inner_opt(m) for m in models]
    data = [batches(0), batches(1)]
    theta = flat(models[0]).clone()
    ref_outer = OuterOptimizer(theta, outer)
    for k in range(K):
        deltas = []
        for m, opt, d in zip(models, opts, data):
            for _ in range(H):
                x, y = next(d)
                ((m(x) - y) ** 2).mean().backward()
                opt.step()
                opt.zero_grad()
            deltas.append(theta - flat(m))
        ref_outer.step((deltas[0] + deltas[1]) / 2, version=k)
        for m in models:
            load(m, theta)

    server_theta = srv.state.params
    torch.testing.assert_close(server_theta, theta, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(srv.state.model.outer.momentum_buffer, ref_outer.momentum_buffer, rtol=1e-6, atol=1e-7)
    for w in workers:
        assert torch.equal(w._base, server_theta)  # members and server hold the same bits
        assert torch.equal(flat(w.model), server_theta)
    assert srv.state.version == K and srv.state.status().rounds_committed == K


def test_local_sgd_round_leaves_every_member_with_the_mean_of_the_members_parameters(make_server):
    H, K, N = 2, 3, 3
    srv = make_server(outer=OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0), local_steps=H, min_workers=N)
    local: dict[int, list[torch.Tensor]] = {i: [] for i in range(N)}
    workers = []
    for i in range(N):
        model = make_model()
        counter = iter(range(1, 10**6))
        opt = inner_opt(model)
        # registered before the worker's own hook, so it sees θ_local just before each round
        opt.register_step_post_hook(
            lambda *_, i=i, m=model, c=counter: local[i].append(flat(m).clone()) if next(c) % H == 0 else None
        )
        w = SyncDiLoCoWorker(
            model, opt, WorkerConfig(server=srv.address), sync=SyncWorkerConfig(allreduce_timeout_s=10.0)
        )
        w.join()
        workers.append(w)
    run_threads([lambda i=i: train(workers[i], i, steps=H * K) for i in range(N)])
    for w in workers:
        w.close()
    for i, w in enumerate(workers):
        assert len(local[i]) == K and w.stats.rounds_committed == K
    for k in range(K):
        mean = torch.stack([local[i][k] for i in range(N)]).mean(0)
        sums = {w.stats.rounds[k]["checksum"] for w in workers}
        assert len(sums) == 1, f"members differ after round {k + 1}"
        assert all(w.stats.rounds[k]["world_size"] == N for w in workers)
    for w in workers:
        torch.testing.assert_close(w._base, mean, rtol=1e-6, atol=1e-6)  # after the last round
        assert torch.equal(flat(w.model), srv.state.params)


def test_a_worker_joining_at_round_k_heals_and_matches_the_others_from_round_k_plus_1(make_server):
    H, R, K = 2, 8, 3
    # a quorum waits (up to join_timeout_s) for every live worker: the joiner is waited
    # for however long its join and heal take on a loaded machine
    srv = make_server(
        outer=OuterConfig(optimizer="nesterov", lr=0.7, momentum=0.9),
        local_steps=H,
        min_workers=1,
        join_timeout_s=STUCK_S,
    )
    a, b = new_worker(srv), new_worker(srv)
    a.join()
    b.join()
    joiner_done = threading.Event()
    quorum = srv.state.quorum
    late: list[SyncDiLoCoWorker] = []

    def first_two(w, i):
        # H·R steps, and on until the joiner is done: however long its join and heal
        # take, the first two are still there for it to share rounds with
        train(w, i, steps=H * R)
        train(w, i, until=joiner_done.is_set)
        w.close()

    def committed(w) -> int:
        return sum(r["committed"] for r in w.stats.rounds)

    def joiner():
        try:
            with quorum._cond:  # an event, not a sleep: wake when round K is committed
                assert quorum._cond.wait_for(lambda: quorum.round >= K, timeout=STUCK_S)
            c = new_worker(srv)
            late.append(c)
            with c:
                assert c.round >= K
                train(c, 2, steps=4 * H * R, until=lambda: committed(c) >= 3)
        finally:
            joiner_done.set()

    run_threads([lambda: first_two(a, 0), lambda: first_two(b, 1), joiner])
    (c,) = late
    joined_at = c.stats.rounds[0]["round"] - 1 if c.stats.rounds else None
    assert joined_at is not None and joined_at >= K
    by_round = committed_checksums([a, b, c])
    for rnd, sums in by_round.items():
        assert len(sums) == 1, f"members disagree after round {rnd}: {sums}"
    c_rounds = {r["round"] for r in c.stats.rounds if r["committed"]}
    ab_rounds = {r["round"] for w in (a, b) for r in w.stats.rounds if r["committed"]}
    shared = c_rounds & ab_rounds
    assert len(shared) >= 2, f"the joiner shared too few rounds with the others: {sorted(shared)}"
    assert min(c_rounds) >= K + 1
    assert c.stats.heals >= 1


def test_a_member_with_a_different_model_is_refused_before_any_collective(make_server):
    H = 2
    srv = make_server(outer=OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0), local_steps=H, min_workers=2)
    a, b = new_worker(srv), new_worker(srv)
    a.join()
    b.join()
    odd = new_worker(srv, model=make_model(width=5))
    with pytest.raises(ManifestMismatchError, match=r"parameter #0 '0.weight': shape is \(8, 5\) on the worker"):
        odd.join()
    assert odd.stats.rounds == [] and odd.stats.bytes_allreduced == 0
    # the Quorum RPC itself checks the manifest hash too
    client = ParameterServerClient(srv.address)
    reply = client.join(Manifest.from_module(make_model()), "impostor")
    with pytest.raises(ManifestMismatchError, match="every member must train the same model"):
        client.quorum(worker_id=reply.worker_id, round=0, manifest_hash="0" * 64, timeout_s=1.0)
    client.leave(reply.worker_id)
    client.close()
    run_threads([lambda: train(a, 0, steps=2 * H), lambda: train(b, 1, steps=2 * H)])
    for w in (a, b):
        w.close()
        assert w.stats.rounds_committed == 2
        assert all(r["world_size"] == 2 for r in w.stats.rounds)


def test_async_pushes_are_refused_in_sync_mode_and_sync_requests_in_async_mode(make_server):
    srv = make_server(outer=OuterConfig(), local_steps=2)
    w = new_worker(srv)
    w.join()
    client = ParameterServerClient(srv.address)
    manifest = Manifest.from_module(make_model())
    wid = client.join(manifest).worker_id
    with pytest.raises(ModeMismatchError, match="mode mismatch: .* this server runs --mode sync"):
        client.push(torch.zeros(manifest.total_bytes, dtype=torch.uint8), worker_id=wid, push_id=2, base_version=0)
    stub_err = None
    try:
        client._stub.Push(
            iter(
                [
                    pb.PushMessage(
                        header=seal(
                            pb.PushHeader(
                                worker_id=wid,
                                push_id=3,
                                total_bytes=manifest.total_bytes,
                                num_chunks=1,
                                kind=pb.PUSH_KIND_PSEUDO_GRADIENT,
                            )
                        )
                    )
                ]
            ),
            timeout=10,
        )
    except grpc.RpcError as err:
        stub_err = err
    assert stub_err is not None and stub_err.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(ModeMismatchError, match="this worker runs --mode async; start the worker with --mode sync"):
        AsyncDiLoCoWorker(make_model(), inner_opt(make_model()), WorkerConfig(server=srv.address)).join()
    client.close()
    w.close()

    async_srv = ParameterServer(ServerConfig(port=0)).start()
    try:
        client = ParameterServerClient(async_srv.address)
        wid = client.join(manifest).worker_id
        with pytest.raises(ModeMismatchError, match="runs --mode async"):
            client.quorum(worker_id=wid, round=0, manifest_hash=manifest.manifest_hash, timeout_s=1.0)
        with pytest.raises(ModeMismatchError, match="runs --mode async"):
            client.commit(worker_id=wid, quorum_id=1, success=True)
        client.close()
        m = make_model()
        with pytest.raises(ModeMismatchError, match="this worker runs --mode sync; start the worker with --mode async"):
            SyncDiLoCoWorker(m, inner_opt(m), WorkerConfig(server=async_srv.address)).join()
    finally:
        async_srv.stop(None)


@pytest.mark.parametrize("mode", ["raise", "hang"])
def test_a_failing_member_aborts_the_round_on_all_and_the_rest_go_on(make_server, mode):
    H, R = 2, 4
    # join_timeout_s above the allreduce timeout: survivors still in their collective
    # timeout are waited for by the next quorum. A quorum request waits up to STUCK_S: on
    # a loaded machine a member can ask while a round without it is still running.
    srv = make_server(
        outer=OuterConfig(optimizer="nesterov", lr=0.7, momentum=0.9), local_steps=H, min_workers=2, join_timeout_s=3.0
    )
    ok = [new_worker(srv, allreduce_timeout_s=2.0, quorum_timeout_s=STUCK_S) for _ in range(2)]
    bad_model = make_model()
    sync = SyncWorkerConfig(allreduce_timeout_s=2.0, quorum_timeout_s=STUCK_S)
    bad = FaultySyncWorker(
        bad_model, inner_opt(bad_model), WorkerConfig(server=srv.address), sync=sync, fail_at=FailAt(Fault(mode), 2)
    )
    for w in (*ok, bad):
        w.join()
    if mode == "hang":
        # the hung member's thread never returns: run it as a daemon and leave it behind
        threading.Thread(target=train, args=(bad, 2), kwargs={"steps": H * R}, daemon=True).start()
        run_threads([lambda: train(ok[0], 0, steps=H * R), lambda: train(ok[1], 1, steps=H * R)])
    else:
        run_threads([lambda i=i, w=w: train(w, i, steps=H * R) for i, w in enumerate((*ok, bad))])
    for w in ok:
        assert w.stats.rounds_skipped == 0
        failed = [r for r in w.stats.rounds if not r["committed"]]
        assert len(failed) == 1 and failed[0]["world_size"] == 3
        # ended by the collective's 2 s timeout, not hung (the slack is for a loaded machine)
        assert failed[0]["allreduce_s"] < 2.0 + 10.0
        assert failed[0]["round"] == 1  # discarded: still at the last committed round
    assert committed_checksums(ok) and all(len(s) == 1 for s in committed_checksums(ok).values())
    assert srv.state.status().rounds_failed >= 1
    for w in ok:
        w.close()
    if mode == "hang":
        bad._stop.set()


def test_token_weighting_takes_the_token_weighted_mean(make_server):
    H = 2
    srv = make_server(
        outer=OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0), local_steps=H, min_workers=2, weighting="tokens"
    )
    local: dict[int, torch.Tensor] = {}
    workers = []
    for i, tokens_per_step in enumerate((10, 30)):
        model = make_model()
        opt = inner_opt(model)
        counter = iter(range(1, 10**6))
        opt.register_step_post_hook(
            lambda *_, i=i, m=model, c=counter: local.__setitem__(i, flat(m).clone()) if next(c) % H == 0 else None
        )
        w = SyncDiLoCoWorker(model, opt, WorkerConfig(server=srv.address), tokens_per_step=tokens_per_step)
        w.join()
        workers.append(w)
    run_threads([lambda i=i: train(workers[i], i, steps=H) for i in range(2)])
    for w in workers:
        w.close()
    expected = (10 * H * local[0] + 30 * H * local[1]) / (40 * H)
    torch.testing.assert_close(srv.state.params, expected, rtol=1e-6, atol=1e-6)
    assert srv.state.counters.tokens == 40 * H and srv.state.counters.applied_pushes == 2


def test_round_protocol_over_raw_rpcs_refusals_commit_and_sync_state(make_server):
    outer = OuterConfig(optimizer="nesterov", lr=0.5, momentum=0.9)
    srv = make_server(outer=outer, local_steps=2, min_workers=1)
    manifest = Manifest.from_module(make_model())
    first, other = ParameterServerClient(srv.address), ParameterServerClient(srv.address)
    w1 = first.join(manifest, "w1")
    assert w1.initialize and w1.run_config.mode == "sync" and w1.run_config.outer_lr == 0.5
    theta0 = flat(make_model())
    first.push(
        manifest.pack_flat(theta0),
        worker_id=w1.worker_id,
        push_id=1,
        base_version=0,
        kind=pb.PUSH_KIND_INITIAL_PARAMETERS,
    )
    q = first.quorum(worker_id=w1.worker_id, round=0, manifest_hash=manifest.manifest_hash, timeout_s=5.0)
    w2 = other.join(manifest, "w2")  # joins while the round is in flight: not a member
    assert q.formed and list(q.members) == [w1.worker_id] and q.rank == 0 and not q.heal
    assert q.store_host == "" and q.store_port == 0  # the rendezvous store is the Store RPC on this port

    delta = torch.linspace(-1, 1, manifest.numel)
    kw = dict(base_version=0, kind=pb.PUSH_KIND_ROUND_RESULT, quorum_id=q.quorum_id)
    with pytest.raises(RoundRefusedError, match="round refused: worker .* only its rank 0"):
        other.push(delta.view(torch.uint8), worker_id=w2.worker_id, push_id=q.quorum_id, **kw)
    with pytest.raises(InvalidPayloadError, match="non-finite"):
        first.push(torch.full_like(delta, float("nan")).view(torch.uint8), worker_id=w1.worker_id, push_id=1, **kw)
    with pytest.raises(RoundRefusedError, match="not a member of quorum"):
        other.commit(worker_id=w2.worker_id, quorum_id=q.quorum_id, success=True, total_weight=1.0)
    assert torch.equal(srv.state.params, theta0)  # nothing applied before the vote
    first.push(delta.view(torch.uint8), worker_id=w1.worker_id, push_id=q.quorum_id, **kw)
    reply = first.commit(
        worker_id=w1.worker_id,
        quorum_id=q.quorum_id,
        success=True,
        total_weight=1.0,
        num_tokens=64,
        num_local_steps=2,
        timeout_s=5.0,
    )
    assert reply.decided and reply.committed and reply.round == 1

    expected = theta0.clone()
    OuterOptimizer(expected, outer).step(delta, version=0)
    assert torch.equal(srv.state.params, expected)
    pulled = other.pull_sync_state(manifest, w2.worker_id, with_momentum=True)
    state = pulled.payload.view(torch.float32)
    assert pulled.version == 1
    assert torch.equal(state[: manifest.numel], expected) and torch.equal(state[manifest.numel :], delta)
    st = srv.state.status()
    assert (st.version, st.rounds_committed, st.rounds_failed, st.tokens, st.applied_pushes) == (1, 1, 0, 64, 1)
    first.close()
    other.close()


def test_stopping_the_server_returns_a_quorum_wait_at_once(make_server):
    """A worker blocked in Quorum (its quorum cannot form: min_workers 2) must not keep
    the stopping server's RPC thread, and so its process, alive until the call's timeout."""
    srv = make_server(outer=OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0), local_steps=2, min_workers=2)
    manifest = Manifest.from_module(make_model())
    client = ParameterServerClient(srv.address)
    w1 = client.join(manifest, "w1")
    client.push(
        manifest.pack_flat(flat(make_model())),
        worker_id=w1.worker_id,
        push_id=1,
        base_version=0,
        kind=pb.PUSH_KIND_INITIAL_PARAMETERS,
    )
    replies: list[pb.QuorumReply] = []
    waiting = threading.Thread(
        target=lambda: replies.append(
            client.quorum(worker_id=w1.worker_id, round=0, manifest_hash=manifest.manifest_hash, timeout_s=STUCK_S)
        )
    )
    waiting.start()
    assert srv.state.quorum is not None
    deadline = threading.Event()
    while w1.worker_id not in srv.state.quorum._waiting and not deadline.wait(0.01):  # noqa: SLF001
        pass  # the request is in: the thread now blocks in wait_quorum
    stopping = threading.Thread(target=srv.stop, kwargs={"grace_s": STUCK_S})  # a grace that would wait for it
    stopping.start()
    waiting.join(timeout=STUCK_S / 2)  # without the wake-up the call would block for all of STUCK_S
    assert not waiting.is_alive()
    assert replies and not replies[0].formed
    stopping.join(timeout=STUCK_S)
    client.close()
