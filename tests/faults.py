"""Fault injection for the sync-mode tests (the library itself has none).

``FaultySyncWorker`` is a ``SyncDiLoCoWorker`` whose collective fails once, the way a
real member fails: in this worker's first allreduce for round ``FailAt.round`` (1-based)
or a later one, in a quorum of at least ``FailAt.min_world_size`` members, it

- ``Fault.KILL``: SIGKILLs its own process with the allreduce in flight (the peers see
  the connection close; only for a worker in its own process);
- ``Fault.HANG``: stops responding before the allreduce (the peers time out after
  ``allreduce_timeout_s``; the heartbeat thread keeps the lease, as a hung process does);
- ``Fault.RAISE``: fails the collective here (this member votes failure).

It hooks the worker's collective seam (``SyncDiLoCoWorker._allreduce``), so everything
else it does is the real worker's.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import signal
import threading

from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.worker.sync_worker import SyncDiLoCoWorker

log = logging.getLogger(__name__)


class Fault(enum.Enum):
    KILL = "kill"
    HANG = "hang"
    RAISE = "raise"


@dataclasses.dataclass
class FailAt:
    """When and how a ``FaultySyncWorker`` fails (once)."""

    fault: Fault
    #: The first round (1-based: the round the quorum's allreduce would commit) to fail in.
    round: int
    #: Only in a quorum of at least this many members.
    min_world_size: int = 1
    fired: bool = False

    def take(self, q: pb.QuorumReply) -> bool:
        """True, once, for the first quorum that matches."""
        due = not self.fired and q.round + 1 >= self.round and q.world_size >= self.min_world_size
        self.fired |= due
        return due


class FaultySyncWorker(SyncDiLoCoWorker):
    """A sync worker whose allreduce fails as ``fail_at`` says (module docstring)."""

    def __init__(self, *args, fail_at: FailAt, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fail_at = fail_at

    def _allreduce(self, q: pb.QuorumReply) -> None:
        if not self.fail_at.take(q):
            super()._allreduce(q)
            return
        round_ = q.round + 1
        if self.fail_at.fault is Fault.RAISE:
            raise RuntimeError(f"injected fault in round {round_}")
        if self.fail_at.fault is Fault.HANG:
            log.warning("fault injection: hanging in round %d", round_)
            threading.Event().wait()  # never returns
        in_flight = self._start_allreduce(q)
        log.warning("fault injection: SIGKILL with the allreduce of round %d in flight", round_)
        os.kill(os.getpid(), signal.SIGKILL)
        in_flight.wait()  # pragma: no cover - the process is gone


def faulty_sync_worker_class(fail_at: FailAt) -> type[SyncDiLoCoWorker]:
    """A ``SyncDiLoCoWorker`` class that takes the usual arguments and fails as ``fail_at``
    says: for code that builds the worker itself (``asyncdiloco.cli.train.run_worker``)."""

    class Faulty(FaultySyncWorker):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, fail_at=fail_at, **kwargs)

    return Faulty
