"""What every room of the server shares: ``CoreParts`` (config, clock, locks, model,
worker table, counters, journal, observer), the status counters (``Counters``, part of
every checkpoint) and the observer of the hot path's timings (``Observer``, read by
watch/metrics.py). docs/architecture.md, "The server's rooms".
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from asyncdiloco.errors import InvalidPayloadError, ModeMismatchError
from asyncdiloco.ps.books import JournalSlot, StateLocks
from asyncdiloco.ps.config import ServerConfig
from asyncdiloco.ps.model import GlobalModel
from asyncdiloco.ps.registry import WorkerRegistry
from asyncdiloco.wire._proto import parameter_server_pb2 as pb

log = logging.getLogger(__name__)


def mode_mismatch(mode: str, what: str) -> ModeMismatchError:
    """The refusal of a request of the other mode on a ``mode`` ("async"/"sync") server;
    ``what`` names the request."""
    other = "sync" if mode == "async" else "async"
    return ModeMismatchError(
        f"mode mismatch: {what} is a {other}-mode request but this server runs --mode {mode}; "
        f"start the worker with --mode {mode}, or the server with --mode {other}"
    )


#: The counters of a checkpoint's ``meta["counters"]``, in the order they are written.
COUNTER_NAMES = (
    "applied_pushes",
    "rejected_pushes",
    "duplicate_pushes",
    "bytes_pushed",
    "bytes_pulled",
    "pulls",
    "tokens",
)

#: Seconds the applied-push rate is taken over (StatusReply.pushes_per_s).
RATE_WINDOW_S = 60
#: Evaluator reports kept (StatusReply.evals), the newest.
MAX_EVALS = 256
#: Longest ``EvalReport.evaluator`` name taken, characters.
MAX_EVALUATOR_CHARS = 200
#: Largest held-out loss taken, nats per token. A mean cross-entropy is >= 0, and a
#: uniform guess over a vocabulary of V tokens costs ln V (13.8 nats for V = 10^6), so
#: 10^4 is far above any real model's loss: a larger number is a sum over tokens rather
#: than their mean, or another unit, and would flatten the dashboard's curve.
MAX_EVAL_LOSS = 1e4


def newest_eval(evals: Sequence[pb.EvalPoint]) -> pb.EvalPoint | None:
    """The report of the highest version among ``evals`` (oldest received first, as
    ``StatusReply.evals``); of equal versions the one received last. None when empty.
    A slow evaluator's late report of an older version does not replace a newer one."""
    best = None
    for point in evals:
        if best is None or point.version >= best.version:
            best = point
    return best


def _check_eval(point: pb.EvalPoint, current: int) -> None:
    if not math.isfinite(point.loss):
        raise InvalidPayloadError(
            f"eval loss is {point.loss}; it must be finite: evaluate a model that has not diverged"
        )
    if not 0.0 <= point.loss <= MAX_EVAL_LOSS:
        raise InvalidPayloadError(
            f"eval loss is {point.loss:g} nats per token; it must be in [0, {MAX_EVAL_LOSS:g}] (a cross-entropy "
            f"is >= 0, and a uniform guess over 10^6 tokens is 13.8 nats): report the mean loss per token"
        )
    if point.num_tokens < 1:
        raise InvalidPayloadError(
            f"eval num_tokens is {point.num_tokens}; it must be >= 1, the tokens the loss is over"
        )
    if not 0 <= point.version <= current:
        raise InvalidPayloadError(
            f"eval version is {point.version}; it must be in [0, {current}] (the server's current version): "
            f"report the version you pulled"
        )
    if len(point.evaluator) > MAX_EVALUATOR_CHARS:
        raise InvalidPayloadError(
            f"evaluator name has {len(point.evaluator)} characters; the limit is {MAX_EVALUATOR_CHARS}: "
            f"use a shorter name"
        )


