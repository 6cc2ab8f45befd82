"""The bulk data channel (ps/transport/bulk.py, bulk_client.py): same results as gRPC, same
refusals, auth and TLS, resynchronisation after refusals, and the fallback to gRPC."""

from __future__ import annotations

import logging
import socket
import struct

import grpc
import pytest
import torch
from helpers import wait_until
from test_security import pki  # noqa: F401 - the certificate fixture

from asyncdiloco.algo.config import OuterConfig
from asyncdiloco.errors import InvalidPayloadError, StalePushError, UnauthenticatedError
from asyncdiloco.ps import ParameterServer
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.bulk_framing import code_value, recv_frame, send_frame
from asyncdiloco.wire.header_crc import seal
from asyncdiloco.wire.security import ClientSecurityConfig, ServerSecurityConfig
from asyncdiloco.wire.tensors import Manifest, crc32_of, num_chunks_for
from asyncdiloco.worker.bulk_client import BulkChannel
from asyncdiloco.worker.client import ParameterServerClient

pytestmark = pytest.mark.timeout(120)

#: Mixed dtypes, a 0-d tensor and a payload of several slices and chunks (~9 MiB).
NAMED = [
    ("emb", torch.zeros(1000, 1024)),
    ("bias", torch.zeros(3)),
    ("half", torch.zeros(700, 999, dtype=torch.bfloat16)),
    ("scalar", torch.zeros(())),
]
MANIFEST = Manifest.from_named_tensors(NAMED)
CHUNK = 1 << 20


def _payload(seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return MANIFEST.pack([(torch.randn(t.shape, generator=g) * scale).to(t.dtype) for _, t in NAMED])


@pytest.fixture
def servers(start_server):
    """Servers with a bulk port (unless ``bulk_port`` is given), CHUNK-byte chunks and a 60 s lease."""

    def make(**kw) -> ParameterServer:
        kw.setdefault("bulk_port", 0)
        return start_server(chunk_bytes=CHUNK, lease_s=60, **kw)

    return make


def _no_grpc_payloads(client: ParameterServerClient) -> None:
    """Make any gRPC Push/Pull of ``client`` fail, so a test sees every silent fallback."""

    def refuse(*_a, **_k):
        raise AssertionError("push/pull went over gRPC instead of the bulk channel")

    client._stub.Push = refuse  # noqa: SLF001
    client._stub.Pull = refuse  # noqa: SLF001


def _state(srv: ParameterServer) -> tuple:
    """θ, momentum and version: what a refused push must leave bit-identical."""
    st = srv.state
    m = st.model.outer.momentum_buffer
    return st.version, st.params.clone(), None if m is None else m.clone()


def _same(a: tuple, b: tuple) -> bool:
    return (
        a[0] == b[0]
        and torch.equal(a[1], b[1])
        and (a[2] is None) == (b[2] is None)
        and (a[2] is None or torch.equal(a[2], b[2]))
    )


def _initialized_client(srv: ParameterServer, **kw) -> tuple[ParameterServerClient, int]:
    client = ParameterServerClient(srv.address, rpc_timeout_s=10, **kw)
    reply = client.join(MANIFEST, "w")
    assert reply.initialize
    client.push(_payload(0), worker_id=reply.worker_id, push_id=1, kind=pb.PUSH_KIND_INITIAL_PARAMETERS, base_version=0)
    return client, reply.worker_id


# --------------------------------------------------------------- equivalence
def test_bulk_and_grpc_give_bit_identical_state_and_pulls(servers):
    outer = OuterConfig(optimizer="nesterov", lr=0.7, momentum=0.9, staleness="inverse")
    bulk_srv, grpc_srv = servers(outer=outer), servers(outer=outer, bulk_port=None)
    assert bulk_srv.bulk_port > 0 and grpc_srv.bulk_port == 0
    bulk, wb = _initialized_client(bulk_srv)
    plain, wp = _initialized_client(grpc_srv)
    assert bulk.bulk_port == bulk_srv.bulk_port and plain.bulk_port == 0
    _no_grpc_payloads(bulk)
    buf_b = torch.empty(MANIFEST.total_bytes, dtype=torch.uint8)
    buf_p = torch.empty(MANIFEST.total_bytes, dtype=torch.uint8)
    for i, base in enumerate([0, 0, 1, 3]):  # stale pushes too: τ > 0
        replies = [
            c.push(_payload(10 + i, 1e-2), worker_id=w, push_id=2 + i, base_version=base, num_tokens=7)
            for c, w in ((bulk, wb), (plain, wp))
        ]
        assert replies[0] == replies[1]
        pulled = [c.pull(MANIFEST, w, buffer=b) for c, w, b in ((bulk, wb, buf_b), (plain, wp, buf_p))]
        assert pulled[0].version == pulled[1].version == i + 1
        assert pulled[0].payload.data_ptr() == buf_b.data_ptr()  # received straight into the caller's buffer
        assert torch.equal(pulled[0].payload, pulled[1].payload)
        assert pulled[0].run_config.bulk_port == bulk_srv.bulk_port
    assert _same(_state(bulk_srv), _state(grpc_srv))
    sb, sp = bulk_srv.state.status(), grpc_srv.state.status()
    for field in ("applied_pushes", "rejected_pushes", "bytes_pushed", "bytes_pulled", "pulls", "tokens"):
        assert getattr(sb, field) == getattr(sp, field), field
    assert list(sb.staleness_histogram) == list(sp.staleness_histogram)
    bulk.close()
    plain.close()


def test_a_retried_push_id_is_applied_once(servers):
    srv = servers(outer=OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0))
    client, w = _initialized_client(srv)
    _no_grpc_payloads(client)
    first = client.push(_payload(5, 1e-2), worker_id=w, push_id=2, base_version=0)
    after_first = _state(srv)
    again = client.push(_payload(5, 1e-2), worker_id=w, push_id=2, base_version=0)
    assert first.applied and not first.duplicate and again.duplicate and again.version == first.version == 1
    assert _same(_state(srv), after_first)
    st = srv.state.status()
    assert st.applied_pushes == 1 and st.duplicate_pushes == 1
    client.close()


