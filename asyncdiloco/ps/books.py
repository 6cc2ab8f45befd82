"""What the state keeps in its books (``books`` lock): push outcomes, worker rows, logged
Joins, votes, the counters, the state's two locks and the write-ahead log's interface
(``Journal``). Light to import (no torch). docs/architecture.md, "The server's rooms".
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, TypeAlias

from asyncdiloco.errors import InvalidPayloadError
from asyncdiloco.wire._proto import parameter_server_pb2 as pb

if TYPE_CHECKING:  # light at run time: the status command reads the counters' helpers
    import torch

    from asyncdiloco.wire.tensors import Manifest

#: Outcomes remembered per worker for answering retried pushes with what they got; an
#: older id is still never applied again (``WorkerRecord.push_high_water``).
PUSH_MEMORY = 256


@dataclasses.dataclass(frozen=True)
class PushOutcome:
    """The outcome of one push, as its reply reports it.

    Attributes:
        applied: the push changed the global model (or staged a round result); for a
            duplicate, the original push is known to have been applied.
        duplicate: a retry of a push id at or below the worker's high-water mark, not
            applied now (``WorkerRecord.answer_retry``).
        version: the global version after the push.
        staleness: τ = V − v, versions applied since the push's base version.
        staleness_weight: s(τ), the factor the pseudo-gradient was scaled by.
        local_steps: H, the inner steps of the worker's next round.
        group_id: the push group whose release the reply waits for (0: none).
        num_workers: N, the live-worker count the outer step used (0: not a pseudo-gradient).
        closing: a worker's closing push, applied as the direct term alone (outer.py ``step_closing``).
    """

    applied: bool
    duplicate: bool
    version: int
    staleness: int
    staleness_weight: float
    local_steps: int
    group_id: int = 0
    num_workers: int = 0
    closing: bool = False


@dataclasses.dataclass(frozen=True)
class AppliedAs:
    """What a push's outer step depended on when it was applied: logged with the push
    (wal.py), so that replaying the log redoes exactly the same step."""

    #: τ, the push's staleness in versions.
    tau: int
    #: s(τ), its staleness weight.
    weight: float
    #: The version the apply produced (η's schedule is keyed by version_after − 1).
    version_after: int
    #: Live workers at the apply: Delayed Nesterov's N (Liu et al. 2024, Alg. 3); for a
    #: regional server's push (``region``), R, the live regional servers.
    num_workers: int
    #: A regional server's push, averaged in as θ ← θ − s·Δ/R instead of going through the
    #: outer optimizer (apply.py ``REGION``).
    region: bool = False
    #: A worker's closing push (``PushHeader.last``): the direct term alone, with
    #: ``num_workers`` the N it was divided by (outer.py ``step_closing``).
    closing: bool = False


@dataclasses.dataclass(frozen=True)
class Vote:
    """A member's vote on a sync round (``CommitRequest``), as the mode takes it."""

    worker_id: int
    quorum_id: int
    #: The allreduce (and, on rank 0, the round-result upload) succeeded.
    success: bool
    #: The allreduced total weight, identical on every member.
    total_weight: float = 0.0
    #: This member's own tokens and inner steps in the round (0 when healing).
    num_tokens: int = 0
    num_local_steps: int = 0
    #: Why the round failed here, when ``success`` is False.
    reason: str = ""
    #: Seconds of the member's own compute over ``num_local_steps`` (0: not measured).
    compute_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class LoggedJoin:
    """A Join as the write-ahead log keeps it (wal.py) and its replay redoes it."""

    worker_id: int
    #: The worker's name ("worker-<id>" when it gave none).
    name: str
    #: It was told to push the initial parameters.
    initialize: bool
    #: The manifest it brought, when that became the server's (the first Join); else None.
    manifest: Manifest | None
    #: The worker gave ``name`` (a later Join under it resumes this id).
    named: bool
    #: When it joined, wall-clock seconds.
    seen_unix_s: float
    #: It joined as a regional server (a lower tier's ``UpstreamLink``).
    region: bool = False


