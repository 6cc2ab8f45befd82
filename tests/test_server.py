"""The parameter server over real gRPC on 127.0.0.1, with in-process workers and raw stubs."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch
from helpers import STUCK_S, FakeClock, assert_same, fingerprint, flat, wait_until
from torch import nn

from asyncdiloco.algo.config import OuterConfig
from asyncdiloco.errors import REASON_METADATA_KEY, ConfigError, ManifestMismatchError, ServerUnavailableError
from asyncdiloco.ps import ParameterServer
from asyncdiloco.ps.config import ServerConfig
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire._proto import parameter_server_pb2_grpc as pb_grpc
from asyncdiloco.wire.header_crc import seal
from asyncdiloco.wire.tensors import Manifest, crc32_of, iter_chunks, num_chunks_for
from asyncdiloco.worker.async_worker import AsyncDiLoCoWorker
from asyncdiloco.worker.client import ParameterServerClient
from asyncdiloco.worker.config import WorkerConfig

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def make_server(start_server):
    return start_server


def regression_task(seed: int):
    gen = torch.Generator().manual_seed(seed)
    w_true = torch.tensor([[1.0, -2.0, 0.5, 3.0]])

    def batch():
        x = torch.randn(16, 4, generator=gen)
        return x, x @ w_true.T

    return batch


def make_model(seed=0, width=4):
    torch.manual_seed(seed)
    return nn.Linear(width, 1)


def init_server(srv, model):
    """Join as the first worker and push ``model``'s parameters as the initial ones."""
    client = ParameterServerClient(srv.address)
    manifest = Manifest.from_module(model)
    reply = client.join(manifest, "init")
    assert reply.initialize
    payload = manifest.pack([p for p in model.parameters()])
    client.push(payload, worker_id=reply.worker_id, push_id=1, base_version=0, kind=pb.PUSH_KIND_INITIAL_PARAMETERS)
    return client, manifest, reply.worker_id


# --------------------------------------------------------------------- training
def test_two_in_process_workers_train_the_global_model(make_server):
    srv = make_server(local_steps=5, outer=OuterConfig(optimizer="sgd", lr=0.7, momentum=0.0), dylu=False)  # fixed H
    errors = []

    def run(seed):
        try:
            model = make_model(seed=0)  # same init on both; whichever joins first initializes
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            batch = regression_task(seed)
            with AsyncDiLoCoWorker(model, opt, WorkerConfig(server=srv.address), tokens_per_step=16):
                for _ in range(60):
                    x, y = batch()
                    nn.functional.mse_loss(model(x), y).backward()
                    opt.step()
                    opt.zero_grad()
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    st = srv.state.status()
    assert st.version == st.applied_pushes == 24  # 2 workers × 60 steps / H=5
    assert st.tokens == 2 * 60 * 16
    assert sum(st.staleness_histogram) == st.applied_pushes
    w = srv.state.params[:4]
    init_error = (make_model(0).weight.detach().reshape(-1) - torch.tensor([1.0, -2.0, 0.5, 3.0])).norm()
    assert (w - torch.tensor([1.0, -2.0, 0.5, 3.0])).norm() < 0.2 * init_error


def test_sgd_lr1_mom0_global_becomes_the_workers_parameters(make_server):
    srv = make_server(local_steps=3, outer=OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0))
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    captured = {}
    # Registered before the worker's own hook, so it sees θ_local just before each sync.
    opt.register_step_post_hook(lambda *_: captured.__setitem__("theta", flat(model)))
    batch = regression_task(0)
    with AsyncDiLoCoWorker(model, opt, WorkerConfig(server=srv.address)) as worker:
        initial = srv.state.params.clone()
        for _ in range(3):
            x, y = batch()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        assert srv.state.version == 1 and worker.version == 1
        assert not torch.equal(srv.state.params, initial)
        torch.testing.assert_close(srv.state.params, captured["theta"], rtol=0, atol=1e-6)
        assert torch.equal(flat(model), srv.state.params)  # the worker now holds the global model


