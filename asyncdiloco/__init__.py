"""asyncdiloco: an asynchronous DiLoCo parameter server for PyTorch.

Workers train replicas with an inner optimizer for H steps and push pseudo-gradients
Δ = θ_base − θ_local to a gRPC parameter server, which applies the outer optimizer to
each as it arrives, weighted by its staleness (DiLoCo: Douillard et al. 2023,
arXiv 2311.08105; asynchronous: Liu et al. 2024, arXiv 2401.09135).
"""

from asyncdiloco.config import OuterConfig, ServerConfig, WorkerConfig
from asyncdiloco.errors import (
    AsyncDiLoCoError,
    ConfigError,
    InvalidPayloadError,
    ManifestMismatchError,
    NotInitializedError,
    PayloadTooLargeError,
    ServerUnavailableError,
    StalePushError,
    UnknownWorkerError,
)
from asyncdiloco.ps import ParameterServer
from asyncdiloco.tensors import Manifest
from asyncdiloco.worker import AsyncDiLoCoWorker, WorkerStats

__version__ = "0.1.0"

__all__ = [
    "AsyncDiLoCoError",
    "AsyncDiLoCoWorker",
    "ConfigError",
    "InvalidPayloadError",
    "Manifest",
    "ManifestMismatchError",
    "NotInitializedError",
    "OuterConfig",
    "ParameterServer",
    "PayloadTooLargeError",
    "ServerConfig",
    "ServerUnavailableError",
    "StalePushError",
    "UnknownWorkerError",
    "WorkerConfig",
    "WorkerStats",
]