@dataclasses.dataclass
class WorkerRecord:
    """One registered worker: its lease (server clock, seconds) and its totals."""

    worker_id: int
    name: str
    joined_at: float
    last_seen: float
    alive: bool = True
    applied_pushes: int = 0
    rejected_pushes: int = 0
    tokens: int = 0
    local_steps: int = 0
    #: Server clock of the last applied pseudo-gradient (0: none yet; grouping expects a
    #: worker that pushed within about two of its rounds, or joined since).
    last_push: float = 0.0
    #: The worker called Leave (False when its lease lapsed or it is alive).
    left: bool = False
    #: Σ τ and the count of the pseudo-gradients this process applied for it (status:
    #: their mean), and τ of the newest one.
    staleness_sum: int = 0
    staleness_pushes: int = 0
    last_staleness: int = 0
    outcomes: OrderedDict[int, PushOutcome] = dataclasses.field(default_factory=OrderedDict)
    #: The worker gave this name (``JoinRequest.worker_name``): a later Join under it
    #: resumes this record. False for the "worker-<id>" a nameless worker is given.
    named: bool = False
    #: Joins of this id so far: the current session (``JoinReply.session_id``); calls of
    #: an older one are refused.
    session: int = 0
    #: Processes of the current session's torchrun group (``JoinRequest.ranks``; 1 alone).
    ranks: int = 1
    #: A regional server (it joined with the ``adl-role: region`` metadata): its
    #: pseudo-gradients are averaged in over the live regions, not outer-optimized again.
    region: bool = False
    #: The highest push_id applied for this id, in any session (0: none). A worker numbers
    #: its pushes upwards, so a push at or below it is a replay and is never applied again,
    #: also once its outcome is no longer remembered (like Kafka's idempotent producer).
    push_high_water: int = 0

    @property
    def last_push_id(self) -> int:
        """The highest push_id applied for this worker (0: none); a resumed one goes on after it."""
        return max(self.push_high_water, max(self.outcomes, default=0))

    def remember(self, push_id: int, outcome: PushOutcome) -> None:
        """Keep an applied push's outcome for its retries (the newest ``PUSH_MEMORY``) and
        raise the high-water mark to its id."""
        self.outcomes[push_id] = outcome
        self.push_high_water = max(self.push_high_water, push_id)
        while len(self.outcomes) > PUSH_MEMORY:
            self.outcomes.popitem(last=False)

    def answer_retry(self, push_id: int, version: int, local_steps: int) -> PushOutcome | None:
        """The ``duplicate`` answer to a push that must not be applied: a remembered id's
        outcome, else for an id at or below the high-water mark ``applied=False`` at the
        current ``version``; None for an id above the mark."""
        remembered = self.outcomes.get(push_id)
        if remembered is not None:
            return dataclasses.replace(remembered, duplicate=True)
        if push_id > self.last_push_id:
            return None
        return PushOutcome(False, True, version, 0, 0.0, local_steps)


@dataclasses.dataclass(frozen=True)
class Joined:
    """The answer to a Join (``JoinReply``'s fields the state decides).

    Attributes:
        worker_id: the worker's id (its old one when it resumed).
        initialize: the worker must push the initial parameters.
        version: the global version at the join.
        resumed: the Join's name matched a registered worker, whose id was given back.
        last_push_id: the highest push_id with a remembered outcome from that id (0: new).
        session_id: this Join's session of the id (``JoinReply.session_id``).
    """

    worker_id: int
    initialize: bool
    version: int
    resumed: bool = False
    last_push_id: int = 0
    session_id: int = 0


@dataclasses.dataclass(frozen=True, eq=False)
class StateLocks:
    """The state's two locks. Order: ``apply`` before ``books``, never the reverse.

    Attributes:
        books: guards the version, the worker table, the counters and the journal; held
            for bookkeeping only, never during tensor math, so Join, Heartbeat and Status
            never wait for an apply.
        apply: serialises whatever reads or writes θ and the outer optimizer's state
            (the outer step, the copy into a pull snapshot, checkpoints).
    """

    books: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    apply: threading.Lock = dataclasses.field(default_factory=threading.Lock)


