"""The parameter server's state, free of network code: it builds the parts (callers use
them directly) and adds what spans several: Join, Heartbeat, Leave, Status, ReportEval,
the pull's header, the sync-mode calls' mode check. docs/architecture.md, "The server's rooms".
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import math
import time
from collections.abc import Callable

import torch

from asyncdiloco.algo.outer import PseudoGradientMonitor, describe
from asyncdiloco.algo.schedule import GroupGate
from asyncdiloco.errors import quoted
from asyncdiloco.ps.books import Joined, PushOutcome, Vote, WorkerRecord
from asyncdiloco.ps.config import ServerConfig
from asyncdiloco.ps.core import CoreParts, Observer, mode_mismatch
from asyncdiloco.ps.durable.durability import Durability
from asyncdiloco.ps.pull.snapshots import PullSource, Snapshots
from asyncdiloco.ps.push.apply import InitialParameters, PseudoGradient
from asyncdiloco.ps.push.intake import PushIntake, PushKind
from asyncdiloco.ps.registry import check_rate
from asyncdiloco.ps.sync.long_poll import NO_WATCH, CallWatch
from asyncdiloco.ps.sync.quorum import Assignment, Decision, QuorumManager, QuorumMiss
from asyncdiloco.ps.sync.rounds import SyncRounds
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.tensors import Manifest

log = logging.getLogger(__name__)

INITIAL, PSEUDO_GRADIENT = pb.PUSH_KIND_INITIAL_PARAMETERS, pb.PUSH_KIND_PSEUDO_GRADIENT

__all__ = ["Joined", "ParameterServerState", "PushOutcome", "WorkerRecord"]


@functools.cache
def server_version() -> str:
    """The installed asyncdiloco package's version ("unknown" when not installed)."""
    try:
        return importlib.metadata.version("asyncdiloco")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class ParameterServerState:
    """Global model, outer optimizer, version, workers and counters (see the module docstring).

    Args:
        config: the server configuration.
        clock: monotonic seconds (injectable for tests and the simulator): leases, rates,
            groups and rounds.
        wall_clock: wall-clock seconds (``time.time``; injectable for tests): the workers'
            last contacts in checkpoints and the log, which must outlive a restart.

    Attributes (the parts; callers use the one that owns the thing):
        model: θ, the outer optimizer, the version, the manifest (model.py).
        registry: the worker table (registry.py). counters: the status numbers (core.py).
        intake: a push's checks, receipt and reply (push/intake.py).
        snapshots: what pulls are served (pull/snapshots.py).
        rounds: sync mode's rounds (sync/rounds.py; None in async mode), ``quorum`` its
            ``QuorumManager``.
        durability: checkpoint copies, restore and replay (durable/durability.py).
    """

    def __init__(
        self,
        config: ServerConfig,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.clock = clock
        self.started = clock()
        #: Push replies held per group (schedule.py); sync mode has rounds instead.
        self.groups = GroupGate(config.grouping if config.mode == "async" else "off", clock)
        self.monitor = PseudoGradientMonitor()
        core = CoreParts.build(config, clock, self.groups.window.mode, wall_clock)
        self.locks, self.model, self.registry, self.counters = core.locks, core.model, core.registry, core.counters
        #: Timings of the slow steps and the initialization event, for metrics and health (core.py).
        self.observer: Observer = core.observer
        self.snapshots = Snapshots(config, self.model, self.locks, clock)
        initial = InitialParameters(core)
        kinds: dict[int, PushKind]
        self.rounds: SyncRounds | None = None
        pseudo = PseudoGradient(core, self.snapshots, self.groups, self.monitor)
        #: what the log replays: every kind a server of either mode wrote (a sync server
        #: restores an async run's checkpoint and log, and goes on in rounds from its version)
        replayers: dict[int, PushKind] = {INITIAL: initial, PSEUDO_GRADIENT: pseudo}
        if config.mode == "async":
            kinds = dict(replayers)
        else:
            self.rounds = SyncRounds(core, live_worker_ids=self.live_worker_ids, snapshots=self.snapshots)
            kinds = {INITIAL: initial, pb.PUSH_KIND_ROUND_RESULT: self.rounds.round_result}
            replayers[pb.PUSH_KIND_ROUND_RESULT] = self.rounds.round_result
        #: Sync mode's rounds (None in async mode).
        self.quorum: QuorumManager | None = self.rounds.quorum if self.rounds is not None else None
        self.intake = PushIntake(config, self.locks, self.registry, self.counters, self.groups, kinds)
        self.snapshots.pool = self.intake.pool  # an apply's Δ buffer takes the version it replaces
        self.durability = Durability(core, self.snapshots, replayers=replayers, rounds=self.rounds)
        #: The bulk data channel's port (transport/bulk.py), set by server.py; 0 = none offered.
        self.bulk_port = 0

    @property
    def version(self) -> int:
        """V: pseudo-gradients applied (async) or rounds committed (sync)."""
        return self.model.version

    @property
    def params(self) -> torch.Tensor | None:
        """θ, float32 (N,); None until initialized."""
        return self.model.params

    @property
    def initialized(self) -> bool:
        """True once a worker pushed the initial parameters."""
        return self.model.initialized

    def _sync(self, worker_id: int, what: str) -> SyncRounds:
        """Sync mode's rounds, or the refusal of a sync-mode call on an async server (the
        caller's lease is renewed first: an unknown worker is told so before the mode)."""
        if self.rounds is None:
            with self.locks.books:
                self.registry.touch(worker_id)
            raise mode_mismatch(self.config.mode, what)
        return self.rounds

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
                if self.registry.workers.get(worker_id) is not None:
                    self.registry.report_rate(worker_id, steps_per_s)

    # ------------------------------------------------------------- workers
    def join(self, manifest: Manifest, worker_name: str = "", steps_per_s: float = 0.0) -> tuple[int, bool, int]:
        """``join_worker`` as (worker_id, initialize, version)."""
        joined = self.join_worker(manifest, worker_name, steps_per_s)
        return joined.worker_id, joined.initialize, joined.version

    def join_worker(
        self, manifest: Manifest, worker_name: str = "", steps_per_s: float = 0.0, ranks: int = 1, region: bool = False
    ) -> Joined:
        """``join`` with everything ``JoinReply`` says (registry.py ``WorkerRegistry.join``); a
        resumed worker's old session ends at once (groups and rounds stop waiting for it).
        ``ranks``: its torchrun group's size; ``region``: a regional server joins."""
        with self.locks.books:
            joined = self.registry.join(manifest, worker_name, steps_per_s, ranks, region)
            expected = self.registry.expected(self.clock()) if joined.resumed else set()
        if joined.resumed:  # as after a Leave of the old session
            self.groups.recheck(expected)
            self._withdraw(joined.worker_id)
        return joined

    def heartbeat(self, worker_id: int, steps_per_s: float = 0.0, session_id: int = 0) -> tuple[int, float, bool]:
        """Renew the lease (and take the measured inner-step rate, steps/s, if > 0); returns
        (version, lease seconds, whether this worker must now push the initial parameters).

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
            expected = self.registry.expected(self.clock())
        self.groups.recheck(expected)  # the open group may now hold every expected worker
        self._withdraw(worker_id)

    def _withdraw(self, worker_id: int) -> None:
        if self.rounds is not None:  # its rounds stop waiting for it
            self.rounds.withdraw(worker_id)

    def live_worker_ids(self) -> set[int]:
        """Ids of the workers whose lease is current."""
        with self.locks.books:
            return self.registry.live_ids()

    # ---------------------------------------------------------------- pull
    def open_pull(self, request: pb.PullRequest, max_wait_s: float = math.inf) -> PullSource:
        """What a Pull sends, its header and payload; pair with ``snapshots.close_pull``
        (pull/snapshots.py ``Snapshots.open_pull``); ``max_wait_s``: the longest it may
        wait for a snapshot slot.

        Raises:
            NotInitializedError, ModeMismatchError (a sync-state pull of an async server).
        """
        sync_state = self.rounds.sync_state if self.rounds is not None else None
        return self.snapshots.open_pull(request, self.run_config, sync_state, max_wait_s)

    def record_pull(self, worker_id: int, num_bytes: int) -> None:
        """A pull of ``num_bytes`` payload bytes completed (it renews a live worker's lease)."""
        with self.locks.books:
            self.counters.count_pull(num_bytes)
            rec = self.registry.workers.get(worker_id)
            if rec is not None and rec.alive:
                rec.last_seen = self.clock()

    # -------------------------------------------------------------- status
    def status(self) -> pb.StatusReply:
        """The server's numbers, workers and run config (``StatusReply``)."""
        with self.locks.books:
            now = self.clock()
            self.registry.expire(now)
            opt, stal = describe(self.config.outer)
            manifest, quorum = self.model.manifest, self.quorum
            return pb.StatusReply(
                version=self.version,
                **self.counters.to_meta(),
                staleness_histogram=list(self.counters.staleness_histogram),
                uptime_s=now - self.started,
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
        """Keep an evaluator's held-out ``loss`` (nats per token, over ``num_tokens``) of the
        global model at ``version`` (ReportEval); returns the point kept, stamped with the
        seconds since start. Raises InvalidPayloadError as books.py ``Counters.record_eval``."""
        with self.locks.books:
            at_s = self.clock() - self.started
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
        """Sync mode: sync/rounds.py ``SyncRounds.request_quorum``.

        Raises:
            ModeMismatchError (async server), UnknownWorkerError, NotInitializedError,
            ManifestMismatchError, InvalidPayloadError.
        """
        rounds = self._sync(worker_id, f"the quorum request of worker {worker_id}")
        return rounds.request_quorum(worker_id, worker_round, manifest_hash, timeout_s, poll, call)

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
        return self._sync(worker_id, f"the commit vote of worker {worker_id}").commit(vote, timeout_s, poll, call)

    def store(self, request: pb.StoreRequest) -> pb.StoreReply:
        """Sync mode: one operation on a quorum's rendezvous store, answered at once
        (sync/rounds.py ``SyncRounds.store``). Raises ModeMismatchError on an async server, or as
        ``SyncRounds.store``."""
        what = f"the rendezvous-store call of worker {request.worker_id}"
        return self._sync(request.worker_id, what).store(request)
