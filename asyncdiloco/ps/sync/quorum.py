"""Sync-mode rounds without tensors or sockets (the role of torchft's lighthouse): quorum
formation, commit votes, long-polled waits, the round counter; rounds.py applies the
result. One condition variable guards it all (lock order: quorum, then state).
docs/protocol.md, "The sync round".
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping

import torch

from asyncdiloco.errors import AsyncDiLoCoError, RoundRefusedError
from asyncdiloco.ps.config import SyncConfig
from asyncdiloco.ps.sync.quorum_types import Assignment, CommittedRound, Decision, MemberVote, QuorumMiss, RoundInFlight

log = logging.getLogger(__name__)

#: Decisions remembered for late voters.
_DECISION_MEMORY = 64


def _always() -> bool:
    return True


def _replaced(calls: dict[int, object], worker_id: int, me: object) -> bool:
    """A newer held call of ``worker_id`` (0: none tracked) took over from ``me``."""
    return bool(worker_id) and calls.get(worker_id) is not me


__all__ = ["Assignment", "CommittedRound", "Decision", "QuorumManager", "QuorumMiss"]


class QuorumManager:
    """Forms quorums, collects votes, counts rounds (see the module docstring).

    Args:
        config: min_workers, join_timeout_s, round_timeout_s.
        live_workers: returns the ids of workers whose lease is current.
        on_commit: applies a committed round (called with this manager's lock held).
        clock: monotonic seconds (injectable for tests).
        start_round: committed rounds so far.
        next_local_steps: at each decision (this manager's lock held), the round's
            members in rank order and their votes → member id → H_w for its next round
            (``Decision.local_steps``); None: none (the members keep their H).
    """

    def __init__(
        self,
        config: SyncConfig,
        *,
        live_workers: Callable[[], set[int]],
        on_commit: Callable[[CommittedRound], None],
        clock: Callable[[], float] = time.monotonic,
        start_round: int = 0,
        next_local_steps: Callable[[tuple[int, ...], Mapping[int, MemberVote]], Mapping[int, int]] | None = None,
    ) -> None:
        self.config = config
        self._live_workers = live_workers
        self._on_commit = on_commit
        self._next_local_steps = next_local_steps
        self._clock = clock
        self._cond = threading.Condition()
        self.round = start_round
        self.rounds_committed = 0
        self.rounds_failed = 0
        self._waiting: dict[int, int] = {}  # worker id -> its round
        #: Long-polled requests: worker id -> clock time by which its next poll must come.
        self._keep: dict[int, float] = {}
        #: Since the last formation: the first request of any worker, and the first of a
        #: member of the running group (its round boundary). Worker timeouts keep them.
        self._first_request_at: float | None = None
        self._boundary_at: float | None = None
        self._previous: frozenset[int] = frozenset()
        self._active: RoundInFlight | None = None
        self._assigned: dict[int, Assignment] = {}  # handed out, not yet collected
        self._decisions: OrderedDict[int, Decision] = OrderedDict()
        self._next_quorum_id = 1
        #: Set by ``close`` (the server is stopping): blocked calls return at once.
        self._closed = False
        #: The newest held Quorum call (a token) of each worker, and its newest held
        #: Commit call: an older one still held is answered at once (one per worker).
        self._quorum_calls: dict[int, object] = {}
        self._commit_calls: dict[int, object] = {}

    # --------------------------------------------------------- non-blocking core
    def request(self, worker_id: int, worker_round: int) -> Assignment | None:
        """Ask to join the next round; returns the assignment once the quorum formed
        (call again with the same arguments to poll)."""
        with self._cond:
            return self._request_locked(worker_id, worker_round)

    def _request_locked(self, worker_id: int, worker_round: int) -> Assignment | None:
        got = self._assigned.pop(worker_id, None)
        if got is not None:
            return got
        self._ask_locked(worker_id, worker_round)
        self._tick_locked()
        return self._assigned.pop(worker_id, None)

    def waiting_workers(self) -> frozenset[int]:
        """The ids of the workers whose request waits for the next quorum now."""
        with self._cond:
            return frozenset(self._waiting)

    def withdraw(self, worker_id: int) -> None:
        """Forget a waiting request (the worker gave up, left or lost its lease)."""
        with self._cond:
            self._waiting.pop(worker_id, None)
            self._assigned.pop(worker_id, None)
            self._keep.pop(worker_id, None)
            if not self._waiting:
                self._first_request_at = self._boundary_at = None
            self._tick_locked()

    def tick(self) -> None:
        """Re-evaluate deadlines and formation (call when time passed or leases changed)."""
        with self._cond:
            self._tick_locked()

    def stage_result(self, worker_id: int, quorum_id: int, result: torch.Tensor) -> None:
        """Keep rank 0's reduced pseudo-gradient for ``quorum_id`` until the vote.

        Raises:
            RoundRefusedError: not the in-flight quorum, already decided, or not its rank 0.
        """
        with self._cond:
            self._tick_locked()
            rnd = self._active
            if rnd is None or rnd.quorum_id != quorum_id or rnd.decision is not None:
                raise RoundRefusedError(
                    f"round refused: the result for quorum {quorum_id} arrived but "
                    f"{self._describe_active()}; it is discarded (the round aborts or already ended)"
                )
            if rnd.members[0] != worker_id:
                raise RoundRefusedError(
                    f"round refused: worker {worker_id} sent the result of quorum {quorum_id}, but only its "
                    f"rank 0 (worker {rnd.members[0]}) uploads it"
                )
            rnd.result = result

    def vote(
        self,
        worker_id: int,
        quorum_id: int,
        *,
        success: bool,
        total_weight: float = 0.0,
        num_tokens: int = 0,
        num_local_steps: int = 0,
        reason: str = "",
        compute_s: float = 0.0,
    ) -> Decision | None:
        """Record a member's vote (``compute_s``: seconds of its own compute over its
        ``num_local_steps``, 0 = not measured); returns the decision if the round is decided.

        Raises:
            RoundRefusedError: ``worker_id`` is not a member of ``quorum_id``, or the
                quorum id is unknown.
        """
        with self._cond:
            self._tick_locked()
            if quorum_id in self._decisions:
                return self._decisions[quorum_id]
            rnd = self._active
            if rnd is None or rnd.quorum_id != quorum_id:
                raise RoundRefusedError(
                    f"round refused: quorum {quorum_id} is unknown to this server ({self._describe_active()}); "
                    f"ask for a new quorum"
                )
            if worker_id not in rnd.members:
                raise RoundRefusedError(
                    f"round refused: worker {worker_id} is not a member of quorum {quorum_id} "
                    f"(members {list(rnd.members)})"
                )
            rnd.votes.setdefault(
                worker_id, MemberVote(success, float(total_weight), num_tokens, num_local_steps, reason, compute_s)
            )
            if not success:
                self._decide_locked(rnd, False, f"worker {worker_id} failed the round: {reason or 'no reason given'}")
            elif len(rnd.votes) == len(rnd.members):
                weights = {v.total_weight for v in rnd.votes.values()}
                if len(weights) != 1:
                    self._decide_locked(rnd, False, f"members disagree on the total weight: {sorted(weights)}")
                elif weights.pop() > 0 and rnd.result is None:
                    self._decide_locked(
                        rnd, False, f"rank 0 (worker {rnd.members[0]}) voted before uploading the result"
                    )
                else:
                    self._decide_locked(rnd, True, "")
            return rnd.decision

    def decision(self, quorum_id: int) -> Decision | None:
        with self._cond:
            self._tick_locked()
            return self._decisions.get(quorum_id)

    # ------------------------------------------------------------ blocking calls
    def wait_quorum(
        self, worker_id: int, worker_round: int, timeout_s: float, *, alive: Callable[[], bool] = _always
    ) -> Assignment | QuorumMiss:
        """``request`` and wait up to ``timeout_s`` real seconds for the quorum; a
        ``QuorumMiss`` saying why if it did not form (the request is withdrawn).

        ``alive`` is False once the caller's RPC ended (cancelled, deadline passed: the
        servicer passes ``context.is_active`` and wakes this wait with ``notify``): the
        wait ends and the request is withdrawn. A newer ``wait_quorum`` / ``poll_quorum``
        of the same worker replaces this one, which returns a ``QuorumMiss`` with
        ``pending`` at once (the request stays, held by the newer call)."""
        end = time.monotonic() + timeout_s
        me = object()
        with self._cond, self._turn_locked(self._quorum_calls, worker_id, me):
            self._keep.pop(worker_id, None)  # a blocking wait: no poll deadline
            got = self._request_locked(worker_id, worker_round)
            while got is None:
                if _replaced(self._quorum_calls, worker_id, me):
                    return self._replaced_locked(worker_id)
                got = self._assigned.pop(worker_id, None)
                if got is not None:
                    break
                left = end - time.monotonic()
                if left <= 0 or self._closed or not alive():
                    return self._give_up_locked(worker_id)
                self._cond.wait(min(left, self._next_wake_locked()))
                if worker_id not in self._waiting and worker_id not in self._assigned:
                    self._ask_locked(worker_id, worker_round)  # dropped meanwhile (e.g. lease check): re-ask
                self._tick_locked()
        return got

    def poll_quorum(
        self,
        worker_id: int,
        worker_round: int,
        *,
        hold_s: float,
        keep_s: float,
        final: bool,
        alive: Callable[[], bool] = _always,
    ) -> Assignment | QuorumMiss:
        """A long poll: ``request``, and wait at most ``hold_s`` real seconds (0: answer at
        once) for the quorum, while ``alive()`` and no newer call of the worker came.

        Args:
            keep_s: clock seconds the request stays registered without another poll.
            final: the caller's wait ends with this call: without a quorum it is withdrawn.
        Returns:
            The assignment, or a ``QuorumMiss`` with ``pending`` True (kept: poll again
            within ``keep_s``) or False (withdrawn).
        """
        end = time.monotonic() + hold_s
        me = object()
        with self._cond, self._turn_locked(self._quorum_calls, worker_id, me):
            self._keep[worker_id] = self._clock() + keep_s
            got = self._request_locked(worker_id, worker_round)
            while got is None:
                if _replaced(self._quorum_calls, worker_id, me):
                    return self._replaced_locked(worker_id)
                left = end - time.monotonic()
                if left <= 0 or self._closed or not alive():
                    break
                self._cond.wait(min(left, self._next_wake_locked()))
                got = self._assigned.pop(worker_id, None)
                if got is None:
                    got = self._request_locked(worker_id, worker_round)  # re-asks if dropped meanwhile
            if got is not None:
                self._keep.pop(worker_id, None)
                return got
            if final or self._closed:
                self._keep.pop(worker_id, None)
                return self._give_up_locked(worker_id)
            self._keep[worker_id] = self._clock() + keep_s
            return dataclasses.replace(self._miss_locked(worker_id), pending=True)

    def wait_decision(
        self, quorum_id: int, timeout_s: float, *, worker_id: int = 0, alive: Callable[[], bool] = _always
    ) -> Decision | None:
        """Wait up to ``timeout_s`` real seconds for ``quorum_id``'s decision (None: not
        decided). Ends early (None) when ``alive`` turns False (the caller's RPC ended)
        or a newer ``wait_decision`` of the same ``worker_id`` (> 0) starts."""
        end = time.monotonic() + timeout_s
        me = object()
        with self._cond, self._turn_locked(self._commit_calls, worker_id, me):
            while True:
                self._tick_locked()
                if quorum_id in self._decisions:
                    return self._decisions[quorum_id]
                left = end - time.monotonic()
                if left <= 0 or self._closed or not alive() or _replaced(self._commit_calls, worker_id, me):
                    return None
                self._cond.wait(min(left, self._next_wake_locked()))

    @property
    def next_quorum_id(self) -> int:
        """The id the next quorum gets (≥ 1)."""
        return self._next_quorum_id

    def resume(self, round: int, *, rounds_failed: int = 0, next_quorum_id: int = 1) -> None:
        """Go on from a run restored from its checkpoint folder, before any request:
        ``round`` rounds were committed (the restored version), ``rounds_failed`` failed,
        and quorum ids go on from ``next_quorum_id`` (never back)."""
        with self._cond:
            self.round = self.rounds_committed = round
            self.rounds_failed = rounds_failed
            self._next_quorum_id = max(self._next_quorum_id, next_quorum_id)

    def close(self) -> None:
        """The server is stopping: every blocked ``wait_quorum`` / ``wait_decision``
        returns None now (formed = false, decided = false: the worker asks again and finds
        the server gone), so no RPC thread keeps the process alive until its timeout."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def notify(self) -> None:
        """Wake blocked callers to re-evaluate (e.g. after a worker left)."""
        with self._cond:
            self._tick_locked()
            self._cond.notify_all()

    # ----------------------------------------------------------------- internals
    @contextlib.contextmanager
    def _turn_locked(self, calls: dict[int, object], worker_id: int, me: object) -> Iterator[None]:
        """Make ``me`` the newest held call of ``worker_id`` (0: none tracked) for the
        block, and wake the older one so that it answers now."""
        if worker_id:
            if worker_id in calls:
                self._cond.notify_all()
            calls[worker_id] = me
        try:
            yield
        finally:
            if worker_id and calls.get(worker_id) is me:
                del calls[worker_id]

    def _replaced_locked(self, worker_id: int) -> QuorumMiss:
        """The answer to a held Quorum call that a newer call of its worker replaced."""
        log.info("quorum request of worker %d replaced by a newer one of the same worker", worker_id)
        miss = self._miss_locked(worker_id)
        reason = f"replaced by a newer Quorum call of worker {worker_id} (one held call per worker; that one waits)"
        return dataclasses.replace(miss, reason=reason, pending=True)

    def _next_wake_locked(self) -> float:
        """Real seconds until the next deadline that could change something (≤ 0.5 s,
        so that lease expiries, judged by the clock, are noticed too)."""
        now, wake = self._clock(), 0.5
        if self._active is not None and self._active.decision is None:
            wake = min(wake, self._active.deadline - now)
        else:
            for since in (self._first_request_at, self._boundary_at):
                if since is not None:
                    wake = min(wake, since + self.config.join_timeout_s - now)
        return max(wake, 0.01)

    def _describe_active(self) -> str:
        rnd = self._active
        if rnd is None:
            return "no round is in flight"
        state = "decided" if rnd.decision is not None else "in flight"
        return f"quorum {rnd.quorum_id} is the current one ({state})"

    def _ask_locked(self, worker_id: int, worker_round: int) -> None:
        """Put ``worker_id`` among the waiting; start the join clocks it starts."""
        if worker_id not in self._waiting:
            now = self._clock()
            if self._first_request_at is None:
                self._first_request_at = now
            if self._boundary_at is None and worker_id in self._previous:
                self._boundary_at = now
        self._waiting[worker_id] = worker_round

    def _give_up_locked(self, worker_id: int) -> QuorumMiss:
        """Withdraw a request whose wait ended and say why no quorum formed for it. The
        join clocks keep running: resetting them would let callers that time out and ask
        again postpone the join timeout forever."""
        miss = self._miss_locked(worker_id)
        self._waiting.pop(worker_id, None)
        log.info("no quorum for worker %d: %s", worker_id, miss.reason)
        return miss

    def _miss_locked(self, worker_id: int) -> QuorumMiss:
        """Why no quorum formed for ``worker_id`` (yet), counting it among the waiting."""
        waiting = set(self._waiting) | {worker_id}
        have, need = len(waiting), self.config.min_workers
        rnd, live = self._active, self._live_workers()
        group = self._previous & live
        in_flight = rnd is not None and rnd.decision is None
        queued = not self._closed and (in_flight or bool(group and not group & waiting))
        if self._closed:
            reason = "the server is stopping"
        elif rnd is not None and in_flight:
            reason = (
                f"quorum {rnd.quorum_id} (workers {list(rnd.members)}) is in round {rnd.round + 1}; "
                f"this worker is queued for the round after it"
            )
        elif queued:
            reason = (
                f"waiting for the running group (workers {sorted(group)}, the members of the last round) "
                f"to reach its next round boundary; this worker is queued for that round"
            )
        elif have < need:
            reason = (
                f"quorum not reached: have {have}, need {need} (--min-workers {need}; waiting: workers "
                f"{sorted(waiting)}); start more workers or lower --min-workers"
            )
        else:
            reason = (
                f"quorum not formed yet: waiting for workers {sorted((group or live) - waiting)} up to "
                f"--quorum-wait-s {self.config.join_timeout_s:g} s; ask again"
            )
        return QuorumMiss(have, need, queued, reason)

    def _tick_locked(self) -> None:
        now = self._clock()
        rnd = self._active
        if rnd is not None and rnd.decision is None and now >= rnd.deadline:
            missing = [w for w in rnd.members if w not in rnd.votes]
            self._decide_locked(
                rnd,
                False,
                f"workers {missing} did not vote within round_timeout_s={self.config.round_timeout_s:g} s",
            )
        if self._active is not None and self._active.decision is None:
            return
        if not self._waiting:
            return
        for w in [w for w, until in self._keep.items() if until <= now]:  # polls that stopped coming
            del self._keep[w]
            self._waiting.pop(w, None)
        live = self._live_workers()
        for w in [w for w in self._waiting if w not in live]:
            del self._waiting[w]
        waiting = set(self._waiting)
        if len(waiting) < self.config.min_workers or not waiting:
            return
        group = self._previous & live  # the running group
        since: float | None
        if group:  # its round boundary only: the others are queued for it
            if not group & waiting:
                return
            if self._boundary_at is None:  # set by _ask_locked or _decide_locked; never wait without a clock
                self._boundary_at = now
            since = self._boundary_at
            ready = group <= waiting
        else:
            since = self._first_request_at
            ready = live <= waiting
        if ready or (since is not None and now - since >= self.config.join_timeout_s):
            self._form_locked(now)

    def _form_locked(self, now: float) -> None:
        members = tuple(sorted(self._waiting))
        heal = frozenset(w for w in members if self._waiting[w] != self.round)
        quorum_id = self._next_quorum_id
        self._next_quorum_id += 1
        deadline = now + self.config.round_timeout_s
        self._active = RoundInFlight(quorum_id, self.round, members, heal, now, deadline)
        for rank, w in enumerate(members):
            self._assigned[w] = Assignment(quorum_id, self.round, members, rank, w in heal, deadline)
        self._waiting.clear()
        for w in members:
            self._keep.pop(w, None)
        self._first_request_at = self._boundary_at = None
        log.info(
            "quorum %d formed for round %d: members %s%s",
            quorum_id,
            self.round + 1,
            list(members),
            f", healing {sorted(heal)}" if heal else "",
        )
        self._cond.notify_all()

    def _decide_locked(self, rnd: RoundInFlight, committed: bool, reason: str) -> None:
        total = rnd.votes[rnd.members[0]].total_weight if committed else 0.0
        if committed:
            try:
                self._on_commit(
                    CommittedRound(
                        quorum_id=rnd.quorum_id,
                        round=self.round + (1 if total > 0 else 0),
                        result=rnd.result if total > 0 else None,
                        tokens_by_worker={w: v.num_tokens for w, v in rnd.votes.items()},
                        steps_by_worker={w: v.num_local_steps for w, v in rnd.votes.items()},
                    )
                )
            except AsyncDiLoCoError as exc:  # e.g. the round could not be logged: nobody applies it
                committed, reason = False, f"the server could not apply the round: {exc}"
        if committed:
            if total > 0:  # else every member healed: nothing to apply, no new round
                self.round += 1
                self.rounds_committed += 1
            log.info("quorum %d committed: round %d", rnd.quorum_id, self.round)
        else:
            self.rounds_failed += 1
            log.warning("quorum %d aborted: %s", rnd.quorum_id, reason)
        rnd.result = None
        steps = self._next_local_steps(rnd.members, rnd.votes) if self._next_local_steps is not None else {}
        rnd.decision = Decision(rnd.quorum_id, committed, self.round, reason, dict(steps))
        self._decisions[rnd.quorum_id] = rnd.decision
        while len(self._decisions) > _DECISION_MEMORY:
            self._decisions.popitem(last=False)
        self._previous = frozenset(rnd.members)
        # the next boundary is the new running group's: a request made meanwhile by one
        # of its members starts it now, one by anybody else does not
        self._boundary_at = self._clock() if self._previous & self._waiting.keys() else None
        for w in rnd.members:  # an unclaimed assignment of a decided round is void
            self._assigned.pop(w, None)
        self._cond.notify_all()