#: (meta, tensors, result of ``while_locked``): a checkpoint's JSON part and its tensors.
StateDict: TypeAlias = "tuple[dict, dict[str, torch.Tensor], int]"


class Journal(Protocol):
    """A write-ahead log of the state's changes (store.py)."""

    def log_join(self, join: LoggedJoin) -> None:
        """Log a Join (books lock held), before the worker learns its id."""

    def log_push(self, header: pb.PushHeader, payload: torch.Tensor, applied: AppliedAs, *, seen_unix_s: float) -> None:
        """Log a push about to be applied (books lock held), with what its outer step
        depends on and when it arrived (wall clock, seconds)."""

    def maybe_checkpoint(self) -> None:
        """Checkpoint if enough pushes were logged since the last one (no lock held)."""


class JournaledState(Protocol):
    """What a durable store restores, checkpoints and journals: a state's ``durability``
    (durable/durability.py), so the store never reaches into the state's locks or fields."""

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


#: The counters of a checkpoint's ``meta["counters"]``, in the order they are written.
COUNTER_NAMES = (
    "applied_pushes",
    "rejected_pushes",
    "duplicate_pushes",
    "bytes_pushed",
    "bytes_pulled",
    "pulls",
    "tokens",
)

#: Seconds the applied-push rate is taken over (StatusReply.pushes_per_s).
RATE_WINDOW_S = 60
#: Evaluator reports kept (StatusReply.evals), the newest.
MAX_EVALS = 256
#: Longest ``EvalReport.evaluator`` name taken, characters.
MAX_EVALUATOR_CHARS = 200
#: Largest held-out loss taken, nats per token. A mean cross-entropy is >= 0, and a
#: uniform guess over a vocabulary of V tokens costs ln V (13.8 nats for V = 10^6), so
#: 10^4 is far above any real model's loss: a larger number is a sum over tokens rather
#: than their mean, or another unit, and would flatten the dashboard's curve.
MAX_EVAL_LOSS = 1e4


def newest_eval(evals: Sequence[pb.EvalPoint]) -> pb.EvalPoint | None:
    """The report of the highest version among ``evals`` (oldest received first, as
    ``StatusReply.evals``); of equal versions the one received last. None when empty.
    A slow evaluator's late report of an older version does not replace a newer one."""
    best = None
    for point in evals:
        if best is None or point.version >= best.version:
            best = point
    return best


def _check_eval(point: pb.EvalPoint, current: int) -> None:
    if not math.isfinite(point.loss):
        raise InvalidPayloadError(
            f"eval loss is {point.loss}; it must be finite: evaluate a model that has not diverged"
        )
    if not 0.0 <= point.loss <= MAX_EVAL_LOSS:
        raise InvalidPayloadError(
            f"eval loss is {point.loss:g} nats per token; it must be in [0, {MAX_EVAL_LOSS:g}] (a cross-entropy "
            f"is >= 0, and a uniform guess over 10^6 tokens is 13.8 nats): report the mean loss per token"
        )
    if point.num_tokens < 1:
        raise InvalidPayloadError(
            f"eval num_tokens is {point.num_tokens}; it must be >= 1, the tokens the loss is over"
        )
    if not 0 <= point.version <= current:
        raise InvalidPayloadError(
            f"eval version is {point.version}; it must be in [0, {current}] (the server's current version): "
            f"report the version you pulled"
        )
    if len(point.evaluator) > MAX_EVALUATOR_CHARS:
        raise InvalidPayloadError(
            f"evaluator name has {len(point.evaluator)} characters; the limit is {MAX_EVALUATOR_CHARS}: "
            f"use a shorter name"
        )