@pytest.mark.parametrize("bulk", [True, False])
def test_every_push_gives_its_receive_buffer_back(servers, bulk):
    """With a receive budget of one payload, push after push (applied, refused, retried)
    must each get the buffer: one never given back would make the next wait and fail."""
    srv = servers(receive_buffer_bytes=0, outer=OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0))
    client, w = _initialized_client(srv, bulk_channel=bulk)
    if bulk:
        _no_grpc_payloads(client)
    srv.state.intake.pool.wait_s = 1.0
    for push_id in range(2, 6):
        assert client.push(_payload(push_id, 1e-2), worker_id=w, push_id=push_id, base_version=push_id - 2).applied
    assert client.push(_payload(5, 1e-2), worker_id=w, push_id=5, base_version=3).duplicate
    with pytest.raises(InvalidPayloadError):
        nan = _payload(9).view(torch.float32).clone().fill_(float("nan")).view(torch.uint8)
        client.push(nan, worker_id=w, push_id=6, base_version=4)
    assert client.push(_payload(7, 1e-2), worker_id=w, push_id=7, base_version=4).applied
    assert srv.state.intake.pool._in_use == 0
    client.close()


# ------------------------------------------------------------------ refusals
def _header(worker_id: int, push_id: int, payload: torch.Tensor, **kw) -> pb.PushHeader:
    fields = dict(
        worker_id=worker_id,
        push_id=push_id,
        base_version=0,
        total_bytes=payload.numel(),
        num_chunks=num_chunks_for(payload.numel(), CHUNK),
        crc32=crc32_of(payload),
        kind=pb.PUSH_KIND_PSEUDO_GRADIENT,
    )
    fields.update(kw)
    return seal(pb.PushHeader(**fields))


def test_refused_pushes_change_nothing_and_the_connection_keeps_working(servers):
    srv = servers(outer=OuterConfig(optimizer="nesterov", max_staleness=0))
    client, w = _initialized_client(srv)
    _no_grpc_payloads(client)
    client.push(_payload(1, 1e-2), worker_id=w, push_id=2, base_version=0)  # momentum now nonzero
    sock = client._bulk._sock  # noqa: SLF001 - the connection every refusal must leave usable
    before = _state(srv)
    good = _payload(2, 1e-2)
    refusals = {
        # refused before the payload is read: the server drains it, then answers
        "wrong size": (
            lambda: client.push(good[:-4].clone(), worker_id=w, push_id=3, base_version=1),
            InvalidPayloadError,
            "total_bytes",
        ),
        # refused after the payload arrived: CRC-32 and staleness
        "bad CRC": (
            lambda: client._bulk.push(_header(w, 4, good, base_version=1, crc32=crc32_of(good) ^ 1), good, 30),  # noqa: SLF001
            InvalidPayloadError,
            "CRC-32",
        ),
        "stale": (lambda: client.push(good, worker_id=w, push_id=5, base_version=0), StalePushError, "max_staleness"),
        "unknown worker": (lambda: client.push(good, worker_id=99, push_id=6, base_version=1), Exception, "unknown"),
    }
    for name, (call, exc_type, words) in refusals.items():
        with pytest.raises(exc_type, match=words):
            call()
        assert _same(_state(srv), before), name
        assert client._bulk._sock is sock, f"{name}: the connection was not kept"  # noqa: SLF001
    assert srv.state.status().rejected_pushes == len(refusals)
    reply = client.push(good, worker_id=w, push_id=7, base_version=1)
    assert reply.applied and reply.version == 2 and client._bulk._sock is sock  # noqa: SLF001
    client.close()


