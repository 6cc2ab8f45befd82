"""The values sync-mode rounds hand out (quorum.py ``QuorumManager``): a member's
``Assignment``, a ``QuorumMiss`` saying why no quorum formed, a round's ``Decision`` and
the ``CommittedRound`` the server applies; and the manager's own per-round records.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch


@dataclasses.dataclass(frozen=True)
class Assignment:
    """One member's view of a formed quorum.

    Attributes:
        quorum_id: ≥ 1, unique for the server's lifetime (rendezvous prefix ``q<id>``).
        round: committed rounds; every member starts from this round's global state.
        members: worker ids in rank order.
        rank: this worker's index in ``members``.
        heal: this worker's θ_base is from another round: pull the state, weight 0.
        deadline: clock time by which every member must have voted.
    """

    quorum_id: int
    round: int
    members: tuple[int, ...]
    rank: int
    heal: bool
    deadline: float

    @property
    def world_size(self) -> int:
        return len(self.members)


@dataclasses.dataclass(frozen=True)
class QuorumMiss:
    """Why no quorum formed for a worker by the end of its wait.

    Attributes:
        have: workers waiting for the next round when the wait ended, this one included.
        need: workers a quorum needs (``min_workers``).
        queued: this worker waits for the running group's next round boundary (its
            members still train, or a round is in flight): asking again joins that round.
            False when the quorum lacks workers, or the server is stopping.
        reason: in words, naming the knob ("quorum not reached: have 1, need 2 ...").
        pending: a long poll's hold ended and the request stays registered (poll again);
            False when the request was withdrawn.
    """

    have: int
    need: int
    queued: bool
    reason: str
    pending: bool = False


@dataclasses.dataclass(frozen=True)
class Decision:
    """The outcome of a round: ``committed`` or aborted with ``reason``; ``round`` is the
    committed-round counter after it; ``local_steps``: member id → H_w, the inner steps it
    runs before its next sync point (computed once, at the decision; empty: keep H)."""

    quorum_id: int
    committed: bool
    round: int
    reason: str = ""
    local_steps: Mapping[int, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class MemberVote:
    success: bool
    total_weight: float
    num_tokens: int
    num_local_steps: int
    reason: str
    #: Seconds of the member's own compute over ``num_local_steps`` (0: not measured).
    compute_s: float = 0.0


@dataclasses.dataclass
class RoundInFlight:
    quorum_id: int
    round: int
    members: tuple[int, ...]
    heal: frozenset[int]
    formed_at: float
    deadline: float
    votes: dict[int, MemberVote] = dataclasses.field(default_factory=dict)
    result: torch.Tensor | None = None
    decision: Decision | None = None


@dataclasses.dataclass(frozen=True)
class CommittedRound:
    """What ``on_commit`` receives: the reduced Δ̄ (float32 (N,), or None when every
    member healed and nothing is applied) and the members' votes for accounting."""

    quorum_id: int
    round: int
    result: torch.Tensor | None
    tokens_by_worker: dict[int, int]
    steps_by_worker: dict[int, int]
