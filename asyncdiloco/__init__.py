"""asyncdiloco: an asynchronous DiLoCo parameter server for PyTorch.

Workers train replicas with an inner optimizer for H steps and push pseudo-gradients
Δ = θ_base − θ_local to a gRPC parameter server, which applies the outer optimizer to
each as it arrives, weighted by its staleness (DiLoCo: Douillard et al. 2023,
arXiv 2311.08105; asynchronous: Liu et al. 2024, arXiv 2401.09135). ``SyncDiLoCoWorker``
runs the same job synchronously (LocalSGD / synchronous DiLoCo over a quorum-gated allreduce).
"""

from asyncdiloco.config import OuterConfig, ServerConfig, SyncConfig, SyncWorkerConfig, WorkerConfig
from asyncdiloco.errors import (
    AsyncDiLoCoError,
    ConfigError,
    InvalidPayloadError,
    ManifestMismatchError,
    ModeMismatchError,
    NotInitializedError,
    PayloadTooLargeError,
    RoundRefusedError,
    ServerUnavailableError,
    StalePushError,
    UnknownWorkerError,
)
from asyncdiloco.ps import ParameterServer
from asyncdiloco.tensors import Manifest
from asyncdiloco.sync_worker import SyncDiLoCoWorker, SyncWorkerStats
from asyncdiloco.worker import AsyncDiLoCoWorker, WorkerStats

__version__ = "0.1.0"

__all__ = [
    "AsyncDiLoCoError",
    "AsyncDiLoCoWorker",
    "ConfigError",
    "InvalidPayloadError",
    "Manifest",
    "ManifestMismatchError",
    "ModeMismatchError",
    "NotInitializedError",
    "OuterConfig",
    "ParameterServer",
    "PayloadTooLargeError",
    "RoundRefusedError",
    "ServerConfig",
    "ServerUnavailableError",
    "StalePushError",
    "SyncConfig",
    "SyncDiLoCoWorker",
    "SyncWorkerConfig",
    "SyncWorkerStats",
    "UnknownWorkerError",
    "WorkerConfig",
    "WorkerStats",
]
