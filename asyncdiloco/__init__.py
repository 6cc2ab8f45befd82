"""asyncdiloco: an asynchronous DiLoCo parameter server for PyTorch.

Workers train replicas with an inner optimizer for H steps and push pseudo-gradients
Δ = θ_base − θ_local to a gRPC parameter server, which applies the outer optimizer to
each as it arrives, weighted by its staleness (DiLoCo: Douillard et al. 2023,
arXiv 2311.08105; asynchronous: Liu et al. 2024, arXiv 2401.09135). ``SyncDiLoCoWorker``
runs the same job synchronously (LocalSGD / synchronous DiLoCo over a quorum-gated allreduce).

The names below are the public API. They are loaded on first use, so importing a worker
does not load the server (and the other way round); docs/architecture.md has the layers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: the module that defines them -> public names
_MODULES = {
    "asyncdiloco.algo.config": ("OuterConfig",),
    "asyncdiloco.ps.config": ("ServerConfig", "SyncConfig", "DurabilityConfig"),
    "asyncdiloco.worker.config": ("WorkerConfig", "SyncWorkerConfig"),
    "asyncdiloco.wire.security": ("ServerSecurityConfig", "ClientSecurityConfig"),
    "asyncdiloco.ps.server": ("ParameterServer",),
    "asyncdiloco.wire.tensors": ("Manifest",),
    "asyncdiloco.worker.async_worker": ("AsyncDiLoCoWorker",),
    "asyncdiloco.worker.sync_worker": ("SyncDiLoCoWorker",),
    "asyncdiloco.worker.stats": ("WorkerStats", "SyncWorkerStats"),
    "asyncdiloco.worker.global_model": ("load_global_model",),
    "asyncdiloco.errors": (
        "AsyncDiLoCoError",
        "CheckpointError",
        "ConfigError",
        "InvalidPayloadError",
        "ManifestMismatchError",
        "ModeMismatchError",
        "NotInitializedError",
        "PayloadTooLargeError",
        "RoundRefusedError",
        "ServerBusyError",
        "ServerUnavailableError",
        "StalePushError",
        "UnauthenticatedError",
        "UnknownWorkerError",
    ),
}
#: public name -> the module that defines it
_EXPORTS = {name: module for module, names in _MODULES.items() for name in names}

__all__ = [
    "AsyncDiLoCoError",
    "AsyncDiLoCoWorker",
    "CheckpointError",
    "ClientSecurityConfig",
    "ConfigError",
    "DurabilityConfig",
    "InvalidPayloadError",
    "Manifest",
    "ManifestMismatchError",
    "ModeMismatchError",
    "NotInitializedError",
    "OuterConfig",
    "ParameterServer",
    "PayloadTooLargeError",
    "RoundRefusedError",
    "ServerBusyError",
    "ServerConfig",
    "ServerSecurityConfig",
    "ServerUnavailableError",
    "StalePushError",
    "SyncConfig",
    "SyncDiLoCoWorker",
    "SyncWorkerConfig",
    "SyncWorkerStats",
    "UnauthenticatedError",
    "UnknownWorkerError",
    "WorkerConfig",
    "WorkerStats",
    "load_global_model",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'asyncdiloco' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


if TYPE_CHECKING:
    from asyncdiloco.algo.config import OuterConfig
    from asyncdiloco.errors import (
        AsyncDiLoCoError,
        CheckpointError,
        ConfigError,
        InvalidPayloadError,
        ManifestMismatchError,
        ModeMismatchError,
        NotInitializedError,
        PayloadTooLargeError,
        RoundRefusedError,
        ServerBusyError,
        ServerUnavailableError,
        StalePushError,
        UnauthenticatedError,
        UnknownWorkerError,
    )
    from asyncdiloco.ps.config import DurabilityConfig, ServerConfig, SyncConfig
    from asyncdiloco.ps.server import ParameterServer
    from asyncdiloco.wire.security import ClientSecurityConfig, ServerSecurityConfig
    from asyncdiloco.wire.tensors import Manifest
    from asyncdiloco.worker.async_worker import AsyncDiLoCoWorker
    from asyncdiloco.worker.config import SyncWorkerConfig, WorkerConfig
    from asyncdiloco.worker.global_model import load_global_model
    from asyncdiloco.worker.stats import SyncWorkerStats, WorkerStats
    from asyncdiloco.worker.sync_worker import SyncDiLoCoWorker
