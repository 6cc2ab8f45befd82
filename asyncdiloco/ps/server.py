"""The parameter server as a running process: ``ParameterServer(config).start()`` restores
the durable state, binds the gRPC port (and the bulk and metrics ports) on every address
of the host, serves the health and reflection services, and ``stop()`` drains, stops and
checkpoints. Every step is undone if a later one fails. docs/architecture.md, "The
server's rooms"; the operator's side: docs/operations.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import socket
import time
from concurrent import futures
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from asyncdiloco.errors import ConfigError
from asyncdiloco.ps.config import ServerConfig
from asyncdiloco.ps.durable.shard_files import check_shard_identity
from asyncdiloco.ps.durable.store import DurableStore
from asyncdiloco.ps.state import ParameterServerState
from asyncdiloco.ps.transport.grpc_service import ParameterServerService
from asyncdiloco.wire.channel import grpc_channel_options
from asyncdiloco.wire.grpc_chunks import SERVICE, add_parameter_server
from asyncdiloco.wire.listen import bind_every, listen_address_of
from asyncdiloco.wire.security import server_credentials, server_interceptors

if TYPE_CHECKING:
    from asyncdiloco.ps.tier.rebase import UpstreamConfig
    from asyncdiloco.ps.tier.upstream import UpstreamLink
    from asyncdiloco.ps.transport.bulk import BulkServer
    from asyncdiloco.ps.watch.metrics import ServerMetrics
    from asyncdiloco.ps.watch.monitor import MonitorServer

log = logging.getLogger(__name__)

_SERVING, _NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


class ParameterServer:
    """A gRPC parameter server around a ``ParameterServerState``.

    Args:
        config: address, outer optimizer, H, limits, durability, security.
        upstream: the parent server this one is a regional tier of (upstream.py; None:
            a flat server). Async mode only, without durability.
    Raises:
        ConfigError (from the constructor): ``upstream`` with sync mode or a checkpoint folder.
        ConfigError (from ``start``): the address cannot be bound (port in use, bad host),
            or a token/PEM file cannot be read.
        CheckpointError (from ``start``): the checkpoint folder is in use, or its newest
            checkpoint or log is unusable.
    """

    def __init__(self, config: ServerConfig, upstream: UpstreamConfig | None = None) -> None:
        if upstream is not None and (config.mode != "async" or config.durability is not None):
            raise ConfigError(
                f"--parent {upstream.parent} needs an async server without --checkpoint-dir (the rebase onto the "
                f"parent's model is not in the write-ahead log): drop --checkpoint-dir or --mode sync, or --parent"
            )
        self.config = config
        self.upstream_config = upstream
        #: The link to the parent (upstream.py), while serving with ``upstream``.
        self.upstream: UpstreamLink | None = None
        self.state = ParameterServerState(config)
        self.store = DurableStore(config.durability, config) if config.durability is not None else None
        self._server: grpc.Server | None = None
        self.port: int | None = None
        self.bulk: BulkServer | None = None  # when config.bulk_port is set
        self.monitor: MonitorServer | None = None  # when config.metrics_port is set
        self.health = health.HealthServicer()
        self._health_of: ParameterServerState | None = None  # the state whose initialization it listens for

    @property
    def address(self) -> str:
        """ "HOST:PORT" workers connect to (valid after ``start``)."""
        return f"{self.config.host}:{self.port}"

    def start(self) -> ParameterServer:
        """Restore the durable state, bind the port(s) and start serving; a start that fails
        at any step gives back every resource it acquired, in reverse order.

        Returns:
            self, serving (``port`` is the bound port).
        Raises:
            ConfigError: an address cannot be bound, or a token/PEM file cannot be read.
            CheckpointError: the checkpoint folder is in use or unusable.
        """
        if self._server is not None:
            raise ConfigError(
                f"this ParameterServer is already serving on {self.address}; call stop() before starting it "
                f"again, or build a second ParameterServer"
            )
        token_check = server_interceptors(self.config.security)
        creds = server_credentials(self.config.security)
        self._warn_if_exposed(bool(token_check), creds is not None)
        metrics = self._metrics()
        with contextlib.ExitStack() as undo:
            if metrics is not None:
                undo.callback(metrics.detach)
            self._restore(undo)
            self._watch_health()
            server = self._grpc_server(([metrics.interceptor] if metrics else []) + token_check)
            undo.callback(server.stop, None)
            port = self._bind(server, creds)
            if self.config.bulk_port is not None:
                self._start_bulk(self.config.bulk_port)
                undo.callback(self._stop_bulk, None)
            if metrics is not None:
                self._start_monitor(metrics)
                undo.callback(self._stop_monitor)
            server.start()
            undo.pop_all()  # serving: stop() gives everything back from here on
        self._server, self.port = server, port
        if self.upstream_config is not None:
            self._start_upstream(self.upstream_config, port)
        log.info("parameter server listening on %s", self.address)
        return self

    def _restore(self, undo: contextlib.ExitStack) -> None:
        """Restore the durable state (before any port is bound: no client sees a
        half-restored server); ``undo`` gives the folder back if the start fails."""
        if self.store is not None and self.config.durability is not None:
            check_shard_identity(
                self.config.durability.checkpoint_dir, self.config.shard_index, self.config.shard_count
            )
            self.store.observer = self.state.observer
            self.store.open(self.state.durability)
            undo.callback(self.store.abandon)
        with self.state.locks.books:
            self.state.counters.restart_rate()  # the replayed pushes were not applied just now

    def _start_upstream(self, link: UpstreamConfig, port: int) -> None:
        from asyncdiloco.ps.tier.upstream import UpstreamLink

        if not link.name:  # unique per process: two regions must not share a name at the parent
            link = dataclasses.replace(link, name=f"region-{socket.gethostname()}:{port}")
        self.upstream = UpstreamLink(self.state, link).start()

    def _warn_if_exposed(self, token: bool, tls: bool) -> None:
        if self.config.host not in ("127.0.0.1", "localhost", "::1") and not (token and tls):
            log.warning(
                "listening on %s without %s: anyone who can reach the port can push to the model",
                self.config.host,
                " and ".join(n for n, on in (("a token", token), ("TLS", tls)) if not on),
            )

    def _metrics(self) -> ServerMetrics | None:
        """The server's metrics registry, attached to the state (None when metrics are off)."""
        if self.config.metrics_port is None:
            return None
        from asyncdiloco.ps.watch.metrics import ServerMetrics

        return ServerMetrics(self.state)

    def _watch_health(self) -> None:
        """NOT_SERVING until the model is initialized (now, if it was restored), then SERVING."""
        self.health = health.HealthServicer()  # a stopped servicer stays NOT_SERVING: a fresh one per start
        for service in ("", SERVICE):
            self.health.set(service, _NOT_SERVING)
        if self._health_of is not self.state:  # once per state (a server may be started again)
            self.state.observer.when_initialized(self._serving)
            self._health_of = self.state
        if self.state.initialized:
            self._serving()

    def _serving(self) -> None:
        for service in ("", SERVICE):
            self.health.set(service, _SERVING)  # ignored once stop() began

    def _grpc_server(self, interceptors: list) -> grpc.Server:
        chunk_bytes = self.config.chunk_bytes
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=self.config.max_concurrent_rpcs, thread_name_prefix="ps-rpc"),
            # A fixed HTTP/2 window of one chunk per stream: gRPC's adaptive (BDP) windows let
            # pushes waiting for a receive buffer pile up whole payloads in gRPC's own memory;
            # one chunk keeps that bounded at no cost in throughput.
            options=grpc_channel_options(chunk_bytes)
            + [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", chunk_bytes)],
            interceptors=interceptors,
        )
        add_parameter_server(ParameterServerService(self.state), server)  # chunk messages coded by hand
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection((SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        return server

    def _bind(self, server: grpc.Server, creds: grpc.ServerCredentials | None) -> int:
        """Bind the gRPC port on every address ``config.host`` resolves to; returns it.

        gRPC given a name binds whichever of its addresses it can and serves on: with
        ``localhost`` on 127.0.0.1 alone while another process holds [::1] on the port,
        a client that resolves ``localhost`` to ::1 hands that process its token. So the
        port is tried on every address first (wire/listen.py: a plain socket, closed at
        once; it also spares the raw C-core error line of gRPC's own failed bind), then
        gRPC binds each address by number, and any one that fails stops the start.

        Raises:
            ConfigError: the port is in use on one of the addresses (named), or the host
                does not resolve or is not an address of this machine.
        """
        host = self.config.host
        probes = bind_every(host, self.config.port, what="the gRPC port", flag="--port")
        port = probes[0].getsockname()[1]
        targets = [listen_address_of(sock).with_port(port) for sock in probes]
        for sock in probes:
            sock.close()
        for target in targets:
            bound = 0
            try:
                bound = server.add_secure_port(target, creds) if creds is not None else server.add_insecure_port(target)
            except RuntimeError as exc:  # grpcio raises when it cannot bind
                log.debug("bind failed: %s", exc)
            if bound != port:
                raise ConfigError(
                    f"cannot listen on {target} for the gRPC port: port in use (taken just now, or not an address "
                    f"of this machine; --host {host}); stop the process that holds it, or choose another --port "
                    f"(0 picks a free one)"
                )
        return port

    def _start_bulk(self, port: int) -> None:
        from asyncdiloco.ps.transport.bulk import BulkServer
        from asyncdiloco.wire.security import read_token, server_ssl_context

        security = self.config.security
        token = read_token(security.token_file) if security is not None and security.token_file else None
        bulk = BulkServer(
            self.state,
            host=self.config.host,
            port=port,
            token=token,
            ssl_context=server_ssl_context(security),
            max_connections=self.config.max_concurrent_rpcs,
            idle_timeout_s=self.config.lease_s,
        )
        self.bulk = bulk.start()
        self.state.bulk_port = bulk.port  # told to workers in every RunConfig

    def _start_monitor(self, metrics: ServerMetrics) -> None:
        from asyncdiloco.ps.watch.monitor import MonitorServer

        self.monitor = MonitorServer(self.state, metrics, host=self.config.host, port=self.config.metrics_port or 0)
        self.monitor.start()
        if self.config.host not in ("127.0.0.1", "localhost", "::1"):
            log.warning(
                "metrics and dashboard on %s:%d without a token or TLS: anyone who can reach the port sees the "
                "run's status (worker names, settings); keep it on a trusted network",
                self.config.host,
                self.monitor.port,
            )

    def _stop_monitor(self) -> None:
        if self.monitor is not None:
            self.monitor.stop()
            self.monitor.metrics.detach()
            self.monitor = None

    @property
    def metrics_port(self) -> int:
        """The HTTP monitoring endpoint's port (0 when it is off)."""
        return self.monitor.port if self.monitor is not None else 0

    def _stop_bulk(self, grace_s: float | None) -> None:
        if self.bulk is not None:
            self.bulk.stop(grace_s)
            self.bulk = None

    @property
    def bulk_port(self) -> int:
        """The bulk data channel's port (0 when it is off)."""
        return self.state.bulk_port

    def stop(self, grace_s: float | None = 1.0, drain_s: float = 0.0) -> None:
        """Stop serving (in-flight calls get ``grace_s`` seconds), then write a final checkpoint.

        The health service answers NOT_SERVING from the first moment; for ``drain_s``
        seconds after it every call is still served as usual, so that probes (a load
        balancer's, a Kubernetes readiness probe) see NOT_SERVING and send no new work
        before the port closes. 0 (the default) stops at once.
        """
        self.health.enter_graceful_shutdown()
        if drain_s > 0:
            _drain(drain_s)
        if self.upstream is not None:  # its last push upward, then Leave the parent
            self.upstream.stop()
            self.upstream = None
        self.state.groups.close()  # held push replies go out now, not at their deadlines
        if self.state.quorum is not None:  # and sync mode's blocked Quorum/Commit calls return
            self.state.quorum.close()
        self._stop_bulk(grace_s)
        if self._server is not None:
            self._server.stop(grace_s).wait()
            self._server = None
            if self.store is not None:
                self.store.close()
        self._stop_monitor()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the server stops (or ``timeout_s`` passes). True if stopped."""
        return self._server.wait_for_termination(timeout_s) if self._server else True

    def __enter__(self) -> ParameterServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _drain(seconds: float) -> None:
    """``stop``'s drain: the server serves on, NOT_SERVING, for ``seconds``."""
    time.sleep(seconds)
