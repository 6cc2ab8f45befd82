"""The parameter server (docs/architecture.md, "The server's rooms"): the process
(server.py), the network-free state (state.py) and its rooms (push/, pull/, sync/,
durable/, tier/, watch/, transport/).

The names below load on first use: a worker importing ``asyncdiloco.ps.config`` (the
flag tables do) does not load the server (docs/performance.md, "Sync mode end to end")."""

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
