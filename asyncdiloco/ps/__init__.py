"""The parameter server: the process (server.py), its two transports (service.py for
gRPC, bulk.py for the raw-TCP data channel) and the network-free state (state.py), a
façade over its parts: model.py, registry.py, intake.py, apply.py, rounds.py (with
quorum.py), modes.py, snapshots.py, counters.py, durable.py; durability on disk in
store.py, wal.py and checkpoints.py behind journal.py's typed interface; watching it in
observer.py, metrics.py, grpc_metrics.py, monitor.py and dashboard.py.

The names below load on first use: a worker importing ``asyncdiloco.ps.config`` (the
flag tables do) does not load the server (0.4-0.7 s of imports on a loaded 2-core
machine; docs/performance.md, "Sync mode end to end")."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["ParameterServer", "ParameterServerState", "PushOutcome", "Snapshot"]

_WHERE = {
    "ParameterServer": "asyncdiloco.ps.server",
    "ParameterServerState": "asyncdiloco.ps.state",
    "PushOutcome": "asyncdiloco.ps.state",
    "Snapshot": "asyncdiloco.ps.pull.encoded",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'asyncdiloco.ps' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from asyncdiloco.ps.pull.encoded import Snapshot
    from asyncdiloco.ps.server import ParameterServer
    from asyncdiloco.ps.state import ParameterServerState, PushOutcome