# --------------------------------------------------------------------- refusals
def test_manifest_mismatch_refused_and_model_unchanged(make_server):
    srv = make_server()
    client, manifest, wid = init_server(srv, make_model())
    before = fingerprint(srv)
    other = Manifest.from_module(nn.Linear(5, 1))
    with pytest.raises(
        ManifestMismatchError, match=r"parameter #0 'weight': shape is \(1, 5\) on the worker but \(1, 4\)"
    ):
        client.join(other, "bad")
    assert_same(before, fingerprint(srv))
    # the grpc status code is FAILED_PRECONDITION
    stub = pb_grpc.ParameterServerStub(grpc.insecure_channel(srv.address))
    with pytest.raises(grpc.RpcError) as info:
        stub.Join(pb.JoinRequest(manifest=other.to_proto()), timeout=5)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert_same(before, fingerprint(srv))


def raw_push(srv, header: pb.PushHeader, chunks):
    stub = pb_grpc.ParameterServerStub(grpc.insecure_channel(srv.address))
    msgs = [pb.PushMessage(header=header)] + [pb.PushMessage(chunk=c) for c in chunks]
    return stub.Push(iter(msgs), timeout=10)


def good_push(srv, manifest, wid, payload, **over):
    cb = srv.config.chunk_bytes
    fields = dict(
        worker_id=wid,
        push_id=2,
        base_version=srv.state.version,
        num_local_steps=1,
        num_tokens=1,
        total_bytes=payload.numel(),
        num_chunks=num_chunks_for(payload.numel(), cb),
        crc32=crc32_of(payload),
        kind=pb.PUSH_KIND_PSEUDO_GRADIENT,
    )
    fields.update(over)
    return seal(pb.PushHeader(**fields)), list(iter_chunks(payload, cb))


_AT_WEIGHT_0_7 = "the first at parameter #0 'weight', index (0, 7)"


def _header_crc_flip(header: pb.PushHeader) -> None:
    seal(header)
    header.push_id ^= 64  # push 3 arrives as push 67: the header's own CRC-32 catches it


#: How the refusal tests spoil a good push's header, by case (both RPCs inject the same).
def _sealed(field: str, value):
    """A header fault the sender made itself: the field set, the header sealed over it."""

    def fault(header: pb.PushHeader) -> None:
        setattr(header, field, value(header) if callable(value) else value)
        seal(header)

    return fault


_HEADER_FAULTS = {
    "future": _sealed("base_version", 5),
    "negative": _sealed("base_version", -1),
    "stale": _sealed("base_version", 0),
    "unknown_worker": _sealed("worker_id", 99),
    "wrong_size": _sealed("total_bytes", 4),
    "oversized": _sealed("total_bytes", 5000),
    "bad_crc": _sealed("crc32", lambda h: h.crc32 ^ 1),
    "push_id_0": _sealed("push_id", 0),
    "header_crc": _header_crc_flip,
}


