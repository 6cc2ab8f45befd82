"""The parameter server's state and logic, free of any network code: a small façade
over its parts, each in its own module.

``ParameterServerService`` (service.py) and the bulk channel (bulk.py) only decode
requests, call these methods and encode replies, so everything here is testable
in-process (bench/sim.py drives it with a virtual clock). The parts:

* ``GlobalModel`` (model.py): θ (fp32 (N,)), the outer optimizer, the version, the manifest.
* ``WorkerRegistry`` (registry.py): workers, leases, the initializer, DyLU's H_w, grouping.
* ``PushIntake`` (intake.py): header checks, receive buffers, CRC and value checks.
* The push kinds: ``InitialParameters`` and ``PseudoGradient`` (apply.py: staleness,
  the outer step, the version) and ``RoundResult`` (rounds.py).
* The mode (modes.py ``AsyncMode``, rounds.py ``SyncMode``): which kinds are taken, and
  sync mode's rounds around a ``QuorumManager`` (quorum.py).
* ``Snapshots`` (snapshots.py), ``Counters`` (counters.py), and ``Durability``
  (durable.py): checkpoint copies and replay, behind journal.py's typed interface.

Concurrency: records.py ``StateLocks``: ``apply`` serialises whatever touches θ and the
momentum; ``books`` guards the version, workers and counters, held for bookkeeping only,
so Join, Heartbeat and Status never wait for an apply. With a journal attached
(store.py), every Join and push is logged before it changes anything or is acknowledged.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from asyncdiloco.algo.outer import OuterOptimizer, PseudoGradientMonitor, describe
from asyncdiloco.algo.schedule import GroupGate
from asyncdiloco.errors import ModeMismatchError, quoted
from asyncdiloco.ps.apply import InitialParameters, PseudoGradient
from asyncdiloco.ps.buffers import PullSource, Snapshot
from asyncdiloco.ps.config import ServerConfig
from asyncdiloco.ps.durable import Durability
from asyncdiloco.ps.intake import PushIntake
from asyncdiloco.ps.journal import Journal, StateDict
from asyncdiloco.ps.live import LiveView
from asyncdiloco.ps.long_poll import NO_WATCH, CallWatch
from asyncdiloco.ps.modes import AsyncMode, Mode
from asyncdiloco.ps.observer import Observer
from asyncdiloco.ps.parts import CoreParts
from asyncdiloco.ps.quorum import Assignment, Decision, QuorumManager, QuorumMiss
from asyncdiloco.ps.records import AppliedAs, Joined, LoggedJoin, PushOutcome, Vote, WorkerRecord
from asyncdiloco.ps.registry import check_rate
from asyncdiloco.ps.rounds import SyncMode
from asyncdiloco.ps.snapshots import Snapshots
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.tensors import Manifest, PayloadAssembler

log = logging.getLogger(__name__)

INITIAL, PSEUDO_GRADIENT = pb.PUSH_KIND_INITIAL_PARAMETERS, pb.PUSH_KIND_PSEUDO_GRADIENT

__all__ = ["Joined", "ParameterServerState", "PushOutcome", "Snapshot", "WorkerRecord"]


@functools.cache
def server_version() -> str:
    """The installed asyncdiloco package's version ("unknown" when not installed)."""
    try:
        return importlib.metadata.version("asyncdiloco")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _counter(name: str) -> Any:
    """A read-only attribute of the state that reads ``state.counters.<name>``."""
    return property(lambda state: getattr(state.counters, name), doc=f"``Counters.{name}``")