@dataclasses.dataclass
class Counters:
    """Server-wide totals since the run began (restored from checkpoints).

    Args:
        histogram_buckets: buckets of ``staleness_histogram`` (>= 2); the last counts
            every larger τ.
        clock: the server's monotonic clock, seconds (the push rate's window).
    """

    histogram_buckets: int
    clock: Callable[[], float] = time.monotonic
    applied_pushes: int = 0
    rejected_pushes: int = 0
    duplicate_pushes: int = 0
    bytes_pushed: int = 0
    bytes_pulled: int = 0
    pulls: int = 0
    tokens: int = 0
    #: Applied pseudo-gradients per staleness τ (sync rounds count at τ = 0).
    staleness_histogram: list[int] = dataclasses.field(init=False)
    #: Refused or cut-off pushes of this process by reason code (errors.py; "cut_off": the
    #: stream broke mid-payload). Not checkpointed: a restart starts them at 0.
    refused_by_reason: dict[str, int] = dataclasses.field(init=False, default_factory=dict)
    #: The newest evaluator reports, oldest first (at most ``MAX_EVALS``).
    evals: collections.deque[pb.EvalPoint] = dataclasses.field(init=False)
    #: Applied pushes per second of the clock, [second, count], the last ``RATE_WINDOW_S``.
    _per_second: collections.deque[list[int]] = dataclasses.field(init=False)
    _started: float = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.staleness_histogram = [0] * self.histogram_buckets
        self.evals = collections.deque(maxlen=MAX_EVALS)
        self._per_second = collections.deque()
        self._started = self.clock()

    def count_applied(self, tau: int, num_tokens: int) -> None:
        """One pseudo-gradient (or one member's share of a round) of staleness ``tau`` was applied."""
        self.applied_pushes += 1
        self.tokens += num_tokens
        self.staleness_histogram[min(tau, len(self.staleness_histogram) - 1)] += 1
        second = int(self.clock())
        if self._per_second and self._per_second[-1][0] == second:
            self._per_second[-1][1] += 1
        else:
            self._per_second.append([second, 1])
            self._forget_before(second - RATE_WINDOW_S)

    def _forget_before(self, second: int) -> None:
        while self._per_second and self._per_second[0][0] < second:
            self._per_second.popleft()

    def restart_rate(self) -> None:
        """Start the push rate afresh now (the pushes replayed from the log at start-up
        were not applied in the last minute)."""
        self._per_second.clear()
        self._started = self.clock()

    def pushes_per_s(self) -> float:
        """Applied pushes per second over the last ``RATE_WINDOW_S`` seconds (1 s
        resolution), or since this process started when it is younger; 0 at start."""
        now = self.clock()
        self._forget_before(int(now) - RATE_WINDOW_S)
        elapsed = min(float(RATE_WINDOW_S), now - self._started)
        return sum(n for _, n in self._per_second) / elapsed if elapsed > 0 else 0.0

    def note_refusal(self, reason: str) -> None:
        """A push counted in ``rejected_pushes`` was refused with ``reason`` (or cut off: "cut_off")."""
        self.refused_by_reason[reason] = self.refused_by_reason.get(reason, 0) + 1

    def record_eval(self, point: pb.EvalPoint, version: int) -> None:
        """Keep an evaluator's report (the oldest goes beyond ``MAX_EVALS``); ``version``:
        the server's current one.

        Raises:
            InvalidPayloadError: a loss that is not finite or outside [0, ``MAX_EVAL_LOSS``],
                num_tokens < 1, a version outside [0, version], or a name over
                ``MAX_EVALUATOR_CHARS``; nothing is kept.
        """
        _check_eval(point, version)
        self.evals.append(point)

    def staleness_sum(self) -> int:
        """Σ τ over the applied pushes, from the histogram: the last bucket's pushes count
        at its index, so it is exact while no τ exceeded ``histogram_buckets`` − 2."""
        return sum(tau * n for tau, n in enumerate(self.staleness_histogram))

    def count_pull(self, num_bytes: int) -> None:
        """A pull of ``num_bytes`` payload bytes completed."""
        self.pulls += 1
        self.bytes_pulled += num_bytes

    def to_meta(self) -> dict[str, int]:
        """The counters for a checkpoint (``meta["counters"]``)."""
        return {name: getattr(self, name) for name in COUNTER_NAMES}

    def load_meta(self, counters: dict[str, int], histogram: list[int]) -> None:
        """Restore from a checkpoint; a histogram of another length is cut or zero-padded."""
        for name in COUNTER_NAMES:
            if name in counters:
                setattr(self, name, counters[name])
        n = len(self.staleness_histogram)
        self.staleness_histogram = (list(histogram) + [0] * n)[:n]


