"""Shared-token authentication and TLS / mutual TLS, with throwaway certificates."""

from __future__ import annotations

import datetime
import ipaddress
import subprocess
import sys

import grpc
import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from asyncdiloco.cli import app
from asyncdiloco.errors import ConfigError, ServerUnavailableError, UnauthenticatedError
from asyncdiloco.ps import ParameterServer
from asyncdiloco.ps.config import ServerConfig
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire._proto import parameter_server_pb2_grpc as pb_grpc
from asyncdiloco.wire.security import ClientSecurityConfig, ServerSecurityConfig, is_loopback_host
from asyncdiloco.wire.tensors import Manifest
from asyncdiloco.worker.client import ParameterServerClient
from asyncdiloco.worker.config import WorkerConfig

pytestmark = pytest.mark.timeout(120)

MANIFEST = Manifest.from_named_tensors([("w", torch.zeros(4))])


# ----------------------------------------------------------------- certificates
def _key():
    return ec.generate_private_key(ec.SECP256R1())


def _cert(subject_cn, key, issuer_cn, issuer_key, *, ca: bool, san: bool = False):
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject_cn)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer_cn)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if san:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
    return builder.sign(issuer_key, hashes.SHA256())


def _write(path, cert=None, key=None):
    if cert is not None:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    else:
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    return str(path)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA with a server and a client certificate, and a rogue CA with its own client certificate."""
    d = tmp_path_factory.mktemp("pki")
    out = {}
    for ca_name in ("ca", "rogue"):
        ca_key = _key()
        ca = _cert(f"{ca_name} root", ca_key, f"{ca_name} root", ca_key, ca=True)
        out[f"{ca_name}_cert"] = _write(d / f"{ca_name}.pem", cert=ca)
        for leaf in ("server", "client"):
            k = _key()
            c = _cert(f"{ca_name} {leaf}", k, f"{ca_name} root", ca_key, ca=False, san=True)
            out[f"{ca_name}_{leaf}_cert"] = _write(d / f"{ca_name}-{leaf}.pem", cert=c)
            out[f"{ca_name}_{leaf}_key"] = _write(d / f"{ca_name}-{leaf}.key", key=k)
    (d / "token").write_text("s3cret-token\n")
    (d / "token").chmod(0o600)
    (d / "wrong").write_text("s3cret-tokem\n")
    out["token"], out["wrong"] = str(d / "token"), str(d / "wrong")
    return out


@pytest.fixture
def serve(start_server):
    """``serve(**ServerSecurityConfig fields)``: a started server with that security."""
    return lambda **security: start_server(security=ServerSecurityConfig(**security))


def _streamed(client: ParameterServerClient, push):
    """``push()`` as a Push stream (as for a server without PushOne)."""
    one, client._push_one = client._push_one, None  # noqa: SLF001
    try:
        return push()
    finally:
        client._push_one = one  # noqa: SLF001


def _every_rpc(client: ParameterServerClient) -> dict:
    """Call each RPC kind once; returns {name: exception or None}."""
    payload = MANIFEST.pack([torch.ones(4)])

    def push():
        return client.push(payload, worker_id=1, push_id=1, base_version=0, kind=pb.PUSH_KIND_INITIAL_PARAMETERS)

    calls = {
        "Join (unary)": lambda: client.join(MANIFEST, "x"),
        "Status (unary)": client.status,
        "Heartbeat (unary)": lambda: client.heartbeat(1),
        "Pull (server streaming)": lambda: client.pull(MANIFEST, 1),
        "Push (client streaming)": lambda: _streamed(client, push),
        "PushOne (unary)": push,  # a payload within one chunk goes as one message
        "Leave (unary)": lambda: client.leave(1),
        "Quorum (unary)": lambda: client.quorum(worker_id=1, round=0, manifest_hash="x", timeout_s=1),
        "Commit (unary)": lambda: client.commit(worker_id=1, quorum_id=1, success=True, timeout_s=1),
        "ReportEval (unary)": lambda: client.report_eval(0, 1.0, 1),
        "Store (unary)": lambda: client.store(
            pb.StoreRequest(worker_id=1, quorum_id=1, op=pb.STORE_OP_GET, keys=["k"])
        ),
    }
    every = {m.name for m in pb.DESCRIPTOR.services_by_name["ParameterServer"].methods}
    assert {name.split()[0] for name in calls} == every, "call every RPC of the service here"
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = None
        except Exception as exc:  # noqa: BLE001
            out[name] = exc
    return out


# ------------------------------------------------------------------------ token
@pytest.mark.parametrize("who", ["no token", "wrong token"])
def test_calls_without_the_right_token_are_refused_every_time(serve, pki, who):
    srv = serve(token_file=pki["token"])
    sec = None if who == "no token" else ClientSecurityConfig(token_file=pki["wrong"])
    with ParameterServerClient(srv.address, security=sec, rpc_timeout_s=5) as c:
        for _ in range(3):
            for name, exc in _every_rpc(c).items():
                assert isinstance(exc, UnauthenticatedError), (name, exc)
                assert "missing or wrong token" in str(exc) and "--token-file" in str(exc)
    st = srv.state.status()
    assert not st.workers and not st.initialized and st.version == 0  # nothing reached the servicer
    # on the wire it is UNAUTHENTICATED, for a raw stub too
    stub = pb_grpc.ParameterServerStub(grpc.insecure_channel(srv.address))
    with pytest.raises(grpc.RpcError) as info:
        stub.Status(pb.StatusRequest(), timeout=5, metadata=(("authorization", "Bearer nope"),))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert ("asyncdiloco-reason", "unauthenticated") in tuple(info.value.trailing_metadata())


def test_the_right_token_is_accepted_for_every_rpc(serve, pki):
    srv = serve(token_file=pki["token"])
    with ParameterServerClient(srv.address, security=ClientSecurityConfig(token_file=pki["token"])) as c:
        wid = c.join(MANIFEST, "ok").worker_id
        assert c.push(
            MANIFEST.pack([torch.ones(4)]),
            worker_id=wid,
            push_id=1,
            base_version=0,
            kind=pb.PUSH_KIND_INITIAL_PARAMETERS,
        ).applied
        assert torch.equal(MANIFEST.unpack_flat(c.pull(MANIFEST, wid).payload), torch.ones(4))
        c.heartbeat(wid)
        assert c.status().initialized


def test_empty_token_file_is_a_config_error(tmp_path):
    (tmp_path / "t").write_text("\n")
    with pytest.raises(ConfigError, match="holds an empty first line"):
        ParameterServer(ServerConfig(port=0, security=ServerSecurityConfig(token_file=str(tmp_path / "t")))).start()


# -------------------------------------------------------------------------- TLS
def test_tls_server_accepts_clients_that_trust_its_ca_and_refuses_others(serve, pki):
    srv = serve(tls_cert=pki["ca_server_cert"], tls_key=pki["ca_server_key"])
    with ParameterServerClient(srv.address, security=ClientSecurityConfig(tls_ca=pki["ca_cert"])) as c:
        assert c.status().version == 0
    with ParameterServerClient(f"localhost:{srv.port}", security=ClientSecurityConfig(tls_ca=pki["ca_cert"])) as c:
        assert c.status().version == 0  # the DNS name in the certificate works too
    for sec in (None, ClientSecurityConfig(tls_ca=pki["rogue_cert"])):  # plaintext; a CA that did not sign it
        with ParameterServerClient(srv.address, security=sec, rpc_timeout_s=2) as c:
            for _ in range(3):
                with pytest.raises(ServerUnavailableError):
                    c.status()


def test_mutual_tls_refuses_clients_without_a_certificate_from_the_client_ca(serve, pki):
    srv = serve(
        tls_cert=pki["ca_server_cert"],
        tls_key=pki["ca_server_key"],
        tls_client_ca=pki["ca_cert"],
        token_file=pki["token"],
    )
    good = ClientSecurityConfig(
        tls_ca=pki["ca_cert"], tls_cert=pki["ca_client_cert"], tls_key=pki["ca_client_key"], token_file=pki["token"]
    )
    with ParameterServerClient(srv.address, security=good) as c:
        assert c.join(MANIFEST, "mtls").worker_id == 1
    bad = [
        ClientSecurityConfig(tls_ca=pki["ca_cert"], token_file=pki["token"]),  # no client certificate
        ClientSecurityConfig(
            tls_ca=pki["ca_cert"],
            tls_cert=pki["rogue_client_cert"],
            tls_key=pki["rogue_client_key"],
            token_file=pki["token"],
        ),  # signed by another CA
    ]
    for sec in bad:
        with ParameterServerClient(srv.address, security=sec, rpc_timeout_s=2) as c:
            for _ in range(3):
                with pytest.raises(ServerUnavailableError):
                    c.join(MANIFEST, "intruder")
    assert [w.worker_id for w in srv.state.status().workers] == [1]


def test_half_configured_tls_is_a_config_error(pki):
    with pytest.raises(ConfigError, match="give both --tls-cert and --tls-key"):
        ServerSecurityConfig(tls_cert=pki["ca_server_cert"])
    with pytest.raises(ConfigError, match="also give --tls-ca"):
        ClientSecurityConfig(tls_cert=pki["ca_client_cert"], tls_key=pki["ca_client_key"])
    with pytest.raises(ConfigError, match="no such file"):
        ClientSecurityConfig(token_file="/nonexistent/token")


# ------------------------------------------------------------------ end to end
@pytest.mark.multiprocess
@pytest.mark.heavy
def test_cli_worker_with_token_and_tls_trains_and_a_wrong_token_exits_1(pki, tmp_path):
    cli = [sys.executable, "-m", "asyncdiloco", "-q"]
    server = subprocess.Popen(
        [
            *cli,
            "server",
            "--drain-s",
            "0",
            "--port",
            "0",
            "-H",
            "2",
            "--token-file",
            pki["token"],
            "--tls-cert",
            pki["ca_server_cert"],
            "--tls-key",
            pki["ca_server_key"],
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = server.stdout.readline()
        address = line.strip().rsplit(" ", 1)[1]
        job = [
            "--max-steps",
            "4",
            "--n-layer",
            "1",
            "--n-embd",
            "16",
            "--n-head",
            "2",
            "--batch-size",
            "2",
            "--context-len",
            "8",
            "--join-retry-s",
            "20",
        ]
        ok = subprocess.run(
            [*cli, "worker", "--server", address, "--token-file", pki["token"], "--tls-ca", pki["ca_cert"], *job],
            capture_output=True,
            text=True,
            timeout=90,
        )
        assert ok.returncode == 0, ok.stderr[-2000:]
        assert "2 pushes applied" in ok.stdout
        bad = subprocess.run(
            [*cli, "worker", "--server", address, "--token-file", pki["wrong"], "--tls-ca", pki["ca_cert"], *job],
            capture_output=True,
            text=True,
            timeout=90,
        )
        assert bad.returncode == 1
        assert "missing or wrong token" in bad.stderr
        server.terminate()
        out, _ = server.communicate(timeout=30)
        assert "stopped at version 2" in out
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_a_sync_worker_rounds_through_a_token_protected_server(pki):
    # Quorum and Commit carry the token like every other call.
    from asyncdiloco.ps.config import SyncConfig
    from asyncdiloco.worker.config import WorkerConfig
    from asyncdiloco.worker.sync_worker import SyncDiLoCoWorker

    srv = ParameterServer(
        ServerConfig(
            port=0,
            mode="sync",
            local_steps=2,
            sync=SyncConfig(min_workers=1),
            security=ServerSecurityConfig(token_file=pki["token"]),
        )
    ).start()
    try:
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        cfg = WorkerConfig(server=srv.address, security=ClientSecurityConfig(token_file=pki["token"]))
        with SyncDiLoCoWorker(model, opt, cfg) as worker:
            for _ in range(4):
                model(torch.randn(8, 4)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
            assert worker.stats.rounds_committed == 2
        assert srv.state.status().rounds_committed == 2
    finally:
        srv.stop(None)


def test_a_plaintext_cli_against_a_tls_server_is_told_to_give_the_ca(serve, pki, cli_exit):
    srv = serve(tls_cert=pki["ca_server_cert"], tls_key=pki["ca_server_key"])
    for command in ("status", "eval"):
        code, err = cli_exit([command, "--server", srv.address])
        assert code == 1 and f"cannot reach the server at {srv.address}" in err, err
        assert "if the server uses TLS, give --tls-ca" in err and len(err.strip().splitlines()) == 1, err
    code, err = cli_exit(["status", "--server", srv.address, "--tls-ca", pki["rogue_cert"]])
    assert code == 1 and "if the server uses TLS" not in err  # TLS given: the CA is the one to check


# ------------------------------------------- a token over plaintext beyond the loopback
# Addresses beyond the loopback are TEST-NET ones (192.0.2.0/24, RFC 5737); every refusal
# below happens before a port is bound or a connection made, and ``no_channels`` fails a
# test that would open one.
_BEYOND = ("0.0.0.0", "192.0.2.10", "::", "2001:db8::1", "[2001:db8::1]", "ps-host.example", "")
_LOOPBACK = ("127.0.0.1", "127.1.2.3", "localhost", "LOCALHOST", "::1", "[::1]", "::ffff:127.0.0.1")


@pytest.fixture
def no_channels(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"a channel was opened: {args[:1]}")

    monkeypatch.setattr(grpc, "insecure_channel", refuse)
    monkeypatch.setattr(grpc, "secure_channel", refuse)


@pytest.mark.parametrize("host", _LOOPBACK)
def test_loopback_hosts_are_recognised(host):
    assert is_loopback_host(host)


@pytest.mark.parametrize("host", _BEYOND)
def test_every_other_host_is_beyond_the_loopback(host):
    assert not is_loopback_host(host)


@pytest.mark.parametrize("host", _BEYOND)
def test_a_server_with_a_token_and_no_tls_beyond_the_loopback_is_refused(pki, host):
    with pytest.raises(ConfigError) as info:
        ServerConfig(host=host, port=0, security=ServerSecurityConfig(token_file=pki["token"]))
    message = str(info.value)
    assert f"--token-file without TLS on --host {host}, which is not a loopback address" in message
    assert "Give --tls-cert and --tls-key" in message and "add --insecure-trusted-network" in message


@pytest.mark.parametrize("host", _BEYOND)
def test_a_server_beyond_the_loopback_takes_a_token_with_tls_or_the_opt_in(pki, host):
    ServerConfig(host=host, security=ServerSecurityConfig(token_file=pki["token"], insecure_trusted_network=True))
    tls = {"tls_cert": pki["ca_server_cert"], "tls_key": pki["ca_server_key"]}
    ServerConfig(host=host, security=ServerSecurityConfig(token_file=pki["token"], **tls))
    ServerConfig(host=host)  # no token: nothing to protect (the start warns)


@pytest.mark.parametrize("host", _LOOPBACK)
def test_a_loopback_server_takes_a_token_over_plaintext_as_before(pki, host):
    ServerConfig(host=host, security=ServerSecurityConfig(token_file=pki["token"]))


@pytest.mark.parametrize("address", ["192.0.2.10:29500", "[2001:db8::1]:29500", "ps-host.example:29500"])
def test_a_client_with_a_token_and_no_tls_beyond_the_loopback_is_refused_before_connecting(pki, no_channels, address):
    token = ClientSecurityConfig(token_file=pki["token"])
    for build in (
        lambda: ParameterServerClient(address, security=token),
        lambda: WorkerConfig(server=address, security=token),
        lambda: WorkerConfig(server=f"127.0.0.1:1,{address}", security=token),  # one shard beyond is enough
    ):
        with pytest.raises(ConfigError) as info:
            build()
        message = str(info.value)
        assert f"--token-file without TLS to --server {address}, which is not a loopback address" in message
        assert "Give --tls-ca" in message and "add --insecure-trusted-network" in message
    trusted = ClientSecurityConfig(token_file=pki["token"], insecure_trusted_network=True)
    WorkerConfig(server=address, security=trusted)
    WorkerConfig(server=address, security=ClientSecurityConfig(token_file=pki["token"], tls_ca=pki["ca_cert"]))


def test_a_loopback_client_sends_a_token_over_plaintext_as_before(pki):
    token = ClientSecurityConfig(token_file=pki["token"])
    for address in ("127.0.0.1:1", "localhost:1", "[::1]:1"):
        ParameterServerClient(address, security=token).close()  # a channel opens lazily: nothing is sent


def test_the_commands_refuse_a_token_in_clear_beyond_the_loopback(pki, no_channels, cli_exit):
    token = ["--token-file", pki["token"]]
    code, err = cli_exit(["server", "--host", "0.0.0.0", "--port", "0", *token])
    assert code == 2 and "--token-file without TLS on --host 0.0.0.0" in err and "--tls-cert" in err, err
    for command in ("worker", "status", "eval"):
        code, err = cli_exit([command, "--server", "192.0.2.10:29500", *token])
        assert code == 2, (command, err)
        assert "--token-file without TLS to --server 192.0.2.10:29500" in err and "--tls-ca" in err, err
        assert "--insecure-trusted-network" in err and len(err.strip().splitlines()) == 1, err
    code, err = cli_exit(["server", "--port", "0", "--parent", "192.0.2.10:29500", "--parent-token-file", pki["token"]])
    assert code == 2 and "--parent-token-file without TLS to --parent 192.0.2.10:29500" in err, err
    assert "Give --parent-tls-ca" in err, err


def test_the_opt_in_flag_lets_the_commands_build_their_configs(pki):
    from asyncdiloco.cli import server as server_cli
    from asyncdiloco.cli import worker as worker_cli

    parse = app.build_parser().parse_args
    trusted = ["--token-file", pki["token"], "--insecure-trusted-network"]
    cfg = server_cli.config(parse(["server", "--host", "0.0.0.0", *trusted]))
    assert cfg.security.insecure_trusted_network and cfg.security.tls_cert is None
    worker = worker_cli.configs(parse(["worker", "--server", "192.0.2.10:29500", "--max-steps", "1", *trusted])).worker
    assert worker.security.insecure_trusted_network
    args = parse(["server", "--parent", "192.0.2.10:29500", "--parent-token-file", pki["token"], *trusted[2:]])
    assert server_cli.upstream(args).security.insecure_trusted_network  # the server's opt-in covers its parent link