@pytest.mark.parametrize(
    ("case", "code", "reason", "needle"),
    [
        (
            "nan",
            grpc.StatusCode.INVALID_ARGUMENT,
            "invalid_payload",
            f"1 non-finite values (NaN/Inf), {_AT_WEIGHT_0_7}",
        ),
        (
            "huge",
            grpc.StatusCode.INVALID_ARGUMENT,
            "invalid_payload",
            "over the limit at parameter #0 'weight', index (0, 7)",
        ),
        (
            "inf",
            grpc.StatusCode.INVALID_ARGUMENT,
            "invalid_payload",
            f"1 non-finite values (NaN/Inf), {_AT_WEIGHT_0_7}",
        ),
        ("future", grpc.StatusCode.INVALID_ARGUMENT, "unknown_version", "base_version 5 was never served"),
        ("negative", grpc.StatusCode.INVALID_ARGUMENT, "unknown_version", "base_version -1 was never served"),
        ("stale", grpc.StatusCode.FAILED_PRECONDITION, "stale_push", "exceeds max_staleness=0"),
        ("unknown_worker", grpc.StatusCode.NOT_FOUND, "unknown_worker", "worker_id 99 is unknown"),
        ("wrong_size", grpc.StatusCode.INVALID_ARGUMENT, "invalid_payload", "total_bytes is 4"),
        ("out_of_order", grpc.StatusCode.INVALID_ARGUMENT, "invalid_payload", "out of order"),
        ("missing_chunk", grpc.StatusCode.INVALID_ARGUMENT, "invalid_payload", "stream ended after"),
        ("bad_crc", grpc.StatusCode.INVALID_ARGUMENT, "payload_corrupted", "CRC-32"),
        ("no_header", grpc.StatusCode.INVALID_ARGUMENT, "invalid_payload", "must carry a PushHeader"),
    ],
    ids=lambda v: v if isinstance(v, str) and " " not in v and "_" not in v else None,
)
def test_bad_pushes_refused_and_state_bit_identical(make_server, case, code, reason, needle):
    srv = make_server(chunk_bytes=1024, outer=OuterConfig(max_staleness=0))
    big = nn.Linear(600, 1)  # 2,404 bytes: three chunks of 1 KiB
    client, manifest, wid = init_server(srv, big)
    delta = [torch.full_like(p, 0.01) for p in big.parameters()]
    client.push(manifest.pack(delta), worker_id=wid, push_id=2, base_version=0)  # version 1, momentum ≠ 0
    before = fingerprint(srv)
    payload = manifest.pack(delta)
    header, chunks = good_push(srv, manifest, wid, payload, push_id=3)
    if case in ("nan", "inf", "huge"):
        bad = [d.clone() for d in delta]
        bad[0][0, 7] = {"nan": float("nan"), "inf": float("inf"), "huge": 3e38}[case]
        header, chunks = good_push(srv, manifest, wid, manifest.pack(bad), push_id=3)
    elif case in _HEADER_FAULTS:
        _HEADER_FAULTS[case](header)
    elif case == "out_of_order":
        chunks = [chunks[1], chunks[0], chunks[2]]
    elif case == "missing_chunk":
        chunks = chunks[:-1]
    with pytest.raises(grpc.RpcError) as info:
        if case == "no_header":
            stub = pb_grpc.ParameterServerStub(grpc.insecure_channel(srv.address))
            stub.Push(iter([pb.PushMessage(chunk=c) for c in chunks]), timeout=10)
        else:
            raw_push(srv, header, chunks)
    assert info.value.code() == code
    assert needle in info.value.details()
    assert dict(info.value.trailing_metadata()).get(REASON_METADATA_KEY) == reason  # machine-readable
    assert_same(before, fingerprint(srv))
    # and a good push still goes through afterwards
    header, chunks = good_push(srv, manifest, wid, payload, push_id=4)
    assert raw_push(srv, header, chunks).applied


def test_retried_push_is_applied_once(make_server):
    srv = make_server()
    client, manifest, wid = init_server(srv, make_model())
    payload = manifest.pack([torch.full((1, 4), 0.1), torch.full((1,), 0.1)])
    first = client.push(payload, worker_id=wid, push_id=7, base_version=0)
    after_first = fingerprint(srv)
    again = client.push(payload, worker_id=wid, push_id=7, base_version=0)
    assert first.applied and not first.duplicate
    assert again.applied and again.duplicate and again.version == first.version
    assert_same(after_first, fingerprint(srv))
    assert srv.state.status().duplicate_pushes == 1


# ------------------------------------------------------- one-message pushes (PushOne)
def one_push(srv, header: pb.PushHeader, chunks):
    """``header`` and its payload's only chunk (or none) as one PushOne message, encoded
    by the generated code."""
    stub = pb_grpc.ParameterServerStub(grpc.insecure_channel(srv.address))
    assert len(chunks) <= 1
    return stub.PushOne(pb.PushRequest(header=header, chunk=chunks[0] if chunks else None), timeout=10)


class _CountingPushOne:
    """Wraps a client's PushOne callable and counts the calls made through it."""

    def __init__(self, real) -> None:
        self.real, self.calls = real, 0

    def with_call(self, request, **kw):
        self.calls += 1
        return self.real.with_call(request, **kw)


def test_a_push_in_one_message_is_applied_bit_identically_to_a_stream(make_server):
    servers = []
    for one_message in (False, True):
        srv = make_server(outer=OuterConfig(optimizer="nesterov", lr=0.7, momentum=0.9), grouping="off")
        _, manifest, _ = init_server(srv, make_model(seed=3))
        client = ParameterServerClient(srv.address, one_message_pushes=one_message)
        wid = client.join(manifest, "w").worker_id
        client._push_one = counting = _CountingPushOne(client._push_one) if one_message else None  # noqa: SLF001
        gen = torch.Generator().manual_seed(1)
        for push_id in range(1, 5):
            payload = manifest.pack([torch.randn(1, 4, generator=gen), torch.randn(1, generator=gen)])
            reply = client.push(payload, worker_id=wid, push_id=push_id, base_version=max(0, srv.state.version - 1))
            assert reply.applied and not reply.duplicate
        again = client.push(payload, worker_id=wid, push_id=4, base_version=0)  # a retry: the original outcome
        assert again.duplicate and again.version == reply.version
        if counting is not None:
            assert counting.calls == 5
        servers.append(srv)
        client.close()
    stream, one = servers
    assert one.state.version == stream.state.version == 4
    assert_same(fingerprint(stream), fingerprint(one))  # θ, momentum, counters, records
    assert stream.state.status().duplicate_pushes == one.state.status().duplicate_pushes == 1


