"""The parameter server's Prometheus metrics, one registry per server: the gRPC conventions
(grpc_metrics.py) and the ``asyncdiloco_`` ones, read from ``status()`` at each scrape
(three durations are observed as they happen: core.py ``Observer``).
docs/operations.md, "Watching a run", lists them.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from asyncdiloco.errors import reason_codes
from asyncdiloco.ps.books import newest_eval
from asyncdiloco.ps.core import TIMED_STEPS
from asyncdiloco.ps.registry import WORKER_STATES
from asyncdiloco.ps.state import ParameterServerState
from asyncdiloco.ps.watch.grpc_metrics import GrpcMetricsInterceptor
from asyncdiloco.wire._proto import parameter_server_pb2 as pb

#: Histogram buckets, seconds: an outer step or log write (sub-ms to seconds), a checkpoint.
STEP_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
CHECKPOINT_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

_TIMINGS = {
    "outer_step": (
        "asyncdiloco_outer_step_seconds",
        "Seconds of one outer-optimizer step (a push or a round).",
        STEP_BUCKETS_S,
    ),
    "log_write": (
        "asyncdiloco_log_write_seconds",
        "Seconds of one write-ahead-log append, fsync included.",
        STEP_BUCKETS_S,
    ),
    "checkpoint": ("asyncdiloco_checkpoint_seconds", "Seconds to write one checkpoint.", CHECKPOINT_BUCKETS_S),
}
assert set(_TIMINGS) == set(TIMED_STEPS)

#: The ``reason`` labels of ``asyncdiloco_pushes_refused_total``, each exposed from the
#: start (at 0), so a rate or an alert on one exists before the first such refusal.
REFUSAL_REASONS = (*reason_codes(), "cut_off")


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def staleness_family(histogram: list[int]) -> HistogramMetricFamily:
    """``StatusReply.staleness_histogram`` (pushes per τ, the last bucket τ and above) as
    a Prometheus histogram of τ in versions; its sum counts the last bucket at its index."""
    buckets, total = [], 0
    for tau, count in enumerate(histogram[:-1]):
        total += count
        buckets.append((floatToGoString(tau), total))  # "0.0", "1.0", ... as prometheus_client writes them
    buckets.append(("+Inf", total + (histogram[-1] if histogram else 0)))
    return HistogramMetricFamily(
        "asyncdiloco_push_staleness_versions",
        "Staleness tau (versions applied since the push's base version) of the applied pushes.",
        buckets=buckets,
        sum_value=sum(tau * n for tau, n in enumerate(histogram)),
    )


class StateCollector(Collector):
    """The domain metrics, read from ``state`` at each scrape (module docstring)."""

    def __init__(self, state: ParameterServerState) -> None:
        self.state = state

    def collect(self) -> Iterator:
        state = self.state
        st = state.status()
        with state.locks.books:
            refused = dict(state.counters.refused_by_reason)
        yield from self._model(st)
        yield from self._traffic(st, refused)
        yield from self._workers(st)
        newest = newest_eval(st.evals)
        if newest is not None:
            yield _gauge(
                "asyncdiloco_eval_loss_nats",
                "Held-out loss of the newest ReportEval (of the highest version), nats per token.",
                newest.loss,
            )
            yield _gauge(
                "asyncdiloco_eval_version", "Global version of the newest ReportEval (the highest).", newest.version
            )

    def _model(self, st: pb.StatusReply) -> Iterator:
        info = InfoMetricFamily("asyncdiloco_server", "The server's version and run.")
        info.add_metric(
            [],
            {
                "version": st.server_version,
                "mode": st.run_config.mode,
                "outer_optimizer": st.outer_optimizer,
                "staleness_weighting": st.staleness_weighting,
            },
        )
        yield info
        yield _gauge("asyncdiloco_version", "Global model version (pushes applied, or rounds committed).", st.version)
        yield _gauge("asyncdiloco_initialized", "1 once the initial parameters arrived.", int(st.initialized))
        yield _gauge("asyncdiloco_uptime_seconds", "Seconds since the server started.", st.uptime_s)
        yield _counter("asyncdiloco_sync_rounds_committed", "Sync mode: rounds committed.", st.rounds_committed)
        yield _counter("asyncdiloco_sync_rounds_aborted", "Sync mode: rounds aborted.", st.rounds_failed)
        yield _counter(
            "asyncdiloco_divergence_warnings",
            "Pushes whose largest magnitude exceeded 10x the running median.",
            st.divergence_warnings,
        )

    def _traffic(self, st: pb.StatusReply, refused: dict[str, int]) -> Iterator:
        yield _counter(
            "asyncdiloco_pushes_applied", "Pseudo-gradients applied (sync: member contributions).", st.applied_pushes
        )
        by_reason = CounterMetricFamily(
            "asyncdiloco_pushes_refused",
            "Pushes refused (or cut off: reason cut_off) since this process started, by reason code.",
            labels=["reason"],
        )
        for reason in sorted({*REFUSAL_REASONS, *refused}):  # every known code from the start, at 0
            by_reason.add_metric([reason], refused.get(reason, 0))
        yield by_reason
        yield _counter(
            "asyncdiloco_pushes_duplicate", "Retried pushes answered with their outcome.", st.duplicate_pushes
        )
        errors = CounterMetricFamily(
            "asyncdiloco_durability_errors",
            "Write-ahead-log appends (the push was refused) and checkpoints that failed, e.g. on a full disk.",
            labels=["what"],
        )
        for what, count in sorted(self.state.observer.failures.items()):
            errors.add_metric([what], count)
        yield errors
        yield _counter("asyncdiloco_pulls", "Completed pulls.", st.pulls)
        yield _counter("asyncdiloco_pushed_bytes", "Payload bytes received in applied pushes.", st.bytes_pushed)
        yield _counter("asyncdiloco_pulled_bytes", "Payload bytes sent in completed pulls.", st.bytes_pulled)
        yield _counter("asyncdiloco_tokens", "Tokens in the applied pushes.", st.tokens)
        yield staleness_family(list(st.staleness_histogram))

    def _workers(self, st: pb.StatusReply) -> Iterator:
        yield _gauge("asyncdiloco_workers_live", "Workers whose lease is current.", sum(w.alive for w in st.workers))
        by_state = GaugeMetricFamily(
            "asyncdiloco_workers", "Registered workers by state (training, silent, left, expired).", labels=["state"]
        )
        for name in WORKER_STATES:
            by_state.add_metric([name], sum(w.state == name for w in st.workers))
        yield by_state


class ServerMetrics:
    """The registry of one server: the gRPC interceptor's series, the state's collector
    and the observer's histograms.

    Args:
        state: the server's state (read at each scrape; its observer is attached here).
    """

    def __init__(self, state: ParameterServerState) -> None:
        self.registry = CollectorRegistry()
        self.interceptor = GrpcMetricsInterceptor(self.registry)
        self.registry.register(StateCollector(state))
        self._timings = {
            step: Histogram(name, doc, buckets=buckets, registry=self.registry)
            for step, (name, doc, buckets) in _TIMINGS.items()
        }
        self.state = state
        state.observer.attach(self.observe)

    def observe(self, step: str, seconds: float) -> None:
        """One timed step (core.py ``TIMED_STEPS``) took ``seconds``."""
        self._timings[step].observe(seconds)

    def detach(self) -> None:
        """Stop recording the state's timings (the server stopped)."""
        self.state.observer.attach(None)

    def exposition(self) -> bytes:
        """The registry in the Prometheus text format."""
        return generate_latest(self.registry)
