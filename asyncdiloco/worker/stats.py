"""The counters a worker keeps (``WorkerStats``, ``SyncWorkerStats``), units in the names;
the CLI writes them with ``--stats-file`` (docs/operations.md, "When a sync fails").
"""

from __future__ import annotations

import dataclasses
from typing import Protocol


class WorkerCounters(Protocol):
    """The counters every worker's ``stats`` has (units in the names)."""

    inner_steps: int
    tokens: int
    sync_failures: int
    corrupted_transfers: int
    comm_s: float
    blocked_s: float


@dataclasses.dataclass
class WorkerStats:
    """Counters of one worker (units in the names)."""

    inner_steps: int = 0
    tokens: int = 0
    pushes_applied: int = 0
    #: Pushes the server refused (stale, invalid, too large) or answered as never applied.
    pushes_refused: int = 0
    #: Pseudo-gradients dropped instead of applied, and the inner steps and tokens whose
    #: progress went with them (the worker restarted from the global model): refused by
    #: the server, not finite here, or of a registration the server did not resume.
    pseudo_gradients_dropped: int = 0
    steps_dropped: int = 0
    tokens_dropped: int = 0
    #: Why, per drop: reason code -> pseudo-gradients dropped for it. A refusal's reason
    #: (errors.py: ``stale_push``, ``unknown_version``, ``invalid_payload``,
    #: ``payload_too_large``), or ``non_finite`` (Δ not finite, found before sending),
    #: ``not_applied`` (a retry answered as a duplicate that was never applied),
    #: ``not_resumed`` (a rejoin the server did not resume: an unacknowledged push's
    #: outcome is unknown).
    drops: dict[str, int] = dataclasses.field(default_factory=dict)
    #: Parameters whose inner-optimizer state held NaN/Inf after a non-finite Δ and was
    #: cleared (drops.py ``reset_diverged_state``).
    optimizer_states_cleared: int = 0
    sync_failures: int = 0
    #: Pushes and pulls whose payload arrived corrupted and were sent again (client.py).
    corrupted_transfers: int = 0
    pulls: int = 0
    bytes_pushed: int = 0
    bytes_pulled: int = 0
    #: Seconds of communication (push, pull, join): the whole sync without overlap; with
    #: overlap mostly the background thread's time, so it may exceed ``blocked_s``.
    comm_s: float = 0.0
    #: Seconds the training thread spent in sync points and merges instead of training:
    #: the whole sync without overlap; with overlap the snapshot, Δ, packing, waits for a
    #: sync still in flight, the merge and rejoins.
    blocked_s: float = 0.0
    #: Seconds the server held this worker's push replies while their groups formed
    #: (``PushReply.held_s``; part of ``comm_s``).
    held_s: float = 0.0
    #: Seconds from the end of ``join`` to the end of ``close`` (0 before close).
    wall_s: float = 0.0
    #: Seconds in the inner steps that were timed, and how many (algo/rates.py: first
    #: forward pass to the end of the optimizer step; the first step is not timed); at
    #: close, v_w, the rate this worker reported last (inner steps per second of compute;
    #: 0: none timed), and H_w, the steps per round the server told it last.
    compute_s: float = 0.0
    timed_steps: int = 0
    steps_per_s: float = 0.0
    local_steps_per_round: int = 0
    #: What became of the push ``close`` sent: "applied", "refused", "dropped" (Δ was not
    #: finite: nothing sent), "not acknowledged" (the server could not be reached in time;
    #: kept in ``state_dir`` for a restart) or "" (nothing to push).
    final_push: str = ""
    #: τ of every applied push, in order.
    staleness: list[int] = dataclasses.field(default_factory=list, repr=False)

    @property
    def mean_staleness(self) -> float:
        return sum(self.staleness) / len(self.staleness) if self.staleness else 0.0

    def count_applied(self, held_s: float, staleness: int) -> None:
        """One push applied: its reply was held ``held_s`` seconds, its staleness τ."""
        self.pushes_applied += 1
        self.held_s += held_s
        self.staleness.append(staleness)

    def count_drop(self, reason: str, steps: int, tokens: int) -> None:
        """One pseudo-gradient dropped for ``reason``, with its inner steps and tokens."""
        self.pseudo_gradients_dropped += 1
        self.steps_dropped += steps
        self.tokens_dropped += tokens
        self.drops[reason] = self.drops.get(reason, 0) + 1


@dataclasses.dataclass
class SyncWorkerStats:
    """Counters of one sync worker (units in the names).

    ``idle_s`` is the time spent waiting for the quorum, in the collective, uploading
    and waiting for the commit decision (what a faster worker loses to a slower one).
    ``rounds`` has one entry per quorum taken part in: ``round`` (committed rounds
    after it), ``committed``, ``heal``, ``world_size``, ``local_steps`` (the inner steps
    this member trained for it) and ``next_local_steps`` (its H_w after the decision), the
    time parts in seconds and ``checksum`` (CRC-32 of θ_base's float32 bytes after it).
    """

    inner_steps: int = 0
    tokens: int = 0
    rounds_committed: int = 0
    rounds_failed: int = 0
    rounds_skipped: int = 0
    heals: int = 0
    #: Rounds this member's own Δ was not finite in (a diverged replica: every member
    #: skipped the round), and the inner steps aborted rounds dropped here.
    non_finite_rounds: int = 0
    steps_dropped: int = 0
    sync_failures: int = 0
    #: Pulls and round results whose payload arrived corrupted and were sent again (client.py).
    corrupted_transfers: int = 0
    bytes_pushed: int = 0
    bytes_pulled: int = 0
    bytes_allreduced: int = 0
    comm_s: float = 0.0
    #: Seconds the training thread spent in sync points (equals ``comm_s`` here: no overlap).
    blocked_s: float = 0.0
    idle_s: float = 0.0
    quorum_wait_s: float = 0.0
    allreduce_s: float = 0.0
    #: Quorum process groups built, and reused from the quorum before (same members, committed).
    groups_built: int = 0
    groups_reused: int = 0
    rounds: list[dict] = dataclasses.field(default_factory=list)
