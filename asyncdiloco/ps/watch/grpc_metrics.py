"""Prometheus metrics of every RPC the gRPC server handles, named as the go-grpc-prometheus
/ py-grpc-prometheus exporters name them (so their dashboards work unchanged); a stream is
measured until it ends. A callback handler (health Watch) is left unmeasured, holding no
thread. The series: docs/operations.md, "Watching a run".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram

#: Buckets of ``grpc_server_handling_seconds``: 1 ms up to 10 min (pushes may be held
#: for their group, a Watch lasts as long as its client).
HANDLING_BUCKETS_S = (0.001, 0.005, 0.025, 0.1, 0.25, 1.0, 2.5, 10.0, 30.0, 60.0, 300.0, 600.0)


def _rpc_type(handler: grpc.RpcMethodHandler) -> str:
    if handler.request_streaming and handler.response_streaming:
        return "BIDI_STREAM"
    if handler.request_streaming:
        return "CLIENT_STREAM"
    return "SERVER_STREAM" if handler.response_streaming else "UNARY"


def _ended_code(context: grpc.ServicerContext) -> grpc.StatusCode:
    """The status a handler that raised ended its call with."""
    code = context.code()
    if code is not None:
        return code  # it aborted (or set a code)
    return grpc.StatusCode.UNKNOWN if context.is_active() else grpc.StatusCode.CANCELLED


class GrpcMetricsInterceptor(grpc.ServerInterceptor):
    """Counts and times every call (see the module docstring); put it first in the
    server's interceptors so that calls the token check refuses are counted too.

    Args:
        registry: the server's own registry (two servers in one process do not collide).
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ("grpc_type", "grpc_service", "grpc_method")
        self.started = Counter("grpc_server_started_total", "RPCs started on the server.", labels, registry=registry)
        self.handled = Counter(
            "grpc_server_handled_total",
            "RPCs completed on the server, by status code.",
            (*labels, "grpc_code"),
            registry=registry,
        )
        self.seconds = Histogram(
            "grpc_server_handling_seconds",
            "Seconds from the start of an RPC to its end (its stream's end for streams).",
            labels,
            buckets=HANDLING_BUCKETS_S,
            registry=registry,
        )
        self.received = Counter(
            "grpc_server_msg_received_total", "Stream messages received by the server.", labels, registry=registry
        )
        self.sent = Counter(
            "grpc_server_msg_sent_total", "Stream messages sent by the server.", labels, registry=registry
        )

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        service, _, method = handler_call_details.method.lstrip("/").rpartition("/")
        labels = (_rpc_type(handler), service, method)
        behavior = handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
        if getattr(behavior, "experimental_non_blocking", False):
            return handler  # answers through a callback, holding no thread (health Watch): not measured
        if handler.unary_unary:
            return handler._replace(unary_unary=self._unary(handler.unary_unary, labels))
        if handler.unary_stream:
            return handler._replace(unary_stream=self._response_stream(handler.unary_stream, labels))
        if handler.stream_unary:
            return handler._replace(stream_unary=self._unary(handler.stream_unary, labels, streamed_in=True))
        return handler._replace(stream_stream=self._response_stream(handler.stream_stream, labels, streamed_in=True))

    def _end(self, labels: tuple[str, str, str], code: grpc.StatusCode, started: float) -> None:
        self.handled.labels(*labels, code.name).inc()
        self.seconds.labels(*labels).observe(time.perf_counter() - started)

    def _counted(self, requests: Iterator[Any], labels: tuple[str, str, str]) -> Iterator[Any]:
        received = self.received.labels(*labels)
        for message in requests:
            received.inc()
            yield message

    def _unary(self, behavior: Callable, labels: tuple[str, str, str], streamed_in: bool = False) -> Callable:
        """A handler with one reply (UNARY, CLIENT_STREAM)."""

        def measured(request, context):
            self.started.labels(*labels).inc()
            started = time.perf_counter()
            try:
                reply = behavior(self._counted(request, labels) if streamed_in else request, context)
            except BaseException:
                self._end(labels, _ended_code(context), started)
                raise
            self._end(labels, context.code() or grpc.StatusCode.OK, started)
            return reply

        return measured

    def _response_stream(self, behavior: Callable, labels: tuple[str, str, str], streamed_in: bool = False) -> Callable:
        """A handler whose replies stream (SERVER_STREAM, BIDI_STREAM): measured until the stream ends."""

        def measured(request, context):
            self.started.labels(*labels).inc()
            started = time.perf_counter()
            sent = self.sent.labels(*labels)
            code = grpc.StatusCode.OK
            try:
                for reply in behavior(self._counted(request, labels) if streamed_in else request, context):
                    sent.inc()
                    yield reply
                code = context.code() or grpc.StatusCode.OK
            except GeneratorExit:  # gRPC closed the stream: the client went away
                code = grpc.StatusCode.CANCELLED
                raise
            except BaseException:
                code = _ended_code(context)
                raise
            finally:
                self._end(labels, code, started)

        return measured
