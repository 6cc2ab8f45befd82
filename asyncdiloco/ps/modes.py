"""The two ways the server runs, as objects: what a mode accepts and how it answers.

A ``Mode`` says which push kinds it takes (``PushHandler`` objects: async mode takes the
initial parameters and pseudo-gradients, apply.py; sync mode the initial parameters and
round results, rounds.py), how it refuses a request of the other mode, what a
sync-state pull and the quorum calls do, and what happens when a worker leaves. The
state (state.py) holds one mode and asks it, instead of testing the mode at every turn.

``AsyncMode`` is here; ``SyncMode`` (quorum rounds) is in rounds.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

import torch

from asyncdiloco.errors import ModeMismatchError
from asyncdiloco.ps.long_poll import NO_WATCH, CallWatch
from asyncdiloco.ps.quorum import Assignment, Decision, QuorumManager, QuorumMiss
from asyncdiloco.ps.records import PushOutcome, Vote
from asyncdiloco.wire._proto import parameter_server_pb2 as pb

#: Every push kind a header may name (the others are refused as invalid).
KNOWN_KINDS = (pb.PUSH_KIND_PSEUDO_GRADIENT, pb.PUSH_KIND_INITIAL_PARAMETERS, pb.PUSH_KIND_ROUND_RESULT)


def describe_push(header: pb.PushHeader) -> str:
    """Names a push in a refusal: "the pseudo-gradient push 3 of worker 1", "the round result of quorum 2"."""
    if header.kind == pb.PUSH_KIND_ROUND_RESULT:
        return f"the round result of quorum {header.quorum_id}"
    return f"the pseudo-gradient push {header.push_id} of worker {header.worker_id}"


class PushHandler(Protocol):
    """What one push kind (``pb.PUSH_KIND_*``) checks and does: its handler."""

    #: The payload is received into the receive pool (else into a buffer of its own).
    pooled: bool

    def check(self, header: pb.PushHeader) -> None:
        """The kind's own header checks (books lock held); raises the refusal."""

    def payload_bytes(self) -> tuple[int, str]:
        """(bytes, how they are laid out) the payload must have (books lock held)."""

    def apply(self, header: pb.PushHeader, payload: torch.Tensor, largest: float | None = None) -> PushOutcome:
        """Apply (or stage) a complete, CRC-checked payload (uint8 (total_bytes,));
        ``largest``: its ‖x‖∞ when it was scanned as it landed (values.py), else None."""


class Mode(Protocol):
    """What differs between async and sync mode (see the module docstring)."""

    @property
    def name(self) -> str:
        """ "async" or "sync" (``ServerConfig.mode``)."""

    @property
    def kinds(self) -> Mapping[int, PushHandler]:
        """The handler of each push kind this mode takes, by ``pb.PUSH_KIND_*``."""

    @property
    def quorum(self) -> QuorumManager | None:
        """Sync mode's rounds (None in async mode)."""

    def mismatch(self, what: str) -> ModeMismatchError:
        """The refusal of a request of the other mode; ``what`` names the request."""

    def sync_state(self) -> tuple[int, torch.Tensor]:
        """(round, θ and m as float32 bytes) for a sync-state pull."""

    def pull_round(self, version: int) -> int:
        """``PullHeader.round`` of a pull of ``version``."""

    def on_leave(self, worker_id: int) -> None:
        """A worker left (called without the state's locks)."""

    def request_quorum(
        self,
        worker_id: int,
        worker_round: int,
        manifest_hash: str,
        timeout_s: float,
        poll: bool = False,
        call: CallWatch = NO_WATCH,
    ) -> Assignment | QuorumMiss:
        """Block up to ``timeout_s`` seconds for the next round's quorum (``poll``: a
        long poll's short hold, long_poll.py)."""

    def commit(self, vote: Vote, timeout_s: float, poll: bool = False, call: CallWatch = NO_WATCH) -> Decision | None:
        """Vote on a round, then block up to ``timeout_s`` seconds for its decision
        (``poll``: a long poll's short hold)."""


class AsyncMode:
    """Async mode (Liu et al. 2024, arXiv 2401.09135): every pseudo-gradient is applied on
    arrival; no rounds, so the quorum calls and sync-state pulls are refused.

    Args:
        kinds: the push kinds taken (initial parameters and pseudo-gradients, apply.py).
        touch: renews a worker's lease (``UnknownWorkerError`` first, as in sync mode).
    """

    name = "async"

    def __init__(self, kinds: Mapping[int, PushHandler], touch: Callable[[int], None]) -> None:
        self.kinds = kinds
        self.quorum: QuorumManager | None = None
        self._touch = touch

    def mismatch(self, what: str) -> ModeMismatchError:
        return ModeMismatchError(
            f"mode mismatch: {what} is a sync-mode request but this server runs --mode async; "
            f"start the worker with --mode async, or the server with --mode sync"
        )

    def sync_state(self) -> tuple[int, torch.Tensor]:
        raise self.mismatch("a sync-state pull")

    def pull_round(self, version: int) -> int:
        return 0

    def on_leave(self, worker_id: int) -> None:
        pass

    def request_quorum(
        self,
        worker_id: int,
        worker_round: int,
        manifest_hash: str,
        timeout_s: float,
        poll: bool = False,
        call: CallWatch = NO_WATCH,
    ) -> Assignment | QuorumMiss:
        self._touch(worker_id)
        raise self.mismatch(f"the quorum request of worker {worker_id}")

    def commit(self, vote: Vote, timeout_s: float, poll: bool = False, call: CallWatch = NO_WATCH) -> Decision | None:
        self._touch(vote.worker_id)
        raise self.mismatch(f"the commit vote of worker {vote.worker_id}")
