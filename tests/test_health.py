"""The standard gRPC health service and server reflection on the server's port
(ps/server.py), and the token check's exemption of the health checks (wire/security.py)."""

from __future__ import annotations

import threading

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from helpers import STUCK_S

from asyncdiloco.errors import ConfigError
from asyncdiloco.ps.config import DurabilityConfig
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.security import ClientSecurityConfig, ServerSecurityConfig
from asyncdiloco.wire.tensors import Manifest
from asyncdiloco.worker.client import ParameterServerClient

pytestmark = pytest.mark.timeout(60)

MANIFEST = Manifest.from_named_tensors([("w", torch.zeros(4))])
SERVICE = "asyncdiloco.v1.ParameterServer"
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def check(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


def initialize(srv, security: ClientSecurityConfig | None = None) -> None:
    with ParameterServerClient(srv.address, security=security) as client:
        wid = client.join(MANIFEST, "h").worker_id
        payload = MANIFEST.pack([torch.zeros(4)])
        client.push(payload, worker_id=wid, push_id=1, base_version=0, kind=pb.PUSH_KIND_INITIAL_PARAMETERS)


def list_services(address: str, metadata=()) -> list[str]:
    with grpc.insecure_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        replies = stub.ServerReflectionInfo(iter([request]), timeout=10, metadata=metadata)
        return sorted(s.name for r in replies for s in r.list_services_response.service)


@pytest.mark.parametrize("metrics_port", [None, 0])  # with and without the metrics interceptor
def test_not_serving_until_initialized_then_serving_then_not_serving_once_stop_begins(start_server, metrics_port):
    srv = start_server(metrics_port=metrics_port)
    assert check(srv.address) == check(srv.address, SERVICE) == NOT_SERVING
    initialize(srv)
    assert check(srv.address) == check(srv.address, SERVICE) == SERVING

    channel = grpc.insecure_channel(srv.address)
    watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=SERVICE), timeout=STUCK_S)
    assert next(watch).status == SERVING
    stopper = threading.Thread(target=srv.stop, kwargs={"grace_s": 2.0})
    stopper.start()
    assert next(watch).status == NOT_SERVING  # sent as stop() begins, before the port closes
    watch.cancel()  # the stop need not wait out its grace for this stream
    stopper.join(STUCK_S)
    channel.close()


def test_a_restored_server_is_serving_from_the_start(start_server, tmp_path):
    durability = DurabilityConfig(checkpoint_dir=str(tmp_path))
    first = start_server(durability=durability)
    initialize(first)
    first.stop()
    again = start_server(durability=durability)
    assert check(again.address, SERVICE) == SERVING


def test_reflection_lists_the_services(start_server):
    srv = start_server()
    assert list_services(srv.address) == sorted(
        [SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"]
    )


def test_health_checks_need_no_token_but_reflection_does(start_server, tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    token.chmod(0o600)
    srv = start_server(security=ServerSecurityConfig(token_file=str(token)))
    assert check(srv.address) == NOT_SERVING  # answered without a token
    with pytest.raises(grpc.RpcError) as refused:
        list_services(srv.address)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert SERVICE in list_services(srv.address, metadata=(("authorization", "Bearer s3cret"),))
    initialize(srv, ClientSecurityConfig(token_file=str(token)))
    assert check(srv.address, SERVICE) == SERVING


def test_a_probe_sees_not_serving_while_the_server_drains_and_calls_are_still_served(start_server, monkeypatch):
    """``stop(drain_s=...)``: NOT_SERVING first, then ``drain_s`` seconds of serving as
    usual (a probe's Check and a Status are answered), then the stop. The drain's wait is
    replaced by the probes themselves: no wall-clock race."""
    import asyncdiloco.ps.server as server_module

    srv = start_server()
    initialize(srv)
    seen = []

    def drain(seconds: float) -> None:
        with ParameterServerClient(srv.address) as client:
            seen.extend([seconds, check(srv.address), check(srv.address, SERVICE), client.status().version])

    monkeypatch.setattr(server_module, "_drain", drain)
    srv.stop(grace_s=1.0, drain_s=1.5)
    assert seen == [1.5, NOT_SERVING, NOT_SERVING, 0]
    with pytest.raises(grpc.RpcError):  # stopped after the drain
        check(srv.address)


def test_the_cli_server_drains_for_drain_s_after_a_signal(monkeypatch):
    from asyncdiloco.cli import app, server

    assert app.build_parser().parse_args(["server"]).drain_s == 1.0
    args = app.build_parser().parse_args(["server", "--drain-s", "0.25"])
    assert args.drain_s == 0.25 and server.stop_kwargs(args) == {"grace_s": 2.0, "drain_s": 0.25}
    code = app.build_parser().parse_args(["server", "--drain-s", "-1"])
    with pytest.raises(ConfigError, match="--drain-s -1 is invalid"):
        server.stop_kwargs(code)
