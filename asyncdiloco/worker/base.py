"""What the asynchronous and the synchronous worker share (``WorkerBase``): its life
(``WorkerState``), the inner optimizer's hooks, the heartbeat, the wire codec, the state
folder's common part and the torchrun group (group.py). docs/worker.md.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from asyncdiloco.algo.rates import InnerStepRate
from asyncdiloco.errors import (
    RETRY_LATER,
    AsyncDiLoCoError,
    ConfigError,
    ModeMismatchError,
    NotInitializedError,
    ServerUnavailableError,
    UnknownWorkerError,
    WorkerSupersededError,
)
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.tensors import Manifest
from asyncdiloco.worker.config import WorkerConfig
from asyncdiloco.worker.drops import DropStreak
from asyncdiloco.worker.flat import FlatParams
from asyncdiloco.worker.group import LocalGroup, resolve_group, unwrap_model
from asyncdiloco.worker.sharded import connect
from asyncdiloco.worker.state_dir import STATE_FORMAT, check_state, manifest_entries, open_for_worker
from asyncdiloco.worker.stats import WorkerCounters
from asyncdiloco.worker.wire_buffers import WorkerWire

log = logging.getLogger(__name__)

_Worker = TypeVar("_Worker", bound="WorkerBase")


class WorkerState(enum.Enum):
    """Where a worker is in its life (``WorkerBase.state``): NEW -> JOINING -> TRAINING ->
    CLOSED, and TRAINING -> LOST -> REJOINING -> TRAINING when the server forgot it."""

    #: Built; joins at ``join()`` (``with``), or before its first inner step.
    NEW = "new"
    #: ``join()`` runs: registering, then initializing, resuming or pulling the global model.
    JOINING = "joining"
    #: Joined: syncs every H inner steps.
    TRAINING = "training"
    #: The server forgot this worker (its lease lapsed, or the server restarted without it):
    #: the next sync point rejoins.
    LOST = "lost"
    #: A rejoin runs; cut short by an outage, the next sync point goes on with it.
    REJOINING = "rejoining"
    #: ``close()`` ran.
    CLOSED = "closed"


class WorkerBase:
    """Base of the workers. Subclasses set ``mode`` and ``self.stats``, implement
    ``_join_once``, ``_sync_once`` and ``_close_worker``, extend ``state_dict`` /
    ``load_state_dict``, and call ``_restore_saved_state`` at the end of ``__init__``.

    Raises:
        ConfigError: ``config.state_dir`` is in use, or holds another model's, mode's or name's state.
    """

    mode = "async"
    stats: WorkerCounters

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        config: WorkerConfig,
        tokens_per_step: int,
        process_group: Any = "auto",
    ) -> None:
        self.model, self.inner_optimizer, self.config = model, inner_optimizer, config
        self.tokens_per_step = tokens_per_step
        #: The torchrun group this process trains in as one worker (group.py; None: alone).
        self.group: LocalGroup | None = resolve_group(process_group)
        #: A rank > 0 of a group: it mirrors rank 0 and never contacts the server.
        self.follower = self.group is not None and not self.group.is_leader
        core = self._unwrap(model)
        self.manifest = Manifest.from_module(core)
        #: The model's parameters as one flat fp32 vector: every copy to and from it.
        self.flat = FlatParams(core)
        self._open_state_dir()
        #: The server's wire codec for pushes and pulls, and their payload buffers.
        self.wire = WorkerWire(self.manifest, self.flat)
        if not self.follower:  # a follower has no client: it never contacts the server
            self.client = connect(config, self.mode)
        self.state = WorkerState.NEW
        self._registration_defaults()
        self._round_defaults()
        self._install_hooks(core)

    def _unwrap(self, model: nn.Module) -> nn.Module:
        """DDP's module (the same parameters, named without "module."); warns for a group without DDP."""
        core = unwrap_model(model)
        if self.group is not None and core is model:
            log.warning(
                "rank %d: the model is not DistributedDataParallel; the %d ranks train apart between syncs and only "
                "rank 0's progress is pushed (wrap the model in DDP)",
                self.group.rank,
                self.group.world_size,
            )
        return core

    def _open_state_dir(self) -> None:
        """The state folder (``open_for_worker``; None for a follower) and the caller's part."""
        config = self.config
        folder = None if self.follower else config.state_dir
        self.state_dir, self.worker_name = open_for_worker(folder, config.worker_name, self.manifest)
        #: Called at every save: the caller's own ``torch.save``-able state to keep with the worker's.
        self.extra_state: Callable[[], dict[str, Any]] | None = None
        #: ``extra`` of the state this worker was restored from ({} when none was).
        self.restored_extra: dict[str, Any] = {}
        self._saves = 0

    def _registration_defaults(self) -> None:
        """What the server tells at Join (``_register``) and the heartbeat learns."""
        self.worker_id = 0
        self.local_steps = 1  # H (H_w under DyLU), set by the server
        self._lease_s = 60.0
        self._grouped = False  # the server groups push replies: overlap trains on while one is held
        self._must_initialize = False  # this registration pushes the initial parameters
        #: Another process joined under this worker's name: the next sync point raises it.
        self._superseded: WorkerSupersededError | None = None
        self._stop = threading.Event()  # close() began (wakes the heartbeat)
        self._stop_requested = False  # request_stop() was called on this rank
        self._heartbeat: threading.Thread | None = None

    def _round_defaults(self) -> None:
        """The counters of the current round, the backoff, and the drops in a row."""
        self._steps_since_sync = 0
        self._tokens_since_sync = 0
        #: Overlap under grouping: the step count of this round's sync point (None: H_w).
        self._round_steps: int | None = None
        self._backoff_s = self.config.initial_backoff_s
        self._next_attempt = 0.0
        #: Pseudo-gradients dropped in a row, and the error raised at the limit.
        self.drops = DropStreak(self.config.max_dropped_in_a_row)
        #: v_w, inner steps per second of compute (algo/rates.py; ``_report_rate``).
        self.step_rate = InnerStepRate()
        self._rate_known = True  # until ``_register`` says whether the server wants it (DyLU)
        self._rate_reported_at = 0  # step_rate.timed_steps at the last report

    def _install_hooks(self, core: nn.Module) -> None:
        """The pre-step hook that joins, the forward pre-hook that times a step; ``join`` adds the post-step hook."""
        self._step_hook: RemovableHandle | None = None
        self._forward_hook: RemovableHandle | None = (
            None if self.follower else core.register_forward_pre_hook(self._step_begins)
        )
        self._join_hook: RemovableHandle | None = self.inner_optimizer.register_step_pre_hook(
            self._join_before_first_step
        )

    # ------------------------------------------------------------ lifecycle
    def join(self) -> None:
        """Register, then initialize or load the global model; retries until ``join_timeout_s``
        (plus one lease while waiting for another worker's initial parameters).

        Raises:
            ServerUnavailableError: no server, or no initial parameters, in time.
            ManifestMismatchError / ModeMismatchError: refused by the server.
            AsyncDiLoCoError: the worker was closed (a closed worker cannot join again).
        """
        if self._stop.is_set():
            raise AsyncDiLoCoError(
                f"join() after close(): this worker has left the server at {self.config.server} and closed its "
                f"channel; create a new {type(self).__name__} (with the same model and inner optimizer) to join again"
            )
        self.state = WorkerState.JOINING
        group = self.group
        if group is not None and not self.follower:
            try:
                with group.leading():  # the followers wait through keep-alives while it retries
                    self._join_with_retries()
            except BaseException as exc:  # every rank raises it: no follower waits for a join that failed
                group.share_join(self.flat, self.inner_optimizer, self.restored_extra, exc)
                raise
        if group is not None:
            self.restored_extra = group.share_join(self.flat, self.inner_optimizer, self.restored_extra, None)
        else:
            self._join_with_retries()
        self.state = WorkerState.TRAINING
        if self._heartbeat is None and not self.follower:
            self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="asyncdiloco-heartbeat", daemon=True)
            self._heartbeat.start()
        if self._step_hook is None:  # H is known now: count inner steps from here on
            self._step_hook = self.inner_optimizer.register_step_post_hook(self._after_inner_step)

    def _join_with_retries(self) -> None:
        """``join``'s retry loop around ``_join_once`` (rank 0 of a group, or a worker alone)."""
        started = time.monotonic()
        delay = self.config.initial_backoff_s
        while True:
            try:
                self._join_once()
                break
            except RETRY_LATER as exc:
                # the initial parameters are a push away (or a lease, if their pusher died): poll quickly
                waiting = isinstance(exc, NotInitializedError)
                wait_s = 0.1 if waiting else delay
                limit = self.config.join_timeout_s + (self._lease_s if waiting else 0.0)
                if time.monotonic() + wait_s > started + limit:
                    server = "asyncdiloco server --mode sync" if self.mode == "sync" else "asyncdiloco server"
                    raise ServerUnavailableError(
                        f"could not join the parameter server at {self.config.server} within "
                        f"join_timeout_s={self.config.join_timeout_s:g} ({exc}); check that `{server}` runs "
                        f"there and that host and port are right, or raise join_timeout_s (--join-retry-s)"
                    ) from None
                log.info("join: %s; retrying in %.1f s", exc, wait_s)
                time.sleep(wait_s)
                if wait_s == delay:
                    delay = min(2 * delay, self.config.max_backoff_s)

    def _join_before_first_step(self, *_: object) -> None:
        """Pre-step hook: a worker nobody joined joins now."""
        if self._step_hook is None and not self._stop.is_set():
            self.join()

    def _remove_hooks(self) -> None:
        """Detach from the inner optimizer (at close): its later steps are plain steps."""
        for hook in (self._step_hook, self._join_hook, self._forward_hook):
            if hook is not None:
                hook.remove()
        self._step_hook = self._join_hook = self._forward_hook = None

    def _join_once(self) -> None:
        raise NotImplementedError

    def sync(self) -> bool:
        """Sync with the server now (the step hook calls it every H steps); in a group every
        rank calls it. True when the model now holds a new global model; False when the
        sync did not complete, runs in the background, or the server was unreachable."""
        if self.group is None:
            return self._sync_point()
        return self.group.shared(self.flat, self._sync_point)

    @property
    def _lost(self) -> bool:
        """The server forgot this worker: the next sync point rejoins (or goes on rejoining)."""
        return self.state in (WorkerState.LOST, WorkerState.REJOINING)

    def _sync_point(self) -> bool:
        """``sync`` on this process: rank 0 of a group, or a worker alone."""
        if self._superseded is not None:
            raise self._superseded
        if self._stop.is_set() or time.monotonic() < self._next_attempt:
            return False
        started = time.monotonic()
        try:
            return self._guarded(self._rejoin if self._lost else self._sync_once)
        finally:
            self._count_sync_time(time.monotonic() - started)

    def _guarded(self, step: Callable[[], bool | None]) -> bool:
        """Run ``step`` with the fault policy: ``errors.RETRY_LATER`` backs off, a forgotten
        worker rejoins next time, the rest is raised; None from ``step``: in the background."""
        try:
            done = step()
        except RETRY_LATER as exc:
            self.stats.sync_failures += 1
            self._next_attempt = time.monotonic() + self._backoff_s
            log.warning("sync failed (%s); training on locally, next try in %.1f s", exc, self._backoff_s)
            self._backoff_s = min(2 * self._backoff_s, self.config.max_backoff_s)
            return False
        except UnknownWorkerError as exc:
            log.warning("%s; rejoining", exc)
            if self.state is not WorkerState.REJOINING:
                self.state = WorkerState.LOST
            return False
        if done is None:
            return False
        self._backoff_s = self.config.initial_backoff_s
        return done

    def _count_sync_time(self, elapsed_s: float) -> None:
        """Seconds the training thread spent in ``sync``: all ``comm_s`` and ``blocked_s``."""
        self.stats.comm_s += elapsed_s
        self.stats.blocked_s += elapsed_s
        self.stats.corrupted_transfers = self.client.corrupted_transfers

    def _sync_once(self) -> bool | None:
        raise NotImplementedError

    def _rejoin(self) -> bool:
        """Register again and load the global model; one cut short resumes where it stopped."""
        if self.state is WorkerState.LOST:
            self.worker_id = 0
            self._before_rejoin()
            self.state = WorkerState.REJOINING
        self._join_once()
        self.state = WorkerState.TRAINING
        log.info("rejoined as worker %d", self.worker_id)
        return True

    def _before_rejoin(self) -> None:
        """What a rejoin does with what the old registration had not sent (nothing here)."""

    def _raise_if_dropping_every_push(self) -> None:
        """``DropStreak.raise_at_limit`` for this worker."""
        self.drops.raise_at_limit(f"worker {self.worker_id} ({self.worker_name or 'unnamed'})")

    def _register(self) -> pb.JoinReply:
        """Join: take the id, H and lease; refuse (and leave) a server of the other mode."""
        ranks = 1 if self.group is None else self.group.world_size
        reply = self.client.join(self.manifest, self.worker_name, steps_per_s=self.step_rate.steps_per_s, ranks=ranks)
        if reply.run_config.mode != self.mode:
            self.client.leave(reply.worker_id)
            server_mode = reply.run_config.mode
            raise ModeMismatchError(
                f"mode mismatch: the server at {self.config.server} runs --mode {server_mode} but this worker runs "
                f"--mode {self.mode}; start the worker with --mode {server_mode}, or the server with --mode {self.mode}"
            )
        self.worker_id = reply.worker_id
        self._must_initialize = reply.initialize
        self.wire.adopt(reply.run_config)
        self.local_steps = reply.run_config.local_steps
        self._lease_s = reply.run_config.lease_s
        self._grouped = reply.run_config.grouping not in ("", "off")
        self._rate_known = not self._wants_rate(reply.run_config)
        if reply.resumed:
            log.info(
                "worker %d (%s) resumed its registration (the server holds outcomes up to push %d)",
                self.worker_id,
                self.worker_name,
                reply.last_push_id,
            )
        return reply

    def _wants_rate(self, run_config: pb.RunConfig) -> bool:
        """Whether the server sizes H_w by this worker's rate (``_report_rate``): async DyLU."""
        return run_config.dylu

    def _take_over_initialization_if_told(self) -> None:
        """While the global model is missing: take over from a vanished initializer if told to."""
        if self.client.heartbeat(self.worker_id).initialize:
            self._must_initialize = True
            log.info("worker %d takes over initializing the global model", self.worker_id)

    def _close_connection(self) -> None:
        """Leave (best effort), stop the heartbeat, close the channel."""
        if self.worker_id and not self._lost:
            try:
                self.client.leave(self.worker_id)
            except Exception as exc:  # noqa: BLE001 - best effort at shutdown
                log.info("leave failed: %s", exc)
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5)
        self.client.close()
        self.stats.corrupted_transfers = self.client.corrupted_transfers
        if self.state_dir is not None:
            self.state_dir.close()

    # ---------------------------------------------------------- saved state
    def state_dict(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """What every worker saves: ``format``, ``mode``, ``worker_name``, ``worker_id``,
        ``manifest`` ([[name, shape, dtype]]), ``inner_optimizer`` and ``extra`` (the caller's).
        Raises ConfigError on a follower (rank > 0): the group's state is rank 0's."""
        if self.group is not None:
            self.group.check_state_dict(merge_in_flight=False)
        return {
            "format": STATE_FORMAT,
            "mode": self.mode,
            "worker_name": self.worker_name,
            "worker_id": self.worker_id,
            "manifest": manifest_entries(self.manifest),
            "inner_optimizer": self.inner_optimizer.state_dict(),
            "extra": dict(extra or {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict()`` before the worker joins (``extra`` → ``restored_extra``).
        Raises ConfigError: joined already, or another model's, mode's or name's state."""
        if self.follower:
            return  # rank 0's state reaches the followers when the group joins
        if self.worker_id:
            raise ConfigError(
                f"load_state_dict after join: the state of worker {state.get('worker_name')!r} must be loaded "
                f"before the worker joins"
            )
        self.worker_name = check_state(state, self.manifest, self.mode, self.config.worker_name)
        self.inner_optimizer.load_state_dict(state["inner_optimizer"])
        self.restored_extra = dict(state.get("extra", {}))

    def _restore_saved_state(self) -> None:
        """Load the state folder's newest state, if any (end of a subclass's ``__init__``)."""
        if self.state_dir is not None and self.state_dir.state is not None:
            self.load_state_dict(self.state_dir.state)
            log.info("worker %s: state restored from %s", self.worker_name, self.state_dir.path)

    def _save_state(self) -> None:
        """Save ``state_dict`` (with ``extra_state()``) into the state folder, on the training thread."""
        if self.state_dir is None:
            return
        state = self.state_dict(self.extra_state() if self.extra_state is not None else None)
        self._saves += self.state_dir.save_worker_state(state, self._saves + 1)

    def __enter__(self: _Worker) -> _Worker:
        self.join()
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is not None and self.group is not None:  # this rank leaves alone: its close is no collective
            self.group.broken = True
        self.close()

    def close(self) -> None:
        """Close: ``_close_worker`` (final push, Leave); in a group that ended in order, collective."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._remove_hooks()
        group = self.group
        if group is None:
            self._close_worker()
        elif not group.joined or group.broken:
            group.broken = True  # no collective after this
            if not self.follower:
                self._close_worker()
        else:
            group.broken = True  # no collective after this one
            try:
                group.shared(self.flat, lambda: self._close_worker() if not self.follower else None, broken_ok=True)
            except RuntimeError as exc:  # a rank that left alone exited: the collective fails, close goes on
                log.warning("rank %d: the group's close exchange failed (%s)", group.rank, exc)
        self.state = WorkerState.CLOSED

    def _close_worker(self) -> None:
        raise NotImplementedError

    # ---------------------------------------------------------------- steps
    def add_tokens(self, num_tokens: int) -> None:
        """Count ``num_tokens`` more training tokens toward the next sync (a follower's reach
        rank 0 with its next inner step)."""
        self._tokens_since_sync += num_tokens
        self.stats.tokens += num_tokens

    @torch.compiler.disable  # a compiled model runs it as it is (no graph break warning)
    def _step_begins(self, *_: object) -> None:
        """Forward pre-hook: a forward pass with gradients starts an inner step's compute."""
        if torch.is_grad_enabled():
            self.step_rate.begin()

    def _after_inner_step(self, *_: object) -> None:
        """Post-step hook on the inner optimizer: count the step, then the step's events."""
        if not self.follower:
            self.step_rate.end()  # first: the sync below is not compute
        self.stats.inner_steps += 1
        self._steps_since_sync += 1
        self._tokens_since_sync += self.tokens_per_step
        self.stats.tokens += self.tokens_per_step
        if self.follower:
            self._follow_step()
            return
        try:
            if self.group is not None:
                self._lead_step(self.group)
            else:  # ``_due_step``, inline: one frame less on every push's path
                if not self._rate_known:
                    self._report_rate()
                self._step_events()
        finally:
            self.step_rate.resume()  # a step without a forward pre-hook is timed from here

    def _lead_step(self, group: LocalGroup) -> None:
        """Rank 0's step exchange (the followers' tokens), then a due step every rank takes."""
        due = self._events_due() or not self._rate_known
        totals = group.step_exchange(tokens=0, stop=self._stop_requested, due=due)
        self._tokens_since_sync += totals.tokens
        self.stats.tokens += totals.tokens
        if due:
            group.shared(self.flat, self._due_step)

    def _due_step(self) -> None:
        """Rank 0 or alone: the rate report before the first push, then the step's events."""
        if not self._rate_known:
            self._report_rate()
        self._step_events()

    def _follow_step(self) -> None:
        """A follower's step: its tokens go to rank 0 with the exchange; a due step is mirrored."""
        assert self.group is not None, "a follower is in a group"
        tokens, self._tokens_since_sync, self._steps_since_sync = self._tokens_since_sync, 0, 0
        self.stats.blocked_s += self.group.follow_step(self.flat, tokens, self._stop_requested)

    def request_stop(self) -> None:
        """Ask to stop after the current inner step (in a group, every rank stops after the same step)."""
        self._stop_requested = True

    @property
    def should_stop(self) -> bool:
        """``request_stop`` was called (alone), or some rank's request reached every rank: end the loop now."""
        return self._stop_requested if self.group is None else self.group.stopping

    def _sync_due(self) -> bool:
        return self._steps_since_sync >= (self._round_steps or self.local_steps)

    def _events_due(self) -> bool:
        """Rank 0, before a step's exchange: whether ``_step_events`` may change the model."""
        return self._sync_due()

    def _step_events(self) -> None:
        """What the step hook does after counting (rank 0 or alone): the sync point when due."""
        if self._sync_due():
            self._sync_point()

    #: Before the first push, the rate is reported every this many timed inner steps.
    RATE_PROBE_STEPS = 3

    def _report_rate(self) -> None:
        """Before the first push: report v_w with a heartbeat every ``RATE_PROBE_STEPS`` timed
        steps and take H_w from its reply (DyLU, Liu et al. 2024, Eq. 6); pushes carry it after."""
        timed = self.step_rate.timed_steps
        rate = self.step_rate.steps_per_s
        if not self.worker_id or rate <= 0 or timed - self._rate_reported_at < self.RATE_PROBE_STEPS:
            return
        self._rate_reported_at = timed
        try:
            reply = self.client.heartbeat(self.worker_id, steps_per_s=rate)
        except Exception as exc:  # noqa: BLE001 - the sync point reports real trouble
            log.debug("rate report failed: %s", exc)
            return
        if reply.local_steps and reply.local_steps != self.local_steps:
            log.info(
                "worker %d: %.2f inner steps/s; H_w %d -> %d", self.worker_id, rate, self.local_steps, reply.local_steps
            )
            self.local_steps = reply.local_steps

    def _heartbeat_loop(self) -> None:
        period = self.config.heartbeat_s or self._lease_s / 3
        while not self._stop.wait(period):
            worker_id = self.worker_id
            if not worker_id or self._lost:
                continue
            try:
                self.client.heartbeat(worker_id)
            except UnknownWorkerError:
                if worker_id == self.worker_id and self.state is WorkerState.TRAINING:
                    self.state = WorkerState.LOST
            except WorkerSupersededError as exc:  # the next sync point raises it
                self._superseded = exc
                return
            except Exception as exc:  # noqa: BLE001 - the next sync reports real trouble
                log.debug("heartbeat failed: %s", exc)
