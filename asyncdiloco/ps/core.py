"""What every room of the server shares: ``CoreParts`` (config, clock, locks, model,
worker table, counters, journal, observer), the observer of the hot path's timings
(``Observer``, read by watch/metrics.py) and the refusal of a request of the other mode.
docs/architecture.md, "The server's rooms".
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator

from asyncdiloco.errors import ModeMismatchError
from asyncdiloco.ps.books import Counters, JournalSlot, StateLocks
from asyncdiloco.ps.config import ServerConfig
from asyncdiloco.ps.model import GlobalModel
from asyncdiloco.ps.registry import WorkerRegistry

log = logging.getLogger(__name__)


def mode_mismatch(mode: str, what: str) -> ModeMismatchError:
    """The refusal of a request of the other mode on a ``mode`` ("async"/"sync") server;
    ``what`` names the request."""
    other = "sync" if mode == "async" else "async"
    return ModeMismatchError(
        f"mode mismatch: {what} is a {other}-mode request but this server runs --mode {mode}; "
        f"start the worker with --mode {mode}, or the server with --mode {other}"
    )


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
    """What every part built on the core may read and change (under ``locks``); ``clock``:
    the server's monotonic clock, seconds; ``observer``: the hot path's timings."""

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
