"""The HTTP monitoring endpoint on ``ServerConfig.metrics_port``: one WSGI app served by a
threading ``wsgiref`` server in a daemon thread, beside the gRPC port on the same host.

    /             the dashboard (dashboard.py), text/html
    /metrics      Prometheus text exposition of the server's registry (metrics.py), via
                  prometheus_client's own WSGI app (gzip, ``name[]`` filters)
    /status.json  the ``StatusReply`` as JSON (``google.protobuf.json_format``)

A sampler thread records the version once a second for the dashboard's chart
(``RunHistory``). The endpoint has no token and no TLS: bind it where only trusted
scrapers reach it (docs/operations.md, "Watching a run").
"""

from __future__ import annotations

import logging
import socket
import socketserver
import threading
from collections.abc import Callable, Iterable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from google.protobuf import json_format
from prometheus_client import make_wsgi_app

from asyncdiloco.errors import ConfigError
from asyncdiloco.ps.dashboard import RunHistory, render
from asyncdiloco.ps.metrics import ServerMetrics
from asyncdiloco.ps.state import ParameterServerState

log = logging.getLogger(__name__)

#: Seconds between two samples of the version for the dashboard.
SAMPLE_EVERY_S = 1.0


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a slow scraper never holds up stop()
    allow_reuse_address = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        log.debug("metrics endpoint: " + format, *args)


class MonitorServer:
    """Serves the metrics, the dashboard and the status of ``state`` over HTTP.

    Args:
        state: the server's state.
        metrics: its registry (metrics.py).
        host: interface to bind (the server's ``--host``).
        port: TCP port; 0 picks a free one (read ``.port`` after ``start``).
    """

    def __init__(self, state: ParameterServerState, metrics: ServerMetrics, *, host: str, port: int) -> None:
        self.state = state
        self.metrics = metrics
        self.host = host
        self.port = port
        self.history = RunHistory()
        self._metrics_app = make_wsgi_app(metrics.registry)
        self._httpd: WSGIServer | None = None
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()

    def start(self) -> MonitorServer:
        """Bind and serve.

        Raises:
            ConfigError: the address cannot be bound.
        """
        server_class = _Server6 if ":" in self.host else _Server
        try:
            httpd = make_server(self.host, self.port, self.app, server_class=server_class, handler_class=_QuietHandler)
        except OSError as exc:
            raise ConfigError(
                f"cannot serve metrics on {self.host}:{self.port} ({exc.strerror}); choose another "
                f"--metrics-port (0 picks a free one)"
            ) from None
        self._httpd, self.port = httpd, httpd.server_address[1]
        self._threads = [
            threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.2}, name="ps-metrics", daemon=True),
            threading.Thread(target=self._sample, name="ps-metrics-sampler", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        log.info("metrics and dashboard on http://%s:%d/", self.host, self.port)
        return self

    def stop(self) -> None:
        """Stop serving and sampling (requests in flight finish on their daemon threads)."""
        self._stopping.set()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        for thread in self._threads:
            thread.join(timeout=5.0)
        self._threads = []

    def _sample(self) -> None:
        while not self._stopping.is_set():
            self.history.sample(self.state.uptime_s(), self.state.version)
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
