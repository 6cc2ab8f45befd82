"""The core parts of the parameter server's state, bundled for the parts built on them.

``ParameterServerState`` (state.py) builds one ``CoreParts`` and hands it to the push
kinds (apply.py, rounds.py) and the durable part (durable.py): the configuration, the
clock, the two locks, the global model, the worker table, the counters, the journal and
the observer.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from asyncdiloco.ps.config import ServerConfig
from asyncdiloco.ps.counters import Counters
from asyncdiloco.ps.journal import JournalSlot
from asyncdiloco.ps.model import GlobalModel
from asyncdiloco.ps.observer import Observer
from asyncdiloco.ps.records import StateLocks
from asyncdiloco.ps.registry import WorkerRegistry


@dataclasses.dataclass(frozen=True, kw_only=True)
class CoreParts:
    """What every part built on the core may read and change (under ``locks``).

    Attributes:
        config: the server configuration.
        clock: the server's monotonic clock, seconds.
        locks: the state's two locks (records.py).
        model: θ, the outer optimizer, the version, the manifest (model.py).
        registry: the worker table, leases, DyLU (registry.py).
        counters: the status numbers (counters.py).
        journal: where Joins and pushes are logged, if anywhere (journal.py).
        observer: the hot path's timings and the initialization event (observer.py).
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
