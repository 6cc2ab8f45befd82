"""The worker table (``WorkerRegistry``): Joins, leases, the initializer, DyLU's H_w
(Liu et al. 2024, arXiv 2401.09135, Eq. 6), the grouping window (Alg. 2) and the
``RunConfig``; called with the books lock held. docs/algorithms.md, docs/protocol.md.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from asyncdiloco.algo.schedule import StepRateMeter, auto_window_s, dylu_local_steps
from asyncdiloco.errors import InvalidPayloadError, PayloadTooLargeError, UnknownWorkerError, WorkerSupersededError
from asyncdiloco.ps.books import Joined, JournalSlot, LoggedJoin, PushOutcome, WorkerRecord
from asyncdiloco.ps.config import ServerConfig
from asyncdiloco.ps.model import GlobalModel
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.names import check_worker_name
from asyncdiloco.wire.tensors import Manifest

log = logging.getLogger(__name__)


#: ``WorkerStatus.state``: a push group waits for it; alive but not pushing; gone.
WORKER_STATES = ("training", "silent", "left", "expired")


def worker_state(rec: WorkerRecord, expected: set[int]) -> str:
    """One of ``WORKER_STATES``: "training" (among ``expected``, the workers a push
    group waits for: pushed or joined within about two of its rounds), "silent" (lease
    current, stopped pushing), "left" (called Leave) or "expired" (lease lapsed)."""
    if rec.alive:
        return "training" if rec.worker_id in expected else "silent"
    return "left" if rec.left else "expired"


def check_rate(steps_per_s: float) -> None:
    """Raise InvalidPayloadError for an inner-step rate that is NaN, infinite or negative (0: none)."""
    if not (math.isfinite(steps_per_s) and steps_per_s >= 0):
        raise InvalidPayloadError(
            f"steps_per_s is {steps_per_s}; a reported inner-step rate must be a finite number of steps per "
            f"second >= 0 (0: not measured); send the rate measured over the worker's inner steps"
        )


class WorkerRegistry:
    """Registered workers and their leases (see the module docstring).

    Args:
        clock: the server's monotonic clock, seconds.
        grouping: "off", "window" or "barrier" (always "off" in sync mode).
        journal: where each Join is logged before the worker learns its id.
        wall_clock: wall-clock seconds, for last contacts that outlive a restart.
    """

    def __init__(
        self,
        config: ServerConfig,
        clock: Callable[[], float],
        grouping: str,
        model: GlobalModel,
        journal: JournalSlot,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.clock = clock
        self.wall_clock = wall_clock
        self.grouping = grouping
        self.model = model
        self.journal = journal
        self.workers: dict[int, WorkerRecord] = {}
        #: Names the workers gave → their id (a Join under one resumes that id).
        self.names: dict[str, int] = {}
        self.next_worker_id = 1
        #: The worker told to push the initial parameters (None: none chosen yet).
        self.initializer: int | None = None
        self.rates = StepRateMeter()
        #: Worker id → the ``group_max_wait_s`` its newest reply told it (``told_wait_s``).
        self._told_wait_s: dict[int, float] = {}
        #: Sync mode: member id → the H_w its newest round handed it (``plan_sync_round``).
        self._sync_steps: dict[int, int] = {}
        #: Worker id → its pushes in progress (``begin_call``): no lease lapses during one.
        self._in_call: dict[int, int] = {}

    # ------------------------------------------------------------ joins and leases
    def join(
        self, manifest: Manifest, worker_name: str = "", steps_per_s: float = 0.0, ranks: int = 1, region: bool = False
    ) -> Joined:
        """Register a worker whose model has ``manifest`` (and, if > 0, the inner-step rate
        v_w it measured, steps/s, for DyLU); logged before it is answered. A non-empty
        ``worker_name`` that a registered worker gave (alive, left or expired) resumes
        it: same id, counters and remembered push outcomes; the old session's lease ends.

        Raises:
            ManifestMismatchError: the manifest differs from the server's.
            PayloadTooLargeError: the model exceeds ``max_payload_bytes``.
            ConfigError: ``worker_name`` is not a valid name (wire/names.py).
            InvalidPayloadError: ``steps_per_s`` is NaN, infinite or negative (``check_rate``).
        ``region``: a regional server joins (its pushes are averaged in: apply.py).
        """
        if manifest.total_bytes > self.config.max_payload_bytes:
            raise PayloadTooLargeError(
                f"model of {manifest.total_bytes} bytes exceeds max_payload_bytes={self.config.max_payload_bytes}; "
                f"start the server with a larger --max-payload-bytes"
            )
        check_worker_name(worker_name)
        check_rate(steps_per_s)
        now = self.clock()
        self.expire(now)
        old = self.by_name(worker_name)
        replace = self._takes_manifest(manifest, old)
        initialized = self.model.initialized
        worker_id = old.worker_id if old is not None else self.next_worker_id
        # A resumed initializer is told again (its previous session may have died before pushing).
        initialize = not initialized and (self.initializer_gone() or self.initializer == worker_id)
        name = worker_name or f"worker-{worker_id}"
        named = bool(worker_name)
        self.journal.log_join(
            LoggedJoin(worker_id, name, initialize, manifest if replace else None, named, self.wall_clock(), region)
        )
        if old is not None:
            self.rates.forget(worker_id)  # the new session's rate is measured afresh
            self._sync_steps.pop(worker_id, None)
        self.register(worker_id, name, initialize, manifest if replace else None, now, named=named, region=region)
        self.rates.report(worker_id, steps_per_s)
        self.workers[worker_id].ranks = max(1, ranks)  # not logged: the next Join says it again
        last_push_id = old.last_push_id if old is not None else 0
        joined = "joined" if old is None else f"resumed (last push id {last_push_id})"
        initializes = " and initializes the global model" if initialize else ""
        log.info("worker %d (%s) %s at version %d%s", worker_id, name, joined, self.model.version, initializes)
        return Joined(
            worker_id, initialize, self.model.version, old is not None, last_push_id, self.workers[worker_id].session
        )

    def _takes_manifest(self, manifest: Manifest, old: WorkerRecord | None) -> bool:
        """Whether a Join's ``manifest`` becomes the server's (provisional until the initial
        parameters arrive, while a worker that brought it lives); else ManifestMismatchError."""
        known = self.model.manifest
        others_alive = any(r.alive for r in self.workers.values() if r is not old)
        replace = known is None or (not self.model.initialized and not others_alive)
        if known is not None and not replace:
            manifest.check_same(known)
        return replace

    def by_name(self, name: str) -> WorkerRecord | None:
        """The registered worker (alive or not) that gave ``name``; None for an empty or unknown name."""
        worker_id = self.names.get(name) if name else None
        return self.workers.get(worker_id) if worker_id is not None else None

    def register(
        self,
        worker_id: int,
        name: str,
        initialize: bool,
        manifest: Manifest | None,
        now: float,
        *,
        named: bool = False,
        silent_s: float = 0.0,
        region: bool = False,
    ) -> None:
        """Start a session of a worker (a Join, or its replay): a new record, or a new
        session of a known id (its counters and outcomes stay). ``silent_s``: seconds
        since it was last seen (a replayed Join's age; 0 for a live Join)."""
        if manifest is not None:
            self.model.manifest = manifest
        self.next_worker_id = max(self.next_worker_id, worker_id + 1)
        seen = now - silent_s
        rec = self.workers.get(worker_id)
        if rec is None:
            rec = self.workers[worker_id] = WorkerRecord(worker_id, name, seen, seen, named=named)
        else:
            rec.name, rec.named, rec.alive, rec.left = name, named, True, False
            rec.joined_at = rec.last_seen = seen
        rec.region = region
        rec.session += 1  # a replayed Join counts too, so a restart gives the same sessions
        if named:
            self.names[name] = worker_id
        self.rates.start(worker_id, now)
        if initialize:
            self.initializer = worker_id

    def replay_join(self, join: LoggedJoin) -> None:
        """Redo a logged Join; ``join.seen_unix_s`` (wall clock) dates it, so a worker
        that joined before the restart keeps only the rest of its lease."""
        silent_s = self.silent_s(join.seen_unix_s)
        self.register(
            join.worker_id,
            join.name,
            join.initialize,
            join.manifest,
            self.clock(),
            named=join.named,
            silent_s=silent_s,
            region=join.region,
        )

    def replay_seen(self, worker_id: int, seen_unix_s: float) -> None:
        """A logged push shows the worker alive at ``seen_unix_s`` (wall clock)."""
        rec = self.workers.get(worker_id)
        if rec is not None:
            rec.last_seen = max(rec.last_seen, self.clock() - self.silent_s(seen_unix_s))

    def silent_s(self, seen_unix_s: float) -> float:
        """Seconds from ``seen_unix_s`` (wall clock) to now; 0 when the wall clock went back."""
        return max(0.0, self.wall_clock() - seen_unix_s)

    def begin_call(self, worker_id: int) -> None:
        """A push of ``worker_id`` is in progress: its lease does not lapse until ``end_call``."""
        self._in_call[worker_id] = self._in_call.get(worker_id, 0) + 1

    def end_call(self, worker_id: int) -> None:
        """A push that ``begin_call`` announced ended: a live worker's lease runs afresh."""
        left = self._in_call.get(worker_id, 0) - 1
        if left > 0:
            self._in_call[worker_id] = left
        else:
            self._in_call.pop(worker_id, None)
        rec = self.workers.get(worker_id)
        if rec is not None and rec.alive:
            rec.last_seen = max(rec.last_seen, self.clock())

    def expire(self, now: float) -> None:
        """End the lease of every worker silent for longer than ``lease_s`` seconds (a
        worker with a push in progress is not silent: ``begin_call``)."""
        for rec in self.workers.values():
            if rec.alive and now - rec.last_seen > self.config.lease_s and rec.worker_id not in self._in_call:
                rec.alive = False
                silent_s = now - rec.last_seen
                log.warning("worker %d (%s): lease expired after %.1f s of silence", rec.worker_id, rec.name, silent_s)

    def check_session(self, worker_id: int, session_id: int) -> None:
        """Raise WorkerSupersededError for a call of a superseded session (0: not checked)."""
        rec = self.workers.get(worker_id)
        if rec is not None and session_id and session_id != rec.session:
            raise WorkerSupersededError(
                f"worker {worker_id} ({rec.name!r}): session {session_id} was superseded by a later Join under the "
                f"same name (session {rec.session}); two processes must not share a worker name: stop this one, "
                f"or give each process its own --worker-name"
            )

    def touch(self, worker_id: int, session_id: int = 0) -> WorkerRecord:
        """Renew a live worker's lease; ``session_id``: the caller's session (0: not checked).

        Raises:
            UnknownWorkerError: the id was never issued, or the worker left or its lease lapsed.
            WorkerSupersededError: the caller's session is not the worker's newest.
        """
        now = self.clock()
        self.expire(now)
        self.check_session(worker_id, session_id)
        rec = self.workers.get(worker_id)
        if rec is None:
            issued = f"ids 1..{self.next_worker_id - 1} were issued" if self.next_worker_id > 1 else "no ids issued yet"
            raise UnknownWorkerError(f"worker_id {worker_id} is unknown to this server ({issued}); call Join again")
        if not rec.alive:
            raise UnknownWorkerError(
                f"worker_id {worker_id} is no longer registered (it left, or was silent longer than "
                f"lease_s={self.config.lease_s:g}); call Join again"
            )
        rec.last_seen = now
        return rec

    def leave(self, worker_id: int, session_id: int = 0) -> bool:
        """The worker left cleanly: its lease ends now. The Leave of a superseded session
        (``session_id`` not the newest; 0: not checked) ends nothing. True when it ended a lease."""
        rec = self.workers.get(worker_id)
        if rec is not None and session_id and session_id != rec.session:
            log.warning("worker %d (%r): Leave of superseded session %d ignored", worker_id, rec.name, session_id)
            return False
        if rec is not None:
            rec.alive, rec.left = False, rec.left or rec.alive  # a lapsed lease stays "expired"
            self.rates.forget(worker_id)
            self._sync_steps.pop(worker_id, None)
            log.info("worker %d (%s) left", worker_id, rec.name)
        return rec is not None

    def live_ids(self) -> set[int]:
        """Ids of the workers whose lease is current."""
        self.expire(self.clock())
        return {w for w, r in self.workers.items() if r.alive}

    def live_regions(self) -> int:
        """R: regional servers whose lease is current (at least 1)."""
        return max(1, sum(1 for r in self.workers.values() if r.alive and r.region))

    # ------------------------------------------------------------- initializer
    def initializer_gone(self) -> bool:
        """True when no live worker is the initializer (none chosen, or it is gone)."""
        holder = self.workers.get(self.initializer) if self.initializer else None
        return holder is None or not holder.alive

    def claim_initializer(self, worker_id: int) -> bool:
        """While no parameters exist: make ``worker_id`` the initializer if the chosen one
        is gone (left, or its lease lapsed). True when ``worker_id`` must initialize."""
        if self.initializer_gone():
            if self.initializer is not None:
                log.warning("initializer %s is gone; worker %d initializes instead", self.initializer, worker_id)
            self.initializer = worker_id
        return self.initializer == worker_id

    # ------------------------------------------------------- DyLU and grouping
    def report_rate(self, worker_id: int, steps_per_s: float) -> None:
        """A rate v_w (inner steps/s) the worker measured itself (0: none), clamped by
        schedule.py ``StepRateMeter``. Raises InvalidPayloadError as ``check_rate``."""
        check_rate(steps_per_s)
        self.rates.report(worker_id, steps_per_s)

    def live_rates(self) -> dict[int, float]:
        """v_w of each live worker with a known rate, inner steps per second."""
        return {w: v for w, v in self.rates.rates.items() if w in self.workers and self.workers[w].alive}

    def local_steps(self, worker_id: int) -> int:
        """H_w: DyLU (Liu et al. 2024, Eq. 6) over the live workers' measured rates; H
        when DyLU is off or the worker's rate is unknown. Sync mode: H with
        ``--sync-local-steps fixed``; with ``adaptive`` the H_w its newest round's
        decision handed it (``plan_sync_round``), or, before its first round (a joiner),
        DyLU over the live workers' rates."""
        if self.config.mode == "sync":
            if self.config.sync.local_steps != "adaptive":
                return self.config.local_steps
            told = self._sync_steps.get(worker_id)
            if told is not None:
                return told
        elif not self.config.dylu:
            return self.config.local_steps
        return dylu_local_steps(self.live_rates(), self.config.local_steps).get(worker_id, self.config.local_steps)

    def plan_sync_round(self, members: tuple[int, ...]) -> dict[int, int]:
        """Sync mode, at a round's decision: each member's H_w for its next round,
        remembered. ``fixed``: H. ``adaptive``: H_w = max(1, ⌊v_w / max v · H⌋) over the
        live members with a known rate (Liu et al. 2024, Eq. 6); H when unknown."""
        local_steps = self.config.local_steps
        if self.config.sync.local_steps != "adaptive":
            planned = dict.fromkeys(members, local_steps)
        else:
            live = [w for w in members if w in self.workers and self.workers[w].alive]
            rates = {w: self.rates.rates[w] for w in live if w in self.rates.rates}
            known = dylu_local_steps(rates, local_steps)
            planned = {w: known.get(w, local_steps) for w in members}
        self._sync_steps.update(planned)
        return planned

    def rounds_s(self) -> dict[int, float]:
        """Seconds of a round of each live worker with a known rate: H_w / v_w."""
        rates = self.live_rates()
        steps = dylu_local_steps(rates, self.config.local_steps) if self.config.dylu else {}
        return {w: steps.get(w, self.config.local_steps) / v for w, v in rates.items()}

    def group_window_s(self) -> float:
        """Seconds from a group's first arrival to its deadline ("window" mode): ``grace_s``,
        or auto (``schedule.auto_window_s``); 0 when grouping is off."""
        if self.grouping == "off":
            return 0.0
        if self.config.grace_s is not None:
            return self.config.grace_s
        return auto_window_s(self.live_rates().values(), self.config.local_steps)

    def group_max_wait_s(self) -> float:
        """The longest a push reply is held, seconds: the window, or the barrier's cap
        (``group_max_wait_s``, or auto: the longest round plus the window, ≤ 1 h)."""
        if self.grouping != "barrier":
            return self.group_window_s()
        if self.config.group_max_wait_s is not None:
            return self.config.group_max_wait_s
        longest = max(self.rounds_s().values(), default=30.0)
        return min(3600.0, longest + self.group_window_s())

    def tell_wait_s(self, worker_id: int) -> float:
        """``group_max_wait_s`` for a JoinReply or PushReply to ``worker_id``, remembered as
        what that worker was told (``told_wait_s``), seconds."""
        wait_s = self.group_max_wait_s()
        if worker_id:
            self._told_wait_s[worker_id] = wait_s
        return wait_s

    def told_wait_s(self, worker_id: int) -> float:
        """The longest the server may hold ``worker_id``'s next push reply, seconds: the
        ``group_max_wait_s`` of its newest JoinReply or PushReply (which its push deadline
        covers; one push in flight at a time), else the current one."""
        told = self._told_wait_s.get(worker_id)
        return self.group_max_wait_s() if told is None else told

    def expected(self, now: float) -> set[int]:
        """The live workers a group waits for (and Delayed Nesterov's N, with dn_buffer=0):
        those that pushed within two of their rounds (H_w / v_w) plus the window, or
        joined since; every live worker in sync mode."""
        if self.config.mode == "sync":
            return {w for w, rec in self.workers.items() if rec.alive}
        window = self.group_window_s()
        rounds = self.rounds_s()
        unknown_s = max(rounds.values(), default=math.inf)  # no rate yet: the longest known round
        expected = set()
        for w, rec in self.workers.items():
            if rec.alive and now - max(rec.joined_at, rec.last_push) <= 2 * rounds.get(w, unknown_s) + window:
                expected.add(w)
        return expected

    # ----------------------------------------------- run config, status, checkpoints
    def run_config(self, worker_id: int, bulk_port: int, *, joining: bool = False) -> pb.RunConfig:
        """The run the server dictates to ``worker_id`` (its H_w under DyLU; H for an
        observer, id 0); ``bulk_port``: the bulk data channel's (0: none); ``joining``:
        for its JoinReply (its ``group_max_wait_s`` is remembered, ``told_wait_s``)."""
        sync, outer = self.config.sync, self.config.outer
        return pb.RunConfig(
            local_steps=self.local_steps(worker_id),
            chunk_bytes=self.config.chunk_bytes,
            lease_s=self.config.lease_s,
            max_staleness=outer.max_staleness,
            mode=self.config.mode,
            min_workers=sync.min_workers,
            join_timeout_s=sync.join_timeout_s,
            round_timeout_s=sync.round_timeout_s,
            sync_weighting=sync.weighting,
            sync_local_steps=sync.local_steps if self.config.mode == "sync" else "",
            outer_optimizer=outer.optimizer,
            outer_lr=outer.lr,
            outer_momentum=outer.momentum,
            outer_lr_schedule=outer.lr_schedule,
            outer_lr_warmup_versions=outer.lr_warmup_versions,
            outer_lr_total_versions=outer.lr_total_versions,
            outer_lr_min_ratio=outer.lr_min_ratio,
            wire_codec=self.config.wire_codec,
            codec_block_size=self.config.codec_block_size,
            bulk_port=bulk_port,
            dylu=self.config.dylu,
            grouping=self.grouping,
            group_window_s=self.group_window_s(),
            group_max_wait_s=self.tell_wait_s(worker_id) if joining else self.group_max_wait_s(),
        )

    def statuses(self, now: float) -> list[pb.WorkerStatus]:
        """Every registered worker's row of ``StatusReply.workers`` (leases checked at ``now``)."""
        self.expire(now)
        expected = self.expected(now)
        return [
            pb.WorkerStatus(
                worker_id=r.worker_id,
                worker_name=r.name,
                applied_pushes=r.applied_pushes,
                rejected_pushes=r.rejected_pushes,
                tokens=r.tokens,
                local_steps=r.local_steps,
                last_seen_s=now - r.last_seen,
                alive=r.alive,
                local_steps_per_round=self.local_steps(r.worker_id),
                steps_per_s=self.rates.rates.get(r.worker_id, 0.0),
                mean_staleness=r.staleness_sum / r.staleness_pushes if r.staleness_pushes else 0.0,
                last_staleness=r.last_staleness,
                state=worker_state(r, expected),
                ranks=r.ranks,
            )
            for r in self.workers.values()
        ]

    def to_meta(self) -> list[dict]:
        """The worker table for a checkpoint (last contacts on the wall clock)."""
        now, wall_now = self.clock(), self.wall_clock()
        self.expire(now)
        return [
            {
                "worker_id": r.worker_id,
                "name": r.name,
                "named": r.named,
                **({"region": True} if r.region else {}),
                "alive": r.alive,
                "last_seen_unix_s": wall_now - (now - r.last_seen),
                "applied_pushes": r.applied_pushes,
                "rejected_pushes": r.rejected_pushes,
                "tokens": r.tokens,
                "local_steps": r.local_steps,
                "left": r.left,
                "session": r.session,
                "staleness": [r.staleness_sum, r.staleness_pushes, r.last_staleness],
                "push_high_water": r.push_high_water,
                "outcomes": [
                    [pid, o.applied, o.version, o.staleness, o.staleness_weight, o.local_steps, o.num_workers]
                    for pid, o in r.outcomes.items()
                ],
            }
            for r in self.workers.values()
        ]

    def load_meta(self, workers: list[dict], next_worker_id: int, initializer: int | None, now: float) -> None:
        """Restore the table of a checkpoint; each worker keeps the rest of its lease,
        counted from ``last_seen_unix_s``."""
        self.next_worker_id = next_worker_id
        self.initializer = initializer
        self.workers, self.names = {}, {}
        self.rates = StepRateMeter()
        for w in workers:
            seen = now - self.silent_s(w["last_seen_unix_s"])
            rec = WorkerRecord(w["worker_id"], w["name"], now, seen, w["alive"], w["applied_pushes"], named=w["named"])
            rec.rejected_pushes, rec.tokens, rec.local_steps = w["rejected_pushes"], w["tokens"], w["local_steps"]
            rec.left, rec.session, rec.push_high_water = w["left"], w["session"], w["push_high_water"]
            rec.staleness_sum, rec.staleness_pushes, rec.last_staleness = w["staleness"]
            for pid, applied, version, tau, weight, steps, n in w["outcomes"]:
                rec.outcomes[pid] = PushOutcome(applied, False, version, tau, weight, steps, num_workers=n)
            rec.region = w.get("region", False)
            self.workers[rec.worker_id] = rec
            if rec.named:
                self.names[rec.name] = rec.worker_id
            self.rates.start(rec.worker_id, now)
