"""The typed interface between the parameter server's state and its durable store.

``Journal`` is what the state writes into (store.py's ``DurableStore`` implements it):
every Join and every applied push is logged, with the state's books lock held, before it
changes anything in memory or is acknowledged. ``JournaledState`` is what the store
restores, checkpoints and journals (``ParameterServerState`` implements it), so the store
never reaches into the state's locks or fields.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import torch

from asyncdiloco.ps.records import AppliedAs, LoggedJoin
from asyncdiloco.wire._proto import parameter_server_pb2 as pb

#: (meta, tensors, result of ``while_locked``): a checkpoint's JSON part and its tensors.
StateDict = tuple[dict, dict[str, torch.Tensor], int]


class Journal(Protocol):
    """A write-ahead log of the state's changes (store.py)."""

    def log_join(self, join: LoggedJoin) -> None:
        """Log a Join (books lock held), before the worker learns its id."""

    def log_push(
        self, header: pb.PushHeader, payload: torch.Tensor, applied: AppliedAs, *, seen_unix_s: float | None = None
    ) -> None:
        """Log a push about to be applied (books lock held), with what its outer step
        depends on and when it arrived (wall clock, seconds)."""

    def maybe_checkpoint(self) -> None:
        """Checkpoint if enough pushes were logged since the last one (no lock held)."""


class JournaledState(Protocol):
    """What a durable store restores, checkpoints and journals."""

    @property
    def version(self) -> int:
        """The global version."""

    def state_dict(self, while_locked: Callable[[], int] | None = None) -> StateDict:
        """A consistent copy of the durable state (``while_locked`` runs at the moment of the copy)."""

    def load_state_dict(self, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
        """Restore a fresh state from a ``state_dict``."""

    def replay_join(self, join: LoggedJoin) -> None:
        """Redo a logged Join (a resumed one keeps the record's counters and outcomes)."""

    def replay_seen(self, worker_id: int, seen_unix_s: float) -> None:
        """A logged push shows the worker alive at ``seen_unix_s`` (wall clock)."""

    def replay_push(self, header: pb.PushHeader, payload: torch.Tensor, applied: AppliedAs) -> None:
        """Redo a logged push with the τ, s(τ) and live-worker count it was applied with."""

    def attach_journal(self, journal: Journal) -> None:
        """Log every change into ``journal`` from now on."""

    def detach_journal(self, then: Callable[[], None] | None = None) -> None:
        """Stop logging; ``then`` runs under the books lock, so no append interleaves with it."""


class JournalSlot:
    """The state's journal, if one is attached: forwards to it, does nothing without one.
    Attached and detached under the books lock (the appends run under it too).

    Args:
        wall_clock: wall-clock seconds; dates each logged push (the worker's last contact).
    """

    def __init__(self, wall_clock: Callable[[], float] = time.time) -> None:
        self.journal: Journal | None = None
        self.wall_clock = wall_clock

    def log_join(self, join: LoggedJoin) -> None:
        if self.journal is not None:  # durable before the worker learns its id
            self.journal.log_join(join)

    def log_push(self, header: pb.PushHeader, payload: torch.Tensor, applied: AppliedAs) -> None:
        if self.journal is not None:  # durable before it is applied and acknowledged
            self.journal.log_push(header, payload, applied, seen_unix_s=self.wall_clock())

    def maybe_checkpoint(self) -> None:
        journal = self.journal
        if journal is not None:
            journal.maybe_checkpoint()
