"""The HTTP monitoring endpoint on ``ServerConfig.metrics_port``: ``/`` the dashboard,
``/metrics`` Prometheus, ``/status.json`` the ``StatusReply``; a sampler thread records the
version for the dashboard's chart. No token, no TLS: docs/operations.md, "Watching a run".
"""

from __future__ import annotations

import logging
import socket
import socketserver
import threading
from collections.abc import Callable, Iterable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from google.protobuf import json_format
from prometheus_client import make_wsgi_app

from asyncdiloco.errors import ConfigError
from asyncdiloco.ps.state import ParameterServerState
from asyncdiloco.ps.watch.dashboard import RunHistory, render
from asyncdiloco.ps.watch.metrics import ServerMetrics
from asyncdiloco.wire.listen import bind_every

log = logging.getLogger(__name__)

#: Seconds between two samples of the version for the dashboard.
SAMPLE_EVERY_S = 1.0


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    """A threading WSGI server on a socket bound beforehand (wire/listen.py ``bind_every``)."""

    daemon_threads = True  # a slow scraper never holds up stop()

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(sock.getsockname()[:2], _QuietHandler, bind_and_activate=False)
        self.socket.close()  # the one TCPServer made: serve on the bound one instead
        self.socket = sock
        self.address_family = sock.family
        self.server_bind()
        self.server_activate()

    def server_bind(self) -> None:
        """What HTTPServer's bind records, for a socket already bound (and without its
        reverse lookup of the host name, which can stall on a machine without DNS)."""
        self.server_address = self.socket.getsockname()
        host, self.server_port = self.server_address[:2]
        self.server_name = str(host)
        self.setup_environ()


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        log.debug("metrics endpoint: " + format, *args)


class MonitorServer:
    """Serves the metrics, the dashboard and the status of ``state`` over HTTP.

    Args:
        state: the server's state.
        metrics: its registry (metrics.py).
        host: interface to bind (the server's ``--host``): every address it resolves to.
        port: TCP port; 0 picks a free one (read ``.port`` after ``start``).
    """

    def __init__(self, state: ParameterServerState, metrics: ServerMetrics, *, host: str, port: int) -> None:
        self.state = state
        self.metrics = metrics
        self.host = host
        self.port = port
        self.history = RunHistory()
        self._metrics_app = make_wsgi_app(metrics.registry)
        #: One HTTP server per address of ``host`` (each serves every request path).
        self._httpds: list[_Server] = []
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()

    def start(self) -> MonitorServer:
        """Bind ``port`` on every address ``host`` resolves to and serve.

        Raises:
            ConfigError: one of the addresses cannot be bound (named in the message).
        """
        socks = bind_every(self.host, self.port, what="the metrics endpoint", flag="--metrics-port")
        servers: list[_Server] = []
        try:
            for sock in socks:
                servers.append(_Server(sock))
                servers[-1].set_app(self.app)
        except OSError as exc:
            for sock in socks:
                sock.close()
            raise ConfigError(
                f"cannot serve metrics on {self.host}:{self.port} ({exc.strerror}); choose another "
                f"--metrics-port (0 picks a free one)"
            ) from None
        self._httpds, self.port = servers, servers[0].server_address[1]
        self._threads = [
            threading.Thread(target=h.serve_forever, kwargs={"poll_interval": 0.2}, name="ps-metrics", daemon=True)
            for h in servers
        ] + [threading.Thread(target=self._sample, name="ps-metrics-sampler", daemon=True)]
        for thread in self._threads:
            thread.start()
        log.info("metrics and dashboard on http://%s:%d/", self.host, self.port)
        return self

    def stop(self) -> None:
        """Stop serving and sampling (requests in flight finish on their daemon threads)."""
        self._stopping.set()
        for httpd in self._httpds:
            httpd.shutdown()
            httpd.server_close()
        self._httpds = []
        for thread in self._threads:
            thread.join(timeout=5.0)
        self._threads = []

    def _sample(self) -> None:
        while not self._stopping.is_set():
            self.history.sample(self.state.clock() - self.state.started, self.state.version)
            self._stopping.wait(SAMPLE_EVERY_S)

    # ------------------------------------------------------------------- WSGI
    def app(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        """The WSGI app: /, /metrics, /status.json; anything else 404."""
        path = environ.get("PATH_INFO", "/")
        if path == "/metrics":
            return self._metrics_app(environ, start_response)
        if environ.get("REQUEST_METHOD", "GET") not in ("GET", "HEAD"):
            return _reply(start_response, "405 Method Not Allowed", "text/plain", b"GET only\n")
        if path == "/":
            page = render(self.state.status(), self.history.points()).encode()
            return _reply(start_response, "200 OK", "text/html; charset=utf-8", page)
        if path == "/status.json":
            body = json_format.MessageToJson(self.state.status(), indent=1).encode()
            return _reply(start_response, "200 OK", "application/json", body)
        return _reply(start_response, "404 Not Found", "text/plain", b"not found: try /, /metrics or /status.json\n")


def _reply(start_response: Callable, status: str, content_type: str, body: bytes) -> list[bytes]:
    start_response(status, [("Content-Type", content_type), ("Content-Length", str(len(body)))])
    return [body]