def _refused(call) -> tuple:
    with pytest.raises(grpc.RpcError) as info:
        call()
    err = info.value
    return err.code(), err.details(), dict(err.trailing_metadata()).get(REASON_METADATA_KEY)


@pytest.mark.parametrize(
    ("case", "code", "reason", "needle"),
    [
        ("nan", grpc.StatusCode.INVALID_ARGUMENT, "invalid_payload", "non-finite values (NaN/Inf)"),
        ("future", grpc.StatusCode.INVALID_ARGUMENT, "unknown_version", "base_version 5 was never served"),
        ("stale", grpc.StatusCode.FAILED_PRECONDITION, "stale_push", "exceeds max_staleness=0"),
        ("unknown_worker", grpc.StatusCode.NOT_FOUND, "unknown_worker", "worker_id 99 is unknown"),
        ("wrong_size", grpc.StatusCode.INVALID_ARGUMENT, "invalid_payload", "total_bytes is 4"),
        ("oversized", grpc.StatusCode.RESOURCE_EXHAUSTED, "payload_too_large", "max_payload_bytes=4096"),
        ("bad_crc", grpc.StatusCode.INVALID_ARGUMENT, "payload_corrupted", "CRC-32"),
        ("header_crc", grpc.StatusCode.INVALID_ARGUMENT, "payload_corrupted", "corrupted in transit"),
        ("push_id_0", grpc.StatusCode.INVALID_ARGUMENT, "invalid_payload", "push_id is 0"),
    ],
    ids=lambda v: v if isinstance(v, str) and " " not in v and v.islower() else None,
)
def test_a_bad_push_in_one_message_is_refused_as_the_stream_refuses_it(make_server, case, code, reason, needle):
    srv = make_server(chunk_bytes=1024, max_payload_bytes=4096, outer=OuterConfig(max_staleness=0))
    model = nn.Linear(100, 1)  # 404 bytes: one chunk
    client, manifest, wid = init_server(srv, model)
    good = manifest.pack([torch.full_like(p, 0.01) for p in model.parameters()])
    client.push(good, worker_id=wid, push_id=2, base_version=0)  # version 1, momentum ≠ 0
    before = fingerprint(srv)
    delta = [torch.full_like(p, 0.01) for p in model.parameters()]
    if case == "nan":
        delta[0][0, 7] = float("nan")
    header, chunks = good_push(srv, manifest, wid, manifest.pack(delta), push_id=3)
    assert len(chunks) == 1
    if case in _HEADER_FAULTS:
        _HEADER_FAULTS[case](header)
    streamed = _refused(lambda: raw_push(srv, header, chunks))
    in_one = _refused(lambda: one_push(srv, header, chunks))
    assert in_one == streamed  # the same status code, message and reason
    assert in_one[0] == code and needle in in_one[1] and in_one[2] == reason
    assert_same(before, fingerprint(srv))
    header, chunks = good_push(srv, manifest, wid, good, push_id=3)
    first = one_push(srv, header, chunks)
    assert first.applied and not first.duplicate  # a good one still goes through afterwards
    after = fingerprint(srv)
    for retry in (one_push, raw_push):  # its retry, either way: the original outcome, nothing applied
        again = retry(srv, header, chunks)
        assert again.duplicate and again.applied and again.version == first.version
    assert_same(after, fingerprint(srv))  # θ, momentum, version, counters, records


def test_one_message_pushes_out_of_shape_are_refused_and_change_nothing(make_server):
    srv = make_server(chunk_bytes=1024)
    big = nn.Linear(600, 1)  # 2,404 bytes: three chunks of 1 KiB
    client, manifest, wid = init_server(srv, big)
    before = fingerprint(srv)
    header, chunks = good_push(srv, manifest, wid, manifest.pack([torch.zeros_like(p) for p in big.parameters()]))
    code, details, reason = _refused(lambda: one_push(srv, header, chunks[:1]))
    assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "invalid_payload")
    assert "carries one chunk, but num_chunks is 3" in details and "as a Push stream" in details
    code, details, reason = _refused(lambda: _no_header(srv))
    assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "invalid_payload") and "no PushHeader" in details
    assert_same(before, fingerprint(srv))
    # the client itself streams a payload of more than one chunk
    client._push_one = counting = _CountingPushOne(client._push_one)  # noqa: SLF001
    payload = manifest.pack([torch.full_like(p, 0.01) for p in big.parameters()])
    assert client.push(payload, worker_id=wid, push_id=2, base_version=srv.state.version).applied
    assert counting.calls == 0