@dataclasses.dataclass
class Counters:
    """Server-wide totals since the run began (restored from checkpoints).

    Args:
        histogram_buckets: buckets of ``staleness_histogram`` (>= 2); the last counts
            every larger τ.
        clock: the server's monotonic clock, seconds (the push rate's window).
    """

    histogram_buckets: int
    clock: Callable[[], float] = time.monotonic
    applied_pushes: int = 0
    rejected_pushes: int = 0
    duplicate_pushes: int = 0
    bytes_pushed: int = 0
    bytes_pulled: int = 0
    pulls: int = 0
    tokens: int = 0
    #: Applied pseudo-gradients per staleness τ (sync rounds count at τ = 0).
    staleness_histogram: list[int] = dataclasses.field(init=False)
    #: Refused or cut-off pushes of this process by reason code (errors.py; "cut_off": the
    #: stream broke mid-payload). Not checkpointed: a restart starts them at 0.
    refused_by_reason: dict[str, int] = dataclasses.field(init=False, default_factory=dict)
    #: The newest evaluator reports, oldest first (at most ``MAX_EVALS``).
    evals: collections.deque[pb.EvalPoint] = dataclasses.field(init=False)
    #: Applied pushes per second of the clock, [second, count], the last ``RATE_WINDOW_S``.
    _per_second: collections.deque[list[int]] = dataclasses.field(init=False)
    _started: float = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.staleness_histogram = [0] * self.histogram_buckets
        self.evals = collections.deque(maxlen=MAX_EVALS)
        self._per_second = collections.deque()
        self._started = self.clock()

    def count_applied(self, tau: int, num_tokens: int) -> None:
        """One pseudo-gradient (or one member's share of a round) of staleness ``tau`` was applied."""
        self.applied_pushes += 1
        self.tokens += num_tokens
        self.staleness_histogram[min(tau, len(self.staleness_histogram) - 1)] += 1
        second = int(self.clock())
        if self._per_second and self._per_second[-1][0] == second:
            self._per_second[-1][1] += 1
        else:
            self._per_second.append([second, 1])
            self._forget_before(second - RATE_WINDOW_S)

    def _forget_before(self, second: int) -> None:
        while self._per_second and self._per_second[0][0] < second:
            self._per_second.popleft()

    def restart_rate(self) -> None:
        """Start the push rate afresh now (the pushes replayed from the log at start-up
        were not applied in the last minute)."""
        self._per_second.clear()
        self._started = self.clock()

    def pushes_per_s(self) -> float:
        """Applied pushes per second over the last ``RATE_WINDOW_S`` seconds (1 s
        resolution), or since this process started when it is younger; 0 at start."""
        now = self.clock()
        self._forget_before(int(now) - RATE_WINDOW_S)
        elapsed = min(float(RATE_WINDOW_S), now - self._started)
        return sum(n for _, n in self._per_second) / elapsed if elapsed > 0 else 0.0

    def note_refusal(self, reason: str) -> None:
        """A push counted in ``rejected_pushes`` was refused with ``reason`` (or cut off: "cut_off")."""
        self.refused_by_reason[reason] = self.refused_by_reason.get(reason, 0) + 1

    def record_eval(self, point: pb.EvalPoint, version: int) -> None:
        """Keep an evaluator's report (the oldest goes beyond ``MAX_EVALS``); ``version``:
        the server's current one.

        Raises:
            InvalidPayloadError: a loss that is not finite or outside [0, ``MAX_EVAL_LOSS``],
                num_tokens < 1, a version outside [0, version], or a name over
                ``MAX_EVALUATOR_CHARS``; nothing is kept.
        """
        _check_eval(point, version)
        self.evals.append(point)

    def staleness_sum(self) -> int:
        """Σ τ over the applied pushes, from the histogram: the last bucket's pushes count
        at its index, so it is exact while no τ exceeded ``histogram_buckets`` − 2."""
        return sum(tau * n for tau, n in enumerate(self.staleness_histogram))

    def count_pull(self, num_bytes: int) -> None:
        """A pull of ``num_bytes`` payload bytes completed."""
        self.pulls += 1
        self.bytes_pulled += num_bytes

    def to_meta(self) -> dict[str, int]:
        """The counters for a checkpoint (``meta["counters"]``)."""
        return {name: getattr(self, name) for name in COUNTER_NAMES}

    def load_meta(self, counters: dict[str, int], histogram: list[int]) -> None:
        """Restore from a checkpoint; a histogram of another length is cut or zero-padded."""
        for name in COUNTER_NAMES:
            if name in counters:
                setattr(self, name, counters[name])
        n = len(self.staleness_histogram)
        self.staleness_histogram = (list(histogram) + [0] * n)[:n]
