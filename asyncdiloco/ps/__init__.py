"""The parameter server: the process (server.py), its two transports (service.py for
gRPC, bulk.py for the raw-TCP data channel) and the network-free state (state.py), a
façade over its parts: model.py, registry.py, intake.py, apply.py, rounds.py (with
quorum.py), modes.py, snapshots.py, counters.py, durable.py; durability on disk in
store.py, wal.py and checkpoints.py behind journal.py's typed interface; watching it in
observer.py, metrics.py, grpc_metrics.py, monitor.py and dashboard.py."""

from asyncdiloco.ps.server import ParameterServer
from asyncdiloco.ps.state import ParameterServerState, PushOutcome, Snapshot

__all__ = ["ParameterServer", "ParameterServerState", "PushOutcome", "Snapshot"]