def _no_header(srv):
    stub = pb_grpc.ParameterServerStub(grpc.insecure_channel(srv.address))
    return stub.PushOne(pb.PushRequest(chunk=pb.PayloadChunk(data=b"abcd")), timeout=10)


# --------------------------------------------------------------------- big models
def test_model_over_64_mib_pushes_and_pulls_in_chunks(make_server):
    srv = make_server(outer=OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0))
    big = nn.ParameterList([nn.Parameter(torch.randn(4096, 2048)), nn.Parameter(torch.randn(3))])  # 32 MiB...
    big.append(nn.Parameter(torch.randn(1024, 4096 + 128)))  # ...+ 16.5 MiB
    big.append(nn.Parameter(torch.randn(5000, 1000)))  # ...+ 19 MiB: 68 MiB in all
    manifest = Manifest.from_module(big)
    assert manifest.total_bytes > 64 * 1024 * 1024
    client, manifest, wid = init_server(srv, big)
    pulled = client.pull(manifest, wid)
    for p, t in zip(big.parameters(), manifest.unpack(pulled.payload)):
        assert torch.equal(p.detach(), t)
    delta = [torch.full_like(p, 0.5) for p in big.parameters()]
    reply = client.push(manifest.pack(delta), worker_id=wid, push_id=2, base_version=0)
    assert reply.applied and reply.version == 1
    pulled = client.pull(manifest, wid)
    for p, t in zip(big.parameters(), manifest.unpack(pulled.payload)):
        assert torch.equal(p.detach() - 0.5, t)
    assert srv.state.status().bytes_pulled == 2 * manifest.total_bytes


# --------------------------------------------------------------------- faults
def test_join_fails_with_a_clear_message_when_no_server():
    with ParameterServer(ServerConfig(port=0)) as srv:
        address = srv.address  # a port that was free a moment ago
    model = make_model()
    worker = AsyncDiLoCoWorker(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        WorkerConfig(server=address, join_timeout_s=0.5, initial_backoff_s=0.1, rpc_timeout_s=1.0),
    )
    with pytest.raises(ServerUnavailableError, match=f"could not join the parameter server at {address}"):
        worker.join()
    worker.close()


def test_port_in_use_is_a_clear_error(make_server):
    srv = make_server()
    with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{srv.port} for the gRPC port: port in use"):
        ParameterServer(ServerConfig(port=srv.port)).start()


def test_worker_trains_on_through_an_outage_and_rejoins_a_fresh_server(make_server):
    srv = make_server(local_steps=2)
    port = srv.port
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    batch = regression_task(0)
    cfg = WorkerConfig(server=srv.address, initial_backoff_s=0.01, max_backoff_s=0.02, rpc_timeout_s=1.0)
    worker = AsyncDiLoCoWorker(model, opt, cfg, tokens_per_step=16)
    worker.join()

    def steps(n):
        for _ in range(n):
            x, y = batch()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()

    steps(4)
    assert worker.stats.pushes_applied == 2
    srv.stop(None)
    before = [p.detach().clone() for p in model.parameters()]
    steps(6)  # syncs fail; training goes on locally
    assert worker.stats.sync_failures >= 1
    assert worker.stats.inner_steps == 10
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    fresh = make_server(port=port, local_steps=2)  # a restarted server without state
    deadline = time.monotonic() + STUCK_S
    while fresh.state.version == 0 and time.monotonic() < deadline:
        steps(2)
    # the worker was unknown to the fresh server, rejoined, initialized it, and pushes again
    assert fresh.state.initialized and fresh.state.version >= 1
    worker.close()


