"""What the server's hot path tells its watchers: how long its slow steps took, and the
moment the global model is initialized.

One ``Observer`` per state (``CoreParts.observer``). The parts call ``timed`` around the
outer step (apply.py, rounds.py) and the durable store around each log write and
checkpoint (store.py); with no sink attached (metrics off, the default) a timing costs two
``perf_counter`` calls and nothing is kept. ``ParameterServer`` attaches the Prometheus
histograms (metrics.py) when ``--metrics-port`` is set, and the health service listens for
the initialization (server.py). It also counts the durable store's failures (a full
disk), which the metrics read at each scrape. Everything else the metrics show is read from the state
when they are scraped, not recorded here.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator

log = logging.getLogger(__name__)

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
