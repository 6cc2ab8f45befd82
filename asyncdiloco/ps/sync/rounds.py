"""Sync mode on the server's state (synchronous DiLoCo, Douillard et al. 2023, arXiv
2311.08105, Alg. 1): the staged round result, the committed round's outer step, the
Quorum, Commit and Store calls, per-member H_w, durable rounds and the healing pull;
quorum.py runs the rounds. Lock order: the quorum's condition, then the state's locks.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping

import torch

from asyncdiloco.errors import InvalidPayloadError, ManifestMismatchError, NotInitializedError
from asyncdiloco.ps.books import AppliedAs, PushOutcome, Vote, WorkerRecord
from asyncdiloco.ps.core import CoreParts
from asyncdiloco.ps.pull.snapshots import Snapshots
from asyncdiloco.ps.push.value_check import check_values
from asyncdiloco.ps.sync.long_poll import HOLD_S, KEEP_S, NO_WATCH, CallWatch, HeldWaits, check_wait, max_held_waits
from asyncdiloco.ps.sync.quorum import Assignment, CommittedRound, Decision, QuorumManager, QuorumMiss
from asyncdiloco.ps.sync.quorum_types import MemberVote
from asyncdiloco.ps.sync.rendezvous import RendezvousStore
from asyncdiloco.wire._proto import parameter_server_pb2 as pb

log = logging.getLogger(__name__)

_NOT_INITIALIZED = "not initialized: no worker has pushed the initial parameters yet"


class RoundResult:
    """``PUSH_KIND_ROUND_RESULT``: rank 0's reduced Δ̄, staged until the vote."""

    #: Staged until the vote, so not in the receive pool: a buffer of its own.
    pooled = False

    def __init__(self, rounds: SyncRounds) -> None:
        self.rounds = rounds

    def check(self, header: pb.PushHeader) -> None:
        """Raises NotInitializedError: no θ yet."""
        if not self.rounds.model.initialized:
            raise NotInitializedError("not initialized: no global parameters yet to apply a round result to")

    def payload_bytes(self) -> tuple[int, str]:
        return self.rounds.model.known_manifest.numel * 4, "(see the manifest from Join)"  # float32 Δ̄, any dtypes

    def apply(self, header: pb.PushHeader, payload: torch.Tensor, largest: float | None = None) -> PushOutcome:
        """Stage Δ̄ (the payload viewed as float32 (N,)) for the quorum's vote (``largest``:
        ‖Δ̄‖∞ scanned as it landed, value_scan.py).

        Raises:
            InvalidPayloadError: wrong size or non-finite values. UnknownWorkerError.
            RoundRefusedError: not the round in flight, or not its rank 0.
        """
        return self.rounds.stage_result(header, payload, largest)

    def replay(self, rec: WorkerRecord, header: pb.PushHeader, delta: torch.Tensor, applied: AppliedAs) -> None:
        """Redo a logged committed round (start-up replay; both locks held): Δ̄ float32
        (N,), the round ``applied.version_after`` it made."""
        self.rounds.replay_round(header, delta, applied)