def test_pulls_never_mix_two_versions_under_concurrent_pushes(make_server):
    # sgd, η = 1, μ = 0 and Δ = −1 everywhere: θ = θ0 + version, so a pulled payload whose
    # elements are not all θ0 + header version was torn between two updates.
    srv = make_server(chunk_bytes=4096, outer=OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0))
    model = nn.ParameterList([nn.Parameter(torch.zeros(50_000))])  # 200 KB: 49 chunks per pull
    client, manifest, wid = init_server(srv, model)
    minus_one = manifest.pack([torch.full((50_000,), -1.0)])
    stop = threading.Event()
    seen, errors = [], []

    def pusher(worker_id, first_id):
        c = ParameterServerClient(srv.address, chunk_bytes=srv.config.chunk_bytes)
        for k in range(40):
            c.push(minus_one, worker_id=worker_id, push_id=first_id + k, base_version=srv.state.version)
        c.close()

    def puller():
        c = ParameterServerClient(srv.address)
        try:
            while True:  # at least one pull, however late this thread runs
                pulled = c.pull(manifest)
                (theta,) = manifest.unpack(pulled.payload)
                if not torch.all(theta == float(pulled.version)):
                    errors.append(pulled.version)
                seen.append(pulled.version)
                if stop.is_set():
                    break
        finally:
            c.close()

    other = client.join(manifest, "second").worker_id
    pullers = [threading.Thread(target=puller) for _ in range(2)]
    pushers = [threading.Thread(target=pusher, args=(w, 2)) for w in (wid, other)]
    for t in pullers + pushers:
        t.start()
    for t in pushers:
        t.join(timeout=60)
    stop.set()
    for t in pullers:
        t.join(timeout=60)
    assert not errors, f"torn pulls at versions {errors[:5]}"
    assert srv.state.version == 80 and len(seen) > 0
    assert torch.all(srv.state.params == 80.0)


def heartbeat_seen(srv, worker_id: int) -> None:
    """Wait until ``worker_id``'s lease was renewed at the (fake) clock's current time."""
    wait_until(
        lambda: any(w.worker_id == worker_id and w.last_seen_s == 0.0 for w in srv.state.status().workers),
        f"a heartbeat of worker {worker_id}",
    )


def test_heartbeats_keep_an_idle_worker_registered(make_server):
    clock = FakeClock()
    srv = make_server(clock=clock, lease_s=0.5, local_steps=1)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with AsyncDiLoCoWorker(model, opt, WorkerConfig(server=srv.address, heartbeat_s=0.1)) as worker:
        first_id = worker.worker_id
        for _ in range(6):  # three leases without a push, half a lease at a time: only heartbeats
            clock.advance(0.25)
            heartbeat_seen(srv, first_id)
        x, y = regression_task(0)()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        assert worker.worker_id == first_id and worker.stats.pushes_applied == 1
        assert [w.alive for w in srv.state.status().workers] == [True]


def test_a_silent_worker_expires_and_rejoins(make_server):
    clock = FakeClock()
    srv = make_server(clock=clock, lease_s=0.3, local_steps=1)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with AsyncDiLoCoWorker(model, opt, WorkerConfig(server=srv.address, heartbeat_s=30)) as worker:
        first_id = worker.worker_id
        clock.advance(0.6)  # no heartbeat within the lease: expired
        x, y = regression_task(0)()
        for _ in range(3):
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()  # 1st sync: NOT_FOUND; 2nd: rejoin and pull; 3rd: push as the new id
            opt.zero_grad()
        assert worker.worker_id != first_id
        assert worker.stats.pushes_applied == 1
        status = {w.worker_id: w.alive for w in srv.state.status().workers}
        assert status == {first_id: False, worker.worker_id: True}


def test_a_waiting_worker_takes_over_when_the_initializer_dies(make_server):
    clock = FakeClock()
    srv = make_server(clock=clock, lease_s=0.5)
    model = make_model()
    ghost = ParameterServerClient(srv.address)
    ghost_id = ghost.join(Manifest.from_module(model), "ghost")
    assert ghost_id.initialize  # chosen, then never pushes
    worker = AsyncDiLoCoWorker(
        model, torch.optim.SGD(model.parameters(), lr=0.1), WorkerConfig(server=srv.address, join_timeout_s=60)
    )
    joining = threading.Thread(
        target=worker.join
    )  # polls; once the ghost's lease lapses, the heartbeat hands it the job
    joining.start()
    waiter = wait_until(
        lambda: [w.worker_id for w in srv.state.status().workers if w.worker_id != ghost_id.worker_id],
        "the second worker to join",
    )[0]
    while not srv.state.initialized and joining.is_alive():
        assert clock.now < 10.0, "the waiting worker never took over"
        clock.advance(0.2)  # less than a lease: the waiting worker's own lease stays current
        wait_until(
            lambda: (
                srv.state.initialized
                or any(w.worker_id == waiter and w.last_seen_s == 0.0 for w in srv.state.status().workers)
            ),
            "a heartbeat of the waiting worker",
        )
    joining.join(timeout=60)
    assert not joining.is_alive()
    assert srv.state.initialized
    assert torch.equal(srv.state.params, flat(model))
    worker.close()
    ghost.close()


