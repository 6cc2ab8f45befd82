"""The parameter server: state (logic), service (gRPC servicer) and server (process)."""

from asyncdiloco.ps.server import ParameterServer
from asyncdiloco.ps.state import ParameterServerState, PushOutcome, Snapshot

__all__ = ["ParameterServer", "ParameterServerState", "PushOutcome", "Snapshot"]