class ParameterServerState:
    """Global model, outer optimizer, version, workers and counters (see the module docstring).

    Args:
        config: the server configuration.
        clock: monotonic seconds (injectable for tests and the simulator): leases, rates,
            groups and rounds.
        wall_clock: wall-clock seconds (``time.time``; injectable for tests): the workers'
            last contacts in checkpoints and the log, which must outlive a restart.
    """

    def __init__(
        self,
        config: ServerConfig,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self._clock = clock
        self._started = clock()
        #: Push replies held per group (schedule.py); sync mode has rounds instead.
        self.groups = GroupGate(config.grouping if config.mode == "async" else "off", clock)
        self.monitor = PseudoGradientMonitor()
        core = CoreParts.build(config, clock, self.groups.window.mode, wall_clock)
        self.locks, self.model, self.registry, self.counters = core.locks, core.model, core.registry, core.counters
        #: Timings of the slow steps and the initialization event, for metrics and health (observer.py).
        self.observer: Observer = core.observer
        self.snapshots = Snapshots(config, self.model, self.locks, clock)
        initial = InitialParameters(core)
        pseudo = PseudoGradient(core, self.snapshots, self.groups, self.monitor)
        self.mode: Mode = (
            AsyncMode({INITIAL: initial, PSEUDO_GRADIENT: pseudo}, touch=self._touch)
            if config.mode == "async"
            else SyncMode(core, initial, live_worker_ids=self.live_worker_ids, snapshots=self.snapshots)
        )
        self.intake = PushIntake(config, self.locks, self.registry, self.counters, self.groups, self.mode)
        self.snapshots.pool = self.intake.pool  # an apply's Δ buffer takes the version it replaces
        replayers: dict[int, Any] = {INITIAL: initial, PSEUDO_GRADIENT: pseudo}
        sync = self.mode if isinstance(self.mode, SyncMode) else None
        if sync is not None:
            replayers[pb.PUSH_KIND_ROUND_RESULT] = sync.round_result
        self.durability = Durability(core, self.snapshots, replayers=replayers, rounds=sync)
        #: The bulk data channel's port (ps/bulk.py), set by server.py; 0 = none offered.
        self.bulk_port = 0

    def _touch(self, worker_id: int) -> None:
        with self.locks.books:
            self.registry.touch(worker_id)

    # ------------------------------------------------------------ the model
    @property
    def manifest(self) -> Manifest | None:
        """The workers' model layout (None before the first Join)."""
        return self.model.manifest

    @property
    def params(self) -> torch.Tensor | None:
        """θ, float32 (N,); None until initialized."""
        return self.model.params

    @property
    def outer(self) -> OuterOptimizer | None:
        """The outer optimizer and its state (None until initialized)."""
        return self.model.outer

    @property
    def version(self) -> int:
        """V: pseudo-gradients applied (async) or rounds committed (sync)."""
        return self.model.version

    @property
    def initialized(self) -> bool:
        """True once a worker pushed the initial parameters."""
        return self.model.initialized

    @property
    def sync_mode(self) -> bool:
        """True for ``ServerConfig.mode == "sync"``."""
        return self.config.mode == "sync"

    @property
    def quorum(self) -> QuorumManager | None:
        """Sync mode's rounds (None in async mode)."""
        return self.mode.quorum

    def clock(self) -> float:
        """The server's monotonic clock, seconds."""
        return self._clock()

    def uptime_s(self) -> float:
        """Seconds since this state was built (the server's clock)."""
        return self._clock() - self._started

    # --------------------------------------------------------- the counters (counters.py)
    applied_pushes = _counter("applied_pushes")
    rejected_pushes = _counter("rejected_pushes")
    duplicate_pushes = _counter("duplicate_pushes")
    bytes_pushed = _counter("bytes_pushed")
    bytes_pulled = _counter("bytes_pulled")
    pulls = _counter("pulls")
    tokens = _counter("tokens")
    staleness_histogram = _counter("staleness_histogram")

    # ------------------------------------------------------- the run config
    def run_config(self, worker_id: int = 0, *, joining: bool = False) -> pb.RunConfig:
        """The run config for ``worker_id`` (its H_w under DyLU; H for observers);
        ``joining``: for its JoinReply (registry.py ``told_wait_s``)."""
        with self.locks.books:
            return self.registry.run_config(worker_id, self.bulk_port, joining=joining)

    def local_steps_for(self, worker_id: int) -> int:
        """H_w, the inner steps ``worker_id`` should run in its current round."""
        with self.locks.books:
            return self.registry.local_steps(worker_id)

    def group_max_wait_s(self) -> float:
        """The longest a push reply may be held now, seconds (RunConfig.group_max_wait_s)."""
        with self.locks.books:
            return self.registry.group_max_wait_s()

    def report_rate(self, worker_id: int, steps_per_s: float) -> None:
        """A rate v_w (inner steps/s) the worker measured on its own compute (DyLU; ignored if ≤ 0)."""
        if steps_per_s > 0:
            with self.locks.books:
                if self.registry.get(worker_id) is not None:
                    self.registry.report_rate(worker_id, steps_per_s)

    def mode_mismatch_error(self, what: str) -> ModeMismatchError:
        """The refusal for a request of the other mode; ``what`` names the request."""
        return self.mode.mismatch(what)

    # ------------------------------------------------------------- workers
    def join(self, manifest: Manifest, worker_name: str = "", steps_per_s: float = 0.0) -> tuple[int, bool, int]:
        """Register a worker whose model has ``manifest`` (and, if > 0, the inner-step rate
        it measured, steps/s, for DyLU).

        Returns:
            (worker_id, initialize, version): ``initialize`` is True when this worker
            must push the initial parameters.
        Raises:
            ManifestMismatchError: the manifest differs from the server's.
            PayloadTooLargeError: the model exceeds ``max_payload_bytes``.
        """
        joined = self.join_worker(manifest, worker_name, steps_per_s)
        return joined.worker_id, joined.initialize, joined.version

    def join_worker(
        self, manifest: Manifest, worker_name: str = "", steps_per_s: float = 0.0, ranks: int = 1, region: bool = False
    ) -> Joined:
        """``join`` with everything ``JoinReply`` says: a non-empty ``worker_name`` of a
        registered worker (alive, left or expired) resumes it under its old id, with its
        counters and remembered push outcomes; the old session ends at once (the groups,
        Delayed Nesterov's N and sync mode's rounds stop waiting for it) and the new one
        is a fresh join (rate, grouping). ``ranks``: the processes of its torchrun group
        (informational, shown by Status). ``region``: a regional server joins (its pushes
        are averaged in over the live regions: apply.py). Raises as ``join``."""
        with self.locks.books:
            joined = self.registry.join(manifest, worker_name, steps_per_s, ranks, region)
            expected = self.registry.expected(self._clock()) if joined.resumed else set()
        if joined.resumed:  # as after a Leave of the old session
            self.groups.recheck(expected)
            self.mode.on_leave(joined.worker_id)
        return joined

    def heartbeat(self, worker_id: int, steps_per_s: float = 0.0, session_id: int = 0) -> tuple[int, float, bool]:
        """Renew the lease (and take the worker's measured inner-step rate, steps/s, if > 0);
        ``session_id``: the caller's session (``JoinReply.session_id``; 0: not checked).

        Returns:
            (version, seconds until the lease expires, whether this worker must now push
            the initial parameters).
        Raises:
            UnknownWorkerError: the worker left or its lease lapsed.
            WorkerSupersededError: a later Join under the worker's name started a newer session.
            InvalidPayloadError: ``steps_per_s`` is NaN, infinite or negative (the lease is not renewed).
        """
        check_rate(steps_per_s)  # before the lease is renewed: nothing half applied
        with self.locks.books:
            self.registry.touch(worker_id, session_id)
            self.registry.report_rate(worker_id, steps_per_s)
            initialize = not self.initialized and self.registry.claim_initializer(worker_id)
            return self.version, self.config.lease_s, initialize

    def leave(self, worker_id: int, session_id: int = 0) -> None:
        """The worker left: its lease ends, the groups and rounds stop waiting for it (the
        Leave of a superseded session, ``session_id`` not the newest, changes nothing)."""
        with self.locks.books:
            if not self.registry.leave(worker_id, session_id):
                return
            expected = self.registry.expected(self._clock())
        self.groups.recheck(expected)  # the open group may now hold every expected worker
        self.mode.on_leave(worker_id)

    def live_worker_ids(self) -> set[int]:
        """Ids of the workers whose lease is current."""
        with self.locks.books:
            return self.registry.live_ids()

    # ---------------------------------------------------------------- pull
    def acquire_snapshot(self) -> Snapshot | LiveView:
        """The newest θ for one pull (read in place, or encoded); pair with
        ``release_snapshot`` (snapshots.py ``Snapshots.acquire``).

        Raises:
            NotInitializedError: no worker has pushed the initial parameters yet.
        """
        return self.snapshots.acquire()

    def release_snapshot(self, snap: Snapshot | LiveView) -> None:
        """A pull of ``snap`` (from ``acquire_snapshot``) ended, completed or not."""
        self.snapshots.release(snap)

    def open_pull(self, request: pb.PullRequest, max_wait_s: float = math.inf) -> PullSource:
        """What a Pull sends, its header and payload; pair with ``close_pull`` (snapshots.py
        ``Snapshots.open_pull``); ``max_wait_s``: the longest it may wait for a snapshot slot.

        Raises:
            NotInitializedError, ModeMismatchError (a sync-state pull of an async server).
        """
        return self.snapshots.open_pull(request, self.mode, self.run_config, max_wait_s)

    def close_pull(self, source: PullSource) -> None:
        """A pull from ``open_pull`` ended: its snapshot or view may be freed."""
        self.snapshots.close_pull(source)

    def record_pull(self, worker_id: int, num_bytes: int) -> None:
        """A pull of ``num_bytes`` payload bytes completed (it renews a live worker's lease)."""
        with self.locks.books:
            self.counters.count_pull(num_bytes)
            rec = self.registry.get(worker_id)
            if rec is not None and rec.alive:
                rec.last_seen = self._clock()

    # ---------------------------------------------------------------- push
    def begin_push(
        self, header: pb.PushHeader, is_active: Callable[[], bool] | None = None
    ) -> PayloadAssembler | PushOutcome:
        """Check a push header and take a receive buffer (intake.py ``PushIntake.begin``)."""
        return self.intake.begin(header, is_active)

    def apply_push(self, header: pb.PushHeader, payload: torch.Tensor) -> PushOutcome:
        """Apply a complete, CRC-checked payload with its kind's apply (intake.py ``PushIntake.apply``)."""
        return self.intake.apply(header, payload)

    def receive_push(
        self,
        header: pb.PushHeader,
        fill: Callable[[PayloadAssembler], None],
        drain: Callable[[], None],
        is_active: Callable[[], bool] | None = None,
    ) -> PushOutcome:
        """One whole push, whatever carries it (intake.py ``PushIntake.receive``)."""
        return self.intake.receive(header, fill, drain, is_active)

    def push(
        self,
        payload: torch.Tensor,
        *,
        worker_id: int,
        push_id: int,
        base_version: int = 0,
        num_local_steps: int = 0,
        num_tokens: int = 0,
        kind: pb.PushKind = pb.PUSH_KIND_PSEUDO_GRADIENT,
        compute_s: float = 0.0,
        session_id: int = 0,
        last: bool = False,
    ) -> PushOutcome:
        """An in-process push (the simulator, benchmarks and tests): the payload is cut
        into chunks exactly as the wire carries it, with every check the servicer applies.

        Args:
            payload: 1-D uint8 CPU tensor in the manifest's layout (or the wire codec's).
            worker_id, push_id, base_version, num_local_steps, num_tokens, kind,
            compute_s, session_id, last: the ``PushHeader`` fields (compute_s in seconds;
            ``last``: the worker's closing push, outer.py ``step_closing``).
        Returns:
            The outcome (``duplicate`` for a retried push_id).
        Raises:
            The exceptions of ``begin_push``, ``PayloadAssembler`` and ``apply_push``.
        """
        header = pb.PushHeader(
            worker_id=worker_id,
            push_id=push_id,
            base_version=base_version,
            num_local_steps=num_local_steps,
            num_tokens=num_tokens,
            kind=kind,
            compute_s=compute_s,
            session_id=session_id,
            last=last,
        )
        return self.intake.receive_in_process(header, payload)

    def record_rejected(self, worker_id: int, reason: str = "cut_off") -> None:
        """A push of ``worker_id`` was refused with the exception's ``reason`` code
        (errors.py), or cut off mid-stream ("cut_off")."""
        self.intake.count_rejected(worker_id)
        with self.locks.books:
            self.counters.note_refusal(reason)

    def record_duplicate(self) -> None:
        """A retried push was answered with its original outcome."""
        self.intake.count_duplicate()

    def finish_push(
        self, outcome: PushOutcome, worker_id: int = 0, hold: bool = True, max_wait_s: float = math.inf
    ) -> pb.PushReply:
        """The reply to an applied or retried push, held for its group (intake.py ``PushIntake.reply``)."""
        return self.intake.reply(outcome, worker_id, hold, max_wait_s)

    # -------------------------------------------------------------- status
    def status(self) -> pb.StatusReply:
        """The server's numbers, workers and run config (``StatusReply``)."""
        with self.locks.books:
            now = self._clock()
            self.registry.expire(now)
            opt, stal = describe(self.config.outer)
            manifest, quorum = self.model.manifest, self.mode.quorum
            return pb.StatusReply(
                version=self.version,
                **self.counters.to_meta(),
                staleness_histogram=list(self.counters.staleness_histogram),
                uptime_s=now - self._started,
                initialized=self.initialized,
                workers=self.registry.statuses(now),
                run_config=self.registry.run_config(0, self.bulk_port),
                outer_optimizer=opt,
                staleness_weighting=stal,
                manifest=manifest.to_proto() if manifest else None,
                rounds_committed=quorum.rounds_committed if quorum else 0,
                rounds_failed=quorum.rounds_failed if quorum else 0,
                group_size_histogram=self.groups.size_histogram(),
                divergence_warnings=self.monitor.warnings,
                pushes_per_s=self.counters.pushes_per_s(),
                evals=list(self.counters.evals),
                server_version=server_version(),
            )

    def report_eval(self, version: int, loss: float, num_tokens: int, evaluator: str = "") -> pb.EvalPoint:
        """Keep an evaluator's held-out loss of the global model (ReportEval); nothing
        else changes.

        Args:
            version: the global version evaluated, 0 <= version <= the current one.
            loss: mean held-out loss, nats per token; in [0, counters.py ``MAX_EVAL_LOSS``].
            num_tokens: tokens it was measured over, >= 1.
            evaluator: a name for the dashboard (counters.py ``MAX_EVALUATOR_CHARS`` at most).
        Returns:
            The point kept (``StatusReply.evals``), stamped with the seconds since start.
        Raises:
            InvalidPayloadError: a value out of those ranges; nothing is kept.
        """
        with self.locks.books:
            at_s = self._clock() - self._started
            point = pb.EvalPoint(version=version, loss=loss, num_tokens=num_tokens, evaluator=evaluator, at_s=at_s)
            self.counters.record_eval(point, self.version)
        name = quoted(evaluator) if evaluator else "unnamed"
        log.info("eval of version %d: loss %.4f over %d tokens (%s)", version, loss, num_tokens, name)
        return point

    # ------------------------------------------------------------ sync mode
    def request_quorum(
        self,
        worker_id: int,
        worker_round: int,
        manifest_hash: str,
        timeout_s: float,
        poll: bool = False,
        call: CallWatch = NO_WATCH,
    ) -> Assignment | QuorumMiss:
        """Sync mode: block up to ``timeout_s`` seconds for the next round's quorum (a
        ``QuorumMiss`` when none formed; with ``poll`` a long poll's short hold, a
        pending ``QuorumMiss`` meaning "ask again"; rounds.py ``SyncMode.request_quorum``).

        Raises:
            ModeMismatchError (async server), UnknownWorkerError, NotInitializedError,
            ManifestMismatchError, InvalidPayloadError.
        """
        return self.mode.request_quorum(worker_id, worker_round, manifest_hash, timeout_s, poll, call)

    def commit(
        self,
        worker_id: int,
        quorum_id: int,
        *,
        success: bool,
        total_weight: float,
        num_tokens: int,
        num_local_steps: int,
        reason: str,
        timeout_s: float,
        poll: bool = False,
        call: CallWatch = NO_WATCH,
        compute_s: float = 0.0,
    ) -> Decision | None:
        """Sync mode: vote, then block up to ``timeout_s`` seconds for the decision (None:
        not decided yet; ask again); ``compute_s``: seconds of the member's own compute over
        its ``num_local_steps`` (0: not measured). Raises as ``request_quorum``, or
        RoundRefusedError."""
        vote = Vote(worker_id, quorum_id, success, total_weight, num_tokens, num_local_steps, reason, compute_s)
        return self.mode.commit(vote, timeout_s, poll, call)

    def store(self, request: pb.StoreRequest) -> pb.StoreReply:
        """Sync mode: one operation on a quorum's rendezvous store, answered at once
        (rounds.py ``SyncMode.store``). Raises ModeMismatchError on an async server, or as
        ``SyncMode.store``."""
        if not isinstance(self.mode, SyncMode):
            with self.locks.books:
                self.registry.touch(request.worker_id)
            raise self.mode.mismatch(f"the rendezvous-store call of worker {request.worker_id}")
        return self.mode.store(request)

    def sync_state(self) -> tuple[int, torch.Tensor]:
        """Sync mode, for healing: (round, θ then m as float32 bytes, uint8) (rounds.py)."""
        return self.mode.sync_state()

    # ---------------------------------------------------- durability (store.py)
    @property
    def journal(self) -> Journal | None:
        """The write-ahead log every change is logged into (None: in memory only)."""
        return self.durability.journal.journal

    @journal.setter
    def journal(self, journal: Journal | None) -> None:
        self.durability.journal.journal = journal

    def attach_journal(self, journal: Journal) -> None:
        """Log every Join and push into ``journal`` from now on."""
        self.durability.attach_journal(journal)

    def detach_journal(self, then: Callable[[], None] | None = None) -> None:
        """Stop logging; ``then`` runs under the books lock, so no append interleaves with it."""
        self.durability.detach_journal(then)

    def state_dict(self, while_locked: Callable[[], int] | None = None) -> StateDict:
        """A consistent copy of the durable state (durable.py ``Durability.state_dict``)."""
        return self.durability.state_dict(while_locked)

    def load_state_dict(self, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
        """Restore a fresh state from a checkpoint (durable.py ``Durability.load_state_dict``)."""
        self.durability.load_state_dict(meta, tensors)

    def replay_join(self, join: LoggedJoin) -> None:
        """Redo a logged Join (durable.py ``Durability.replay_join``)."""
        self.durability.replay_join(join)

    def replay_seen(self, worker_id: int, seen_unix_s: float) -> None:
        """A logged push shows the worker alive at ``seen_unix_s`` (wall clock)."""
        self.durability.replay_seen(worker_id, seen_unix_s)

    def replay_push(self, header: pb.PushHeader, payload: torch.Tensor, applied: AppliedAs) -> None:
        """Redo a logged push (durable.py ``Durability.replay_push``)."""
        self.durability.replay_push(header, payload, applied)