def test_an_abandoned_uninitialized_server_accepts_another_model(make_server):
    srv = make_server()
    client = ParameterServerClient(srv.address)
    first = client.join(Manifest.from_module(nn.Linear(8, 4)), "wrong model")
    client.leave(first.worker_id)  # nobody holds the provisional manifest any more
    right = Manifest.from_module(make_model())
    reply = client.join(right, "right model")
    assert reply.initialize and Manifest.from_proto(reply.manifest) == right
    client.close()


# ------------------------------------------------------------------------ DyLU
def test_a_worker_reports_its_rate_and_takes_its_h_w_before_its_first_push(make_server):
    # DyLU from the first round (Liu et al. 2024, Eq. 6): the worker times its first inner
    # steps and reports the rate; a much faster worker is known, so its H_w drops to 1
    # before it ever pushes, and its first push carries that H_w, not H. (The measured rate
    # counts as at least a tenth of the fast one's, RATE_SPREAD: with H = 5 that is H_w 1.)
    srv = make_server(local_steps=5, outer=OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0), grouping="off")
    model = make_model()
    _, _, fast_id = init_server(srv, make_model())
    srv.state.report_rate(fast_id, 1e12)  # a worker of practically infinite speed
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    batch = regression_task(0)
    with AsyncDiLoCoWorker(model, opt, WorkerConfig(server=srv.address), tokens_per_step=16) as worker:
        assert worker.local_steps == 5  # Join: no rate of its own yet
        for _ in range(1 + AsyncDiLoCoWorker.RATE_PROBE_STEPS):  # one untimed step, then the probe
            x, y = batch()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        by_id = {w.worker_id: w for w in srv.state.status().workers}
        me = by_id[worker.worker_id]
        assert me.steps_per_s > 0  # reported before its first push
        assert worker.stats.pushes_applied == 1 and worker.local_steps == 1
        assert me.local_steps == AsyncDiLoCoWorker.RATE_PROBE_STEPS + 1  # pushed at once when told H_w = 1


def test_a_stock_grpc_client_pulls_a_default_servers_model_with_grpcs_default_message_limit(make_server):
    """Every chunk message of a default server fits gRPC's default 4 MiB receive limit
    with its framing, so generated stubs work with no channel options (issue 15, item 5)."""
    srv = make_server()
    model = nn.Linear(1536, 1536)  # 9 MiB of fp32: three chunk messages or more
    _, manifest, _ = init_server(srv, model)
    with grpc.insecure_channel(srv.address) as channel:  # gRPC's defaults: 4 MiB per received message
        stream = pb_grpc.ParameterServerStub(channel).Pull(pb.PullRequest(worker_id=0), timeout=60)
        sizes = [len(m.chunk.data) for m in stream if m.HasField("chunk")]
    assert sum(sizes) == manifest.total_bytes and len(sizes) >= 3


def test_a_client_adopts_the_chunk_size_of_a_server_restarted_with_another_one(make_server):
    """Issue 15, item 4: a client still cutting payloads with an old ``chunk_bytes`` (the
    server restarted with a smaller ``--chunk-bytes``) has its push refused once, adopts
    the server's chunk size and resends the same push id, which is applied; a pull adopts
    it too."""
    srv = make_server(chunk_bytes=4096)
    model = nn.Linear(300, 256)  # 308 kB: 76 chunks of 4096 bytes, 2 of 256 KiB
    client, manifest, wid = init_server(srv, model)
    client.chunk_bytes = 256 * 1024  # what it learned from the server before the restart
    payload = manifest.pack([torch.zeros_like(p) for p in model.parameters()])
    reply = client.push(payload, worker_id=wid, push_id=2, base_version=0)
    assert reply.applied and not reply.duplicate and client.chunk_bytes == 4096
    assert srv.state.status().rejected_pushes == 1 and srv.state.version == 1
    client.chunk_bytes = 256 * 1024
    client.pull(manifest, wid)
    assert client.chunk_bytes == 4096