#: The timed steps: the outer optimizer's step on one push or round; one write-ahead-log
#: append (write and fsync); one checkpoint (both files written, the folder pruned).
TIMED_STEPS = ("outer_step", "log_write", "checkpoint")
#: The durable store's steps whose failures are counted (``Observer.failed``): a log
#: append (the change it carried was refused) and a checkpoint (the log keeps everything).
DURABILITY_STEPS = ("log_write", "checkpoint")


class Observer:
    """Timings of the hot path's slow steps, seconds, and the initialization event."""

    def __init__(self) -> None:
        #: Durability failures by what failed (one of ``DURABILITY_STEPS``), since start.
        self.failures: dict[str, int] = dict.fromkeys(DURABILITY_STEPS, 0)
        self._sink: Callable[[str, float], None] | None = None
        self._on_initialized: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    def attach(self, sink: Callable[[str, float], None] | None) -> None:
        """Send every timing to ``sink(step, seconds)`` from now on (None: keep none)."""
        self._sink = sink

    def observe(self, step: str, seconds: float) -> None:
        """One ``step`` (one of ``TIMED_STEPS``) took ``seconds``."""
        sink = self._sink
        if sink is not None:
            sink(step, seconds)

    def failed(self, step: str) -> None:
        """One ``step`` of the durable store (``DURABILITY_STEPS``) failed (store.py)."""
        with self._lock:
            self.failures[step] = self.failures.get(step, 0) + 1

    @contextlib.contextmanager
    def timed(self, step: str) -> Iterator[None]:
        """Time the block as one ``step`` (also when it raises)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.observe(step, time.perf_counter() - started)

    def when_initialized(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` each time the global model becomes initialized (the initial
        parameters were applied); the caller checks the state for an earlier one."""
        with self._lock:
            self._on_initialized.append(callback)

    def initialized(self) -> None:
        """The global model was just initialized (apply.py, no state lock held)."""
        with self._lock:
            callbacks = list(self._on_initialized)
        for callback in callbacks:
            try:
                callback()
            except Exception:  # a watcher's bug must not fail the push that initialized
                log.exception("a listener of the model's initialization failed")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CoreParts:
    """What every part built on the core may read and change (under ``locks``).

    Attributes:
        config: the server configuration.
        clock: the server's monotonic clock, seconds.
        locks: the state's two locks (books.py).
        model: θ, the outer optimizer, the version, the manifest (model.py).
        registry: the worker table, leases, DyLU (registry.py).
        counters: the status numbers (core.py).
        journal: where Joins and pushes are logged, if anywhere (books.py).
        observer: the hot path's timings and the initialization event (core.py).
    """

    config: ServerConfig
    clock: Callable[[], float]
    locks: StateLocks
    model: GlobalModel
    registry: WorkerRegistry
    counters: Counters
    journal: JournalSlot
    observer: Observer = dataclasses.field(default_factory=Observer)

    @classmethod
    def build(
        cls,
        config: ServerConfig,
        clock: Callable[[], float],
        grouping: str,
        wall_clock: Callable[[], float] = time.time,
    ) -> CoreParts:
        """Fresh parts for a new state; ``grouping``: the grouping mode in effect;
        ``wall_clock``: wall-clock seconds (workers' last contacts outlive a restart)."""
        model, journal = GlobalModel(config), JournalSlot(wall_clock)
        return cls(
            config=config,
            clock=clock,
            locks=StateLocks(),
            model=model,
            registry=WorkerRegistry(config, clock, grouping, model, journal, wall_clock),
            counters=Counters(config.histogram_buckets, clock),
            journal=journal,
        )