def _raw_connection(srv: ParameterServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", srv.bulk_port), timeout=30)


def test_a_connection_dropped_mid_payload_applies_nothing(servers):
    srv = servers()
    client, w = _initialized_client(srv)
    client.push(_payload(1, 1e-2), worker_id=w, push_id=2, base_version=0)
    before = _state(srv)
    rejected = srv.state.status().rejected_pushes
    good = _payload(2, 1e-2)
    with _raw_connection(srv) as sock:
        send_frame(sock, pb.BulkRequest(push=_header(w, 3, good, base_version=1)))
        sock.sendall(memoryview(good.numpy())[: good.numel() // 2])
    wait_until(lambda: srv.state.status().rejected_pushes == rejected + 1, "the server to count the cut-off push")
    assert _same(_state(srv), before)
    # the same push_id, complete, is applied: the cut-off attempt left no trace
    _no_grpc_payloads(client)
    assert client.push(good, worker_id=w, push_id=3, base_version=1).version == 2
    client.close()


@pytest.mark.parametrize("token", [None, "s3cret-tokem", ""])
def test_a_missing_or_wrong_token_is_refused_and_the_connection_closed(servers, pki, token):  # noqa: F811
    srv = servers(security=ServerSecurityConfig(token_file=pki["token"]))
    with _raw_connection(srv) as sock:
        send_frame(sock, pb.BulkRequest(token=token or "", pull=pb.PullRequest()))
        reply = recv_frame(sock, pb.BulkReply)
        assert reply.code == code_value(grpc.StatusCode.UNAUTHENTICATED) and "--token-file" in reply.message
        assert reply.reason == "unauthenticated"
        assert sock.recv(1) == b""  # closed
    with _raw_connection(srv) as sock:  # the right token: NOT_INITIALIZED-like refusal, connection kept
        send_frame(sock, pb.BulkRequest(token="s3cret-token", pull=pb.PullRequest()))
        assert recv_frame(sock, pb.BulkReply).code == code_value(grpc.StatusCode.UNAVAILABLE)
        send_frame(sock, pb.BulkRequest(token="s3cret-token", pull=pb.PullRequest()))
        assert "not initialized" in recv_frame(sock, pb.BulkReply).message


def test_a_garbled_frame_is_refused_and_the_connection_closed(servers):
    srv = servers()
    with _raw_connection(srv) as sock:
        sock.sendall(struct.pack("<I", 1 << 30))
        reply = recv_frame(sock, pb.BulkReply)
        assert reply.code == code_value(grpc.StatusCode.INVALID_ARGUMENT) and "frame length" in reply.message
        assert reply.reason == "invalid_payload"
        assert sock.recv(1) == b""
    with _raw_connection(srv) as sock:  # a request with neither a push nor a pull
        send_frame(sock, pb.BulkRequest())
        reply = recv_frame(sock, pb.BulkReply)
        assert reply.code == code_value(grpc.StatusCode.INVALID_ARGUMENT) and reply.reason == "invalid_payload"
        assert sock.recv(1) == b""


def test_wrong_token_through_the_client_raises_unauthenticated(servers, pki):  # noqa: F811
    srv = servers(security=ServerSecurityConfig(token_file=pki["token"]))
    good = ParameterServerClient(srv.address, security=ClientSecurityConfig(token_file=pki["token"]))
    w = good.join(MANIFEST, "w").worker_id
    good.push(_payload(0), worker_id=w, push_id=1, base_version=0, kind=pb.PUSH_KIND_INITIAL_PARAMETERS)
    bad = BulkChannel("127.0.0.1", srv.bulk_port, token="s3cret-tokem")
    with pytest.raises(UnauthenticatedError, match="token"):
        bad.pull(pb.PullRequest(worker_id=w), MANIFEST.total_bytes, None, CHUNK, 30)
    bad.close()
    good.close()


@pytest.mark.parametrize("mutual", [False, True])
def test_tls_and_token_carry_pushes_and_pulls(servers, pki, mutual):  # noqa: F811
    sec = ServerSecurityConfig(
        token_file=pki["token"],
        tls_cert=pki["ca_server_cert"],
        tls_key=pki["ca_server_key"],
        tls_client_ca=pki["ca_cert"] if mutual else None,
    )
    srv = servers(security=sec)
    client_sec = ClientSecurityConfig(
        token_file=pki["token"],
        tls_ca=pki["ca_cert"],
        tls_cert=pki["ca_client_cert"] if mutual else None,
        tls_key=pki["ca_client_key"] if mutual else None,
    )
    client, w = _initialized_client(srv, security=client_sec)
    _no_grpc_payloads(client)
    assert client.push(_payload(3, 1e-2), worker_id=w, push_id=2, base_version=0).version == 1
    pulled = client.pull(MANIFEST, w)
    assert pulled.version == 1 and torch.equal(pulled.payload, srv.state.model.manifest.pack_flat(srv.state.params))
    if not mutual:  # stopping the server ends the kept-alive TLS connection's thread at once (lease_s is 60)
        threads = [t for _, t in srv.bulk._connections.values()]  # noqa: SLF001
        assert threads
        srv.bulk.stop(30)
        assert not any(t.is_alive() for t in threads)
    client.close()
    if mutual:  # a client without a certificate is refused in the handshake
        with _raw_connection(srv) as raw, pytest.raises(OSError):
            import ssl

            ctx = ssl.create_default_context(cafile=pki["ca_cert"])
            with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
                send_frame(tls, pb.BulkRequest(token="s3cret-token", pull=pb.PullRequest()))
                recv_frame(tls, pb.BulkReply)


# ------------------------------------------------------------------ fallback
def test_the_client_falls_back_to_grpc_when_the_bulk_port_is_unreachable(servers, caplog):
    srv = servers()
    client, w = _initialized_client(srv)
    srv.bulk.stop(None)  # the port now refuses connections
    client._bulk.close()  # noqa: SLF001 - drop the kept-alive connection too
    with caplog.at_level(logging.WARNING, logger="asyncdiloco.worker.bulk_client"):
        reply = client.push(_payload(1, 1e-2), worker_id=w, push_id=2, base_version=0)
        assert reply.applied and reply.version == 1
        client._bulk._retry_at = 0.0  # noqa: SLF001 - skip the backoff: try (and fail) the bulk port again
        pulled = client.pull(MANIFEST, w)
    assert pulled.version == 1 and torch.equal(pulled.payload, srv.state.model.manifest.pack_flat(srv.state.params))
    warnings = [r for r in caplog.records if "bulk data channel" in r.getMessage()]
    assert len(warnings) == 1, "an outage is logged once"
    client.close()


def test_a_client_with_the_bulk_channel_off_uses_grpc(servers):
    srv = servers()
    client = ParameterServerClient(srv.address, bulk_channel=False)
    client.join(MANIFEST, "w")
    assert client.bulk_port == 0
    client.close()


# ------------------------------------------------------------ worker and CLI
def test_a_worker_trains_over_the_bulk_channel(servers):
    from torch import nn

    from asyncdiloco import AsyncDiLoCoWorker, WorkerConfig

    srv = servers(local_steps=4, outer=OuterConfig(optimizer="sgd", lr=0.5, momentum=0.0))
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with AsyncDiLoCoWorker(model, opt, WorkerConfig(server=srv.address), tokens_per_step=16) as worker:
        assert worker.client.bulk_port == srv.bulk_port
        _no_grpc_payloads(worker.client)
        for _ in range(24):
            x = torch.randn(16, 8)
            nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
            opt.step()
            opt.zero_grad()
        assert worker.stats.pushes_applied == 6 and worker.stats.sync_failures == 0
    assert srv.state.version >= 6


@pytest.mark.multiprocess
def test_the_cli_serves_a_bulk_port_and_tells_workers(tmp_path):
    import subprocess
    import sys

    port_file = tmp_path / "port"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "asyncdiloco",
            "server",
            "--drain-s",
            "0",
            "--port",
            "0",
            "--port-file",
            str(port_file),
            "--bulk-port",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines = [proc.stdout.readline() for _ in range(2)]
        assert "listening on 127.0.0.1:" in lines[0], lines
        bulk_port = int(lines[1].rsplit(" ", 1)[1])
        assert "bulk data channel on port" in lines[1] and bulk_port > 0
        client = ParameterServerClient(f"127.0.0.1:{int(port_file.read_text())}", rpc_timeout_s=30)
        reply = client.join(MANIFEST, "w")
        assert reply.run_config.bulk_port == bulk_port == client.bulk_port
        _no_grpc_payloads(client)
        client.push(
            _payload(0), worker_id=reply.worker_id, push_id=1, base_version=0, kind=pb.PUSH_KIND_INITIAL_PARAMETERS
        )
        assert torch.equal(client.pull(MANIFEST, reply.worker_id).payload, _payload(0))
        client.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_connection_the_server_closed_is_replaced_within_the_call(servers, caplog):
    srv = servers()
    client, w = _initialized_client(srv)
    _no_grpc_payloads(client)
    old = client._bulk._sock  # noqa: SLF001
    for conn, _ in list(srv.bulk._connections.values()):  # noqa: SLF001 - as an idle timeout would
        conn.shutdown(socket.SHUT_RDWR)
    wait_until(lambda: not srv.bulk._connections, "the server to drop the connection")  # noqa: SLF001
    with caplog.at_level(logging.WARNING, logger="asyncdiloco.worker.bulk_client"):
        assert client.push(_payload(1, 1e-2), worker_id=w, push_id=2, base_version=0).version == 1
    assert client._bulk._sock is not old and client._bulk.fallbacks == 0  # noqa: SLF001
    assert not [r for r in caplog.records if "bulk" in r.getMessage()]
    client.close()


def test_connections_over_the_limit_are_closed_and_their_clients_use_grpc(servers):
    srv = servers(max_concurrent_rpcs=4)
    client, w = _initialized_client(srv)  # holds one bulk connection
    extra = [_raw_connection(srv) for _ in range(3)]
    wait_until(lambda: len(srv.bulk._connections) == 4, "four open connections")  # noqa: SLF001
    with _raw_connection(srv) as fifth:
        assert fifth.recv(1) == b""  # closed at once
    other = ParameterServerClient(srv.address)
    other_id = other.join(MANIFEST, "other").worker_id
    assert other.push(_payload(1, 1e-2), worker_id=other_id, push_id=1, base_version=0).version == 1
    assert other._bulk.fallbacks == 1  # noqa: SLF001 - over gRPC
    assert client.push(_payload(2, 1e-2), worker_id=w, push_id=2, base_version=1).version == 2
    assert client._bulk.fallbacks == 0  # noqa: SLF001 - its own connection still works
    for s in extra:
        s.close()
    other.close()
    client.close()


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_a_corrupted_push_header_is_resent_on_a_fresh_connection(servers, pki, monkeypatch, tls):  # noqa: F811
    """The server cannot drain a payload whose header it cannot trust: it answers
    payload_corrupted and ends the connection; the resend reconnects within the call."""
    client_sec = None
    if tls:
        srv = servers(security=ServerSecurityConfig(tls_cert=pki["ca_server_cert"], tls_key=pki["ca_server_key"]))
        client_sec = ClientSecurityConfig(tls_ca=pki["ca_cert"])
    else:
        srv = servers()
    client, w = _initialized_client(srv, security=client_sec)
    client.resend_backoff_s = 0.001
    _no_grpc_payloads(client)
    real, left = BulkChannel._push, {"n": 1}

    def flipping(self, sock, deadline, header, view):
        if left["n"]:
            left["n"] -= 1
            bad = pb.PushHeader()
            bad.CopyFrom(header)
            bad.base_version ^= 8  # header_crc32 is the sender's: the server sees the mismatch
            header = bad
        return real(self, sock, deadline, header, view)

    monkeypatch.setattr(BulkChannel, "_push", flipping)
    before = _state(srv)
    reply = client.push(_payload(4, 1e-2), worker_id=w, push_id=2, base_version=0)
    assert reply.applied and reply.version == before[0] + 1 and left["n"] == 0
    assert client.corrupted_transfers == 1 and client._bulk.fallbacks == 0  # noqa: SLF001
    assert srv.state.status().rejected_pushes == 1
    client.close()
