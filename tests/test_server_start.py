"""``ParameterServer.start``: a start that fails at any step gives back everything it took.

Each test makes one step of the start fail (the gRPC port or the bulk channel's port is
taken) on a server with a checkpoint folder, then checks that
the folder's lock, the ports and the rest were released: a second start on the same
folder and the same ports works.
"""

from __future__ import annotations

import dataclasses
import re
import socket

import pytest

from asyncdiloco.algo.config import OuterConfig
from asyncdiloco.errors import CheckpointError, ConfigError
from asyncdiloco.ps import ParameterServer
from asyncdiloco.ps.config import DurabilityConfig, ServerConfig, SyncConfig


def _taken_port() -> socket.socket:
    """A listening socket on 127.0.0.1 (a free port, now taken); close it to free it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    return sock


def _durable(tmp_path, **fields) -> ServerConfig:
    fields.setdefault("port", 0)
    return ServerConfig(durability=DurabilityConfig(checkpoint_dir=str(tmp_path / "ckpt")), **fields)


def _start_again(config: ServerConfig) -> None:
    """The next start on the same folder works (the failed one released its lock)."""
    srv = ParameterServer(config).start()
    try:
        assert srv.port
    finally:
        srv.stop(None)


def test_a_start_whose_bulk_port_is_taken_releases_the_checkpoint_folder(tmp_path):
    taken = _taken_port()
    bulk_port = taken.getsockname()[1]
    config = _durable(tmp_path, mode="sync", bulk_port=bulk_port)
    with pytest.raises(ConfigError, match="bulk data channel"):
        ParameterServer(config).start()
    taken.close()
    _start_again(config)  # the same folder and bulk port


def test_a_sync_server_needs_no_port_but_its_grpc_one(tmp_path):
    """The rendezvous store is the Store RPC: a sync server binds its gRPC port alone."""
    _start_again(_durable(tmp_path, mode="sync", sync=SyncConfig()))


def test_a_start_whose_grpc_port_is_taken_releases_the_checkpoint_folder(tmp_path):
    taken = _taken_port()
    config = _durable(tmp_path, port=taken.getsockname()[1])
    with pytest.raises(ConfigError, match="cannot listen on"):
        ParameterServer(config).start()
    taken.close()
    _start_again(dataclasses.replace(config, port=0))


def test_a_stopped_server_releases_the_checkpoint_folder(tmp_path):
    config = _durable(tmp_path, mode="sync", bulk_port=0)
    _start_again(config)
    _start_again(config)


def test_a_failed_first_start_leaves_the_folder_fresh_for_other_settings(tmp_path):
    taken = _taken_port()
    config = _durable(tmp_path, port=taken.getsockname()[1])
    with pytest.raises(ConfigError, match="cannot listen on"):
        ParameterServer(config).start()
    taken.close()
    # the server never served: the next start is a fresh run with whatever settings it has
    sgd = OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0)
    _start_again(dataclasses.replace(config, port=0, outer=sgd))


def test_a_failed_start_of_a_restored_folder_keeps_its_checkpoint(tmp_path):
    config = _durable(tmp_path)
    _start_again(config)  # writes the folder's first checkpoint
    written = sorted(p.name for p in (tmp_path / "ckpt").glob("ckpt-*"))
    taken = _taken_port()
    with pytest.raises(ConfigError, match="cannot listen on"):
        ParameterServer(dataclasses.replace(config, port=taken.getsockname()[1])).start()
    taken.close()
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("ckpt-*")) == written


def test_a_checkpoint_dir_that_cannot_be_created_is_refused_in_one_line(tmp_path):
    (tmp_path / "a-file").write_text("")
    config = ServerConfig(port=0, durability=DurabilityConfig(checkpoint_dir=str(tmp_path / "a-file" / "ckpt")))
    with pytest.raises(CheckpointError, match="cannot be created"):
        ParameterServer(config).start()


def test_starting_a_serving_server_again_is_refused_and_stop_frees_its_port():
    srv = ParameterServer(ServerConfig(port=0)).start()
    port = srv.port
    try:
        with pytest.raises(ConfigError, match="already serving"):
            srv.start()
    finally:
        srv.stop(None)
    with socket.socket() as s:  # the port is free again: nothing else kept serving on it
        s.bind(("127.0.0.1", port))


@pytest.mark.parametrize(
    "fields, needle",
    [
        ({"port": 29500, "metrics_port": 29500}, "metrics_port=29500 is invalid: it is also the gRPC port (port)"),
        ({"port": 29500, "bulk_port": 29500}, "bulk_port=29500 is invalid: it is also the gRPC port (port)"),
        ({"port": 0, "bulk_port": 9100, "metrics_port": 9100}, "metrics_port=9100 is invalid: it is also the bulk"),
    ],
)
def test_two_listeners_on_one_port_are_refused_at_config_time(fields, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        ServerConfig(**fields)
    ServerConfig(port=0, bulk_port=0, metrics_port=0)  # 0 picks a free port for each: no clash


def test_the_server_command_refuses_its_metrics_port_on_its_grpc_port(cli_exit):
    code, err = cli_exit(["server", "--port", "29500", "--metrics-port", "29500"])
    assert code == 2 and "metrics_port=29500 is invalid" in err and "give another --metrics-port" in err


# ------------------------------------------------- every address of the host, or none
def _ipv6_loopback_or_skip() -> None:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("this machine has no IPv6 loopback (::1 cannot be bound), so localhost has one address here")


@pytest.fixture
def two_address_localhost(monkeypatch):
    """``localhost`` resolving to 127.0.0.1 and ::1, as on most machines (where this
    machine's resolver gives only 127.0.0.1, ::1 is added to Python's answer)."""
    _ipv6_loopback_or_skip()
    real = socket.getaddrinfo

    def getaddrinfo(host, port, *args, **kwargs):
        infos = list(real(host, port, *args, **kwargs))
        if host == "localhost" and not any(info[0] == socket.AF_INET6 for info in infos):
            infos.append((socket.AF_INET6, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", ("::1", port or 0, 0, 0)))
        return infos

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


def _hold_ipv6_loopback() -> socket.socket:
    """A listening socket on [::1]:P, for a P free on 127.0.0.1 (a neighbour's port)."""
    for _ in range(20):
        held = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        held.bind(("::1", 0))
        held.listen(1)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", held.getsockname()[1]))
                return held
            except OSError:
                held.close()
    raise AssertionError("no port free on 127.0.0.1 whose [::1] twin was free")


@pytest.mark.parametrize(
    "field, listener",
    [("port", "the gRPC port"), ("bulk_port", "the bulk data channel"), ("metrics_port", "the metrics endpoint")],
)
def test_localhost_with_its_ipv6_address_taken_is_refused_naming_it(two_address_localhost, field, listener):
    """Issue 32: a neighbour on [::1]:P must not get the token of the workers that resolve
    ``localhost`` to ::1: the server listens on every address of the name, or not at all."""
    held = _hold_ipv6_loopback()
    port = held.getsockname()[1]
    fields = {"port": 0, "bulk_port": None, "metrics_port": None} | {field: port}
    try:
        srv = ParameterServer(ServerConfig(host="localhost", **fields))
        try:
            srv.start()
        except ConfigError as exc:
            message = str(exc)
        else:
            srv.stop(None)
            pytest.fail(f"the server started on localhost with [::1]:{port} held by another process")
    finally:
        held.close()
    assert f"cannot listen on [::1]:{port} for {listener}: port in use" in message, message
    assert "resolves to 127.0.0.1, ::1" in message, message
    flag = "--" + field.replace("_", "-")
    assert f"choose another {flag}" in message, message
    with socket.socket() as s:  # the refused start gave 127.0.0.1:P back
        s.bind(("127.0.0.1", port))


def test_every_listener_serves_every_address_of_localhost(two_address_localhost):
    srv = ParameterServer(ServerConfig(host="localhost", port=0, bulk_port=0, metrics_port=0)).start()
    try:
        for port in (srv.port, srv.bulk_port, srv.metrics_port):
            for family, address in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
                with socket.socket(family, socket.SOCK_STREAM) as s:
                    s.settimeout(10)
                    s.connect((address, port))  # refused (ConnectionRefusedError) if nothing listens there
    finally:
        srv.stop(None)


def test_a_host_that_does_not_resolve_is_refused_naming_it():
    with pytest.raises(ConfigError, match=r"--host 'no-such-host\.invalid' does not resolve"):
        ParameterServer(ServerConfig(host="no-such-host.invalid", port=0)).start()


def test_the_server_command_on_localhost_refuses_when_a_neighbour_holds_its_ipv6_port(
    two_address_localhost, cli_exit, monkeypatch
):
    """``asyncdiloco server --host localhost --port P`` in this process, [::1]:P held. (A
    server that started anyway stops at once instead of waiting for a signal.)"""
    import threading
    import types

    import asyncdiloco.cli.server as server_cli

    class StopAtOnce(threading.Event):
        def wait(self, timeout=None):
            return True

    monkeypatch.setattr(server_cli, "threading", types.SimpleNamespace(Event=StopAtOnce))  # this command's only
    held = _hold_ipv6_loopback()
    port = held.getsockname()[1]
    try:
        code, err = cli_exit(["server", "--host", "localhost", "--port", str(port), "--drain-s", "0"])
    finally:
        held.close()
    assert code == 2, err
    assert f"cannot listen on [::1]:{port} for the gRPC port: port in use" in err, err
    assert len(err.strip().splitlines()) == 1, err