class SyncRounds:
    """Sync mode: quorum rounds (see the module docstring).

    Args:
        parts: the core parts (θ and the version = committed rounds, the worker table,
            the counters, the locks).
        live_worker_ids: the live workers (takes the books lock; the quorum calls it).
        snapshots: the pull snapshots (the round before is kept for the pulls during a step).
    """

    def __init__(self, parts: CoreParts, live_worker_ids: Callable[[], set[int]], snapshots: Snapshots) -> None:
        self.parts = parts
        self.snapshots = snapshots
        self.config = parts.config
        self.locks = parts.locks
        self.model = parts.model
        self.registry = parts.registry
        self.counters = parts.counters
        self.round_result = RoundResult(self)
        #: The quorums' rendezvous namespaces (the Store RPC).
        self.rendezvous = RendezvousStore()
        self.quorum = QuorumManager(
            self.config.sync,
            live_workers=live_worker_ids,
            on_commit=self.apply_round,
            clock=parts.clock,
            next_local_steps=self.next_local_steps,
        )
        #: Long-polled Quorum/Commit calls held now (at most an eighth of the RPC pool).
        self.held_waits = HeldWaits(max_held_waits(self.config.max_concurrent_rpcs))
        #: What a restore found (checkpoint and log), for ``resume``.
        self._next_quorum_id, self._rounds_failed = 1, 0

    def withdraw(self, worker_id: int) -> None:
        """A worker left (no state lock held: the quorum calls ``live_worker_ids``)."""
        self.quorum.withdraw(worker_id)
        self.quorum.notify()

    # ------------------------------------------------------------ the round
    def stage_result(self, header: pb.PushHeader, payload: torch.Tensor, largest: float | None = None) -> PushOutcome:
        """Keep rank 0's Δ̄ (uint8 payload of float32 (N,)) for the vote, after the checks
        an async pseudo-gradient passes: finite, and |Δ̄| ≤ ``max_abs_value``.

        Raises:
            InvalidPayloadError: wrong size, non-finite or too large values (the upload is
                refused, so rank 0 votes failure and the round aborts on every member).
            RoundRefusedError, UnknownWorkerError.
        """
        delta = payload.view(torch.float32)  # (N,) Δ̄, the assembler's own fresh buffer
        numel = self.model.known_manifest.numel
        if delta.numel() != numel:
            raise InvalidPayloadError(f"round result holds {delta.numel()} floats; the model has {numel}")
        check_values(  # the checks of an async push
            delta,
            header.worker_id,
            self.config.max_abs_value,
            self.model.known_manifest,
            what=f"the round result of quorum {header.quorum_id}",
            largest=largest,
        )
        with self.locks.books:
            self.registry.touch(header.worker_id, header.session_id)
        self.quorum.stage_result(header.worker_id, header.quorum_id, delta)  # RoundRefusedError
        with self.locks.books:
            self.counters.bytes_pushed += header.total_bytes
            return PushOutcome(True, False, self.model.version, 0, 1.0, self.config.local_steps)

    def apply_round(self, done: CommittedRound) -> None:
        """Apply a committed round (called by the QuorumManager, its lock held): the same
        outer step every member applies to θ_base, at the round it started from. The step
        runs with the books lock free, and pulls meanwhile are served the round before
        (snapshots.py ``before_apply``): a pull never waits for a round's outer step."""
        with self.locks.apply:
            if done.result is not None:
                with self.locks.books:
                    self._log_round(done, done.result)  # CheckpointError: nothing applied, the round aborts
                self.snapshots.before_apply(self._version())
                with self.parts.observer.timed("outer_step"):
                    self.model.optimizer.step(done.result, version=done.round - 1)
            with self.locks.books:
                self._count_round(done)

    def next_local_steps(self, members: tuple[int, ...], votes: Mapping[int, MemberVote]) -> dict[int, int]:
        """At a round's decision (the QuorumManager's lock held): take each vote's rate
        (``num_local_steps / compute_s``, into the worker table's ``StepRateMeter``), then
        each member's H_w for its next round (registry.py ``plan_sync_round``: H, or DyLU
        over the members' rates with ``--sync-local-steps adaptive``)."""
        now = self.parts.clock()
        with self.locks.books:
            for worker_id, vote in votes.items():
                measured = vote.num_local_steps > 0 and math.isfinite(vote.compute_s) and vote.compute_s > 0
                if measured and self.registry.workers.get(worker_id) is not None:  # else none: not measured
                    self.registry.rates.record(worker_id, vote.num_local_steps, now, vote.compute_s)
            return self.registry.plan_sync_round(members)

    def _log_round(self, done: CommittedRound, result: torch.Tensor) -> None:
        """Journal a committed round before it is applied (books lock held): the record of a
        push of kind ROUND_RESULT from rank 0 (the smallest member id: members are
        ordered by id), push id = quorum id, with the round's total tokens and steps."""
        contributors = [w for w, steps in done.steps_by_worker.items() if steps > 0]
        header = pb.PushHeader(
            worker_id=min(done.steps_by_worker),
            push_id=done.quorum_id,
            base_version=done.round - 1,
            num_local_steps=sum(done.steps_by_worker.values()),
            num_tokens=sum(done.tokens_by_worker.values()),
            total_bytes=result.numel() * 4,
            kind=pb.PUSH_KIND_ROUND_RESULT,
            quorum_id=done.quorum_id,
        )
        applied = AppliedAs(tau=0, weight=1.0, version_after=done.round, num_workers=len(contributors))
        self.parts.journal.log_push(header, result.view(torch.uint8), applied)

    def replay_round(self, header: pb.PushHeader, delta: torch.Tensor, applied: AppliedAs) -> None:
        """Redo a logged round (both locks held): the outer step, the version, and the
        global counters (one applied share per contributing member, the round's tokens)."""
        self.model.optimizer.step(delta, version=applied.version_after - 1)
        self.model.version = applied.version_after
        self._next_quorum_id = max(self._next_quorum_id, header.push_id + 1)  # push id = quorum id (logged)
        for _ in range(applied.num_workers):
            self.counters.count_applied(0, 0)
        self.counters.tokens += header.num_tokens

    # ------------------------------------------------------ durable round state
    def to_meta(self) -> dict:
        """The rounds' part of a checkpoint (read without the quorum's lock, which must
        not be taken under the state's: both are counters that only grow). The
        committed-round count is the version, saved with θ."""
        return {"next_quorum_id": self.quorum.next_quorum_id, "rounds_failed": self.quorum.rounds_failed}

    def load_meta(self, meta: dict | None) -> None:
        """Take a checkpoint's ``to_meta`` (None: an async server's checkpoint; the rounds
        start at its version)."""
        if meta is not None:
            self._next_quorum_id = max(self._next_quorum_id, meta["next_quorum_id"])
            self._rounds_failed = meta["rounds_failed"]

    def resume(self) -> None:
        """After the restore (no state lock held): the rounds go on at the restored
        version, quorum ids after every one the checkpoint and the log know."""
        with self.locks.books:
            version = self.model.version
        self.quorum.resume(version, rounds_failed=self._rounds_failed, next_quorum_id=self._next_quorum_id)
        if version:
            log.info("sync rounds resume at round %d (next quorum id %d)", version, self.quorum.next_quorum_id)

    def _version(self) -> int:
        with self.locks.books:
            return self.model.version

    def _count_round(self, done: CommittedRound) -> None:
        """The version and the members' counters of a committed round (books lock held)."""
        if done.result is not None:
            self.model.version = done.round
        for worker_id, steps in done.steps_by_worker.items():
            if steps <= 0:  # a healing member contributed nothing
                continue
            tokens = done.tokens_by_worker.get(worker_id, 0)
            self.counters.count_applied(0, tokens)  # synchronous: τ = 0 by construction
            rec = self.registry.workers.get(worker_id)
            if rec is not None:
                rec.applied_pushes += 1
                rec.tokens += tokens
                rec.local_steps += steps

    # ------------------------------------------------------- quorum and commit
    def _check_request(self, worker_id: int) -> None:
        with self.locks.books:
            self.registry.touch(worker_id)
            if not self.model.initialized:
                raise NotInitializedError(_NOT_INITIALIZED)

    @property
    def peak_held_waits(self) -> int:
        """The most long-polled Quorum/Commit calls held at once so far."""
        return self.held_waits.peak

    def request_quorum(
        self,
        worker_id: int,
        worker_round: int,
        manifest_hash: str,
        timeout_s: float,
        poll: bool = False,
        call: CallWatch = NO_WATCH,
    ) -> Assignment | QuorumMiss:
        """Block up to ``timeout_s`` seconds for the next round's quorum (a ``QuorumMiss``,
        saying why, when none formed); with ``poll``, a long poll's hold (long_poll.py;
        ``pending``: ask again). ``call``: the RPC's watch, which ends the wait with it.

        Raises:
            UnknownWorkerError, NotInitializedError, ManifestMismatchError (the hash
            differs from the server's manifest), InvalidPayloadError (``timeout_s`` ≤ 0,
            not finite, or above ``long_poll.MAX_WAIT_S`` without ``poll``).
        """
        self._check_request(worker_id)
        server_hash = self.model.known_manifest.manifest_hash
        if manifest_hash != server_hash:
            raise ManifestMismatchError(
                f"manifest mismatch: worker {worker_id} asks for a quorum with manifest_hash {manifest_hash[:16]}..., "
                f"the server's is {server_hash[:16]}...; every member must train the same model"
            )
        check_wait(timeout_s, poll=poll, what="Quorum")
        if not timeout_s > 0:
            raise InvalidPayloadError(
                f"Quorum timeout_s is {timeout_s}; it must be > 0 seconds (the wait for a quorum)"
            )
        if poll:
            with self.held_waits.hold(min(timeout_s, call.left_s)) as hold_s:
                got = self.quorum.poll_quorum(
                    worker_id, worker_round, hold_s=hold_s, keep_s=KEEP_S, final=timeout_s <= HOLD_S, alive=call.alive
                )
        else:
            got = self.quorum.wait_quorum(worker_id, worker_round, min(timeout_s, call.left_s), alive=call.alive)
        if isinstance(got, Assignment):
            self.rendezvous.open(got.quorum_id, got.members)
        return got

    def commit(self, vote: Vote, timeout_s: float, poll: bool = False, call: CallWatch = NO_WATCH) -> Decision | None:
        """Vote, then block up to ``timeout_s`` seconds for the decision (None: not
        decided yet; ask again). With ``poll`` block at most ``HOLD_S`` seconds, and
        none when every hold is taken (long_poll.py); a vote sent again counts once.
        The wait ends when ``call`` (the RPC) ends, or a newer Commit of the worker waits.

        Raises:
            UnknownWorkerError, NotInitializedError, RoundRefusedError (not a member),
            InvalidPayloadError (``timeout_s`` not finite, or above ``MAX_WAIT_S``
            without ``poll``; checked before the vote counts).
        """
        check_wait(timeout_s, poll=poll, what="Commit")
        self._check_request(vote.worker_id)
        decision = self.quorum.vote(
            vote.worker_id,
            vote.quorum_id,
            success=vote.success,
            total_weight=vote.total_weight,
            num_tokens=vote.num_tokens,
            num_local_steps=vote.num_local_steps,
            reason=vote.reason,
            compute_s=vote.compute_s,
        )
        wait_s = min(timeout_s, call.left_s)
        if decision is None and wait_s > 0:
            if poll:
                with self.held_waits.hold(wait_s) as hold_s:
                    if hold_s > 0:
                        decision = self.quorum.wait_decision(
                            vote.quorum_id, hold_s, worker_id=vote.worker_id, alive=call.alive
                        )
            else:
                decision = self.quorum.wait_decision(vote.quorum_id, wait_s, worker_id=vote.worker_id, alive=call.alive)
        if decision is not None:
            self.rendezvous.close(vote.quorum_id)
            self.parts.journal.maybe_checkpoint()  # outside every lock
        return decision

    def store(self, request: pb.StoreRequest) -> pb.StoreReply:
        """One rendezvous-store operation for a member of a quorum whose round is in flight
        (rendezvous.py ``RendezvousStore.serve``); answers at once.

        Raises:
            UnknownWorkerError, NotInitializedError, RoundRefusedError (not a member, or
            the round ended: its namespace is gone), InvalidPayloadError, PayloadTooLargeError.
        """
        self._check_request(request.worker_id)
        if self.quorum.decision(request.quorum_id) is not None:
            self.rendezvous.close(request.quorum_id)  # decided, though no vote has returned yet
        return self.rendezvous.serve(request)

    def sync_state(self) -> tuple[int, torch.Tensor]:
        """For healing: (round, payload), the payload θ as float32 bytes followed by the
        outer momentum m as float32 bytes (absent when μ = 0); a private copy,
        consistent with one committed round (uint8 (k·N·4,)).

        Raises:
            NotInitializedError: no θ yet.
        """
        with self.locks.apply, self.locks.books:
            if self.model.params is None:
                raise NotInitializedError(_NOT_INITIALIZED)
            parts = [self.model.params]
            momentum = self.model.optimizer.momentum_buffer
            if momentum is not None:
                parts.append(momentum)
            return self.model.version, torch.cat(parts).view(torch.uint8)  # a copy
