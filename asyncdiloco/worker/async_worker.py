"""The asynchronous DiLoCo worker (``AsyncDiLoCoWorker``): every H inner steps it pushes
Δ = θ_base − θ_local and pulls the global model (Douillard et al. 2023, arXiv 2311.08105,
Alg. 1; asynchronous as in Liu et al. 2024, arXiv 2401.09135), inline or with ``overlap``
in the background; ``_merge`` adopts the outcome. docs/worker.md, "The sync path".
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any

import torch
from torch import nn

from asyncdiloco.errors import (
    RETRY_LATER,
    AsyncDiLoCoError,
    InvalidPayloadError,
    NotInitializedError,
    UnknownWorkerError,
    error_for_reason,
)
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.worker.base import WorkerBase
from asyncdiloco.worker.config import WorkerConfig
from asyncdiloco.worker.drops import (
    FIX_OTHERWISE,
    FIXES,
    NON_FINITE,
    NOT_APPLIED,
    NOT_APPLIED_WORDS,
    NOT_RESUMED,
    drop_words,
    reset_diverged_state,
)
from asyncdiloco.worker.push_pull import (
    BackgroundSync,
    PendingPush,
    SyncLink,
    SyncOutcome,
    SyncRequest,
    check_finite_delta,
    push_then_pull,
)
from asyncdiloco.worker.stats import WorkerStats

log = logging.getLogger(__name__)


def _saved_fields(pending: PendingPush) -> dict[str, Any]:
    """A pending push's fields a restart needs, but its payload (``PendingPush(**saved)``)."""
    return {f.name: getattr(pending, f.name) for f in dataclasses.fields(pending) if f.name not in ("payload", "last")}


class AsyncDiLoCoWorker(WorkerBase):
    """Asynchronous DiLoCo around ``model`` and ``inner_optimizer``.

    Args:
        model: any ``nn.Module`` with float32/bfloat16/float16 parameters, on any device.
        inner_optimizer: the optimizer the user steps (e.g. AdamW); the worker hooks
            its ``step`` to count inner steps and sync every H of them.
        config: server address, deadlines, backoff, ``overlap``.
        tokens_per_step: tokens consumed per inner step, reported to the server (0 if
            unknown); ``add_tokens`` adds more.
        process_group: "auto", a ``torch.distributed.ProcessGroup`` or "off": the group
            this process trains in as ONE worker (group.py ``resolve_group``).

    ``with worker:`` joins (or call ``join()``); a worker nobody joined joins before its
    first inner step, and ``join``'s exceptions then come from that ``step()``.

    Raises:
        ServerUnavailableError (from ``join``): the server could not be reached within
            ``config.join_timeout_s``.
        ManifestMismatchError (from ``join``): the model differs from the server's.
        ModeMismatchError (from ``join``): the server runs ``--mode sync``.
    """

    mode = "async"
    stats: WorkerStats

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        config: WorkerConfig,
        *,
        tokens_per_step: int = 0,
        process_group: Any = "auto",
    ) -> None:
        super().__init__(model, inner_optimizer, config, tokens_per_step, process_group)
        self.stats = WorkerStats()
        self.version = 0  # the version θ_base was pulled at (rank 0's)
        self._overlap: BackgroundSync | None = None
        self._joined_at: float | None = None
        if self.follower:  # it mirrors rank 0: no θ_base, no buffers, no background sync
            return
        self._base = self.flat.host_buffer()  # θ_base, (N,) fp32
        self._scratch = self.flat.host_buffer()  # θ_local, then Δ, (N,) fp32
        self._carry_residual = False  # an acknowledged push left a quantisation residual for the next pull to keep
        self._next_push_id = 1
        self._pending: PendingPush | None = None
        self._link = SyncLink(self.client, self.manifest, encode=self.wire.encode, decode=self.wire.decode)
        if config.overlap:
            self._overlap = BackgroundSync(self._link, snapshot=self.flat.host_buffer())
        #: The push counter of a restored state (or, during a rejoin, of this registration)
        #: until the Join says whether the server resumed it (``_number_pushes``).
        self._restored_push_id: int | None = None
        #: The join continues a restored state or a rejoined registration (``_continue_unsent``).
        self._resuming = False
        #: The newest push was saved before it was sent, and nothing since (``_save_after_sync``).
        self._push_saved = False
        self._restore_saved_state()

    # ------------------------------------------------------------ lifecycle
    def _join_once(self) -> None:
        if not self.worker_id:
            self._resuming = self._number_pushes(self._register())
        if self._must_initialize:  # a retry after a failed attempt resends push_id 1: applied at most once
            payload = self.manifest.pack_flat(self.flat.copy_into(self._base))  # always raw, exact
            self.client.push(
                payload, worker_id=self.worker_id, push_id=1, base_version=0, kind=pb.PUSH_KIND_INITIAL_PARAMETERS
            )
            self.stats.bytes_pushed += payload.numel()
            self._must_initialize = False
            self.version = 0
            self._pending, self._resuming = None, False  # the model is the global one now
            self._start_round()  # the steps so far are in the initial parameters
            log.info("worker %d initialized the global model", self.worker_id)
            self._save_state()
            return
        try:
            if self._resuming:
                self._continue_unsent()
            else:  # raises NotInitializedError until the initial parameters arrive
                self._merge(push_then_pull(self._link, self._request(push=False)))
        except NotInitializedError:
            self._take_over_initialization_if_told()
            raise

    def _number_pushes(self, reply: pb.JoinReply) -> bool:
        """Where this registration's push ids start; True when it continues a restored
        state or rejoin (the server resumed the id and holds no push past the saved
        counter); otherwise the unacknowledged steps are dropped."""
        restored, self._restored_push_id = self._restored_push_id, None
        if restored is not None and reply.resumed and restored > reply.last_push_id:
            self._next_push_id = restored
            return True
        if restored is not None:
            log.warning(
                "worker %d: %s; continuing from the global model",
                reply.worker_id,
                "the server holds pushes of this worker past its own" if reply.resumed else "it joined as a new worker",
            )
            self._forget_unsent()
        self._next_push_id = max(2, reply.last_push_id + 1)
        return False

    def _continue_unsent(self) -> None:
        """The first sync of a resumed worker: retry the unacknowledged push under its id,
        then pull keeping θ_base − θ_local (what the server has not received)."""
        self._carry_residual = True  # a drop clears it
        self._merge(push_then_pull(self._link, self._request()))
        self._resuming = False
        self._save_state()

    def join(self) -> None:
        super().join()
        if self._joined_at is None:
            self._joined_at = time.monotonic()

    def _close_worker(self) -> None:
        """``close``: merge a sync in flight, push what is unsent (``push_on_close``), leave."""
        rate, stats = self.step_rate, self.stats
        stats.compute_s, stats.timed_steps, stats.steps_per_s = rate.compute_s, rate.timed_steps, rate.steps_per_s
        stats.local_steps_per_round = self.local_steps
        if self._overlap is not None and self._overlap.in_flight:
            started = time.monotonic()
            try:
                self._guarded(self._wait_and_merge)
            except Exception as exc:  # noqa: BLE001 - best effort at shutdown
                log.warning("the sync in flight at close failed: %s", exc)
            self.stats.blocked_s += time.monotonic() - started
        if self.worker_id and not self._lost and self.config.push_on_close:
            if self._pending is not None:  # the final pushes' replies are not held for a group
                self._pending.last = True
            for _ in range(2):  # a pending retry, then the steps taken since it was packed
                if not (self._steps_since_sync > 0 or self._pending):
                    break
                try:
                    self._final_push()
                except Exception as exc:  # noqa: BLE001 - best effort at shutdown
                    self.stats.final_push = "not acknowledged"
                    kept = "kept in the state folder for a restart" if self.state_dir is not None else "not sent"
                    log.warning("final push not acknowledged (%s); its steps are %s", exc, kept)
                    break
        if self.worker_id and not self._lost:
            self._save_state()  # the final pushes' ids (and one that failed, to retry) for a restart
        self._close_connection()
        if self._overlap is not None:
            self._overlap.close()
        if self._joined_at is not None:
            self.stats.wall_s = time.monotonic() - self._joined_at

    def _final_push(self) -> None:
        """``_push_round`` at close, retried with backoff for up to ``join_timeout_s`` while
        the server cannot answer (``errors.RETRY_LATER``); other refusals raise at once."""
        give_up_at = time.monotonic() + self.config.join_timeout_s
        delay_s = self.config.initial_backoff_s
        while True:
            refused, dropped = self.stats.pushes_refused, self.stats.pseudo_gradients_dropped
            try:
                self._push_round()
            except RETRY_LATER as exc:
                if time.monotonic() + delay_s > give_up_at:
                    raise
                log.info("final push: %s; retrying it in %.1f s", exc, delay_s)
                time.sleep(delay_s)
                delay_s = min(2 * delay_s, self.config.max_backoff_s)
                continue
            if self.stats.pushes_refused > refused:
                self.stats.final_push = "refused"
            elif self.stats.pseudo_gradients_dropped > dropped:
                self.stats.final_push = "dropped"  # Δ was not finite: nothing was sent
            else:
                self.stats.final_push = "applied"
            return

    # ---------------------------------------------------------------- sync
    def _sync_once(self) -> bool | None:
        """Push Δ, then pull, inline; with overlap, merge the sync in flight and start the
        next one in the background (None). Raises after ``max_dropped_in_a_row`` drops."""
        if self._overlap is not None:
            return self._overlapped_sync_point(self._overlap)
        self._pack_push()
        merged = self._merge(push_then_pull(self._link, self._request()))
        self._raise_if_dropping_every_push()
        return merged

    # ------------------------------------------------------------- overlap
    def _overlapped_sync_point(self, overlap: BackgroundSync) -> bool | None:
        """Merge the sync in flight if it is due, then start the next one in the background."""
        merged = False
        if overlap.in_flight and self._grouped and self._steps_since_sync < 2 * self.local_steps:
            return None  # its reply is held while the group forms: train on, merge when it comes
        if overlap.in_flight:  # the previous sync is late: wait for it (blocked time)
            merged = self._wait_and_merge()
            if self._pending is None and self._steps_since_sync < self.local_steps:
                return merged  # restarted from the global model (stale push): nothing to push yet
        if self._pending is None:
            if self._steps_since_sync > 0:  # θ_local(t0) -> snapshot; Δ is taken and encoded in the background
                self._new_pending(overlap.snapshot, encode=False)
                self._save_before_sending()
            else:
                self.flat.copy_into(overlap.snapshot)  # a pull only
        # else: a retry: the snapshot still holds θ_local at the time the pending Δ was taken
        overlap.submit(self._request(overlap.snapshot))
        return None

    def _request(self, snapshot: torch.Tensor | None = None, *, push: bool = True, pull: bool = True) -> SyncRequest:
        """This sync point's push + pull; ``snapshot``: θ_local's copy (overlap; None inline)."""
        return SyncRequest(
            worker_id=self.worker_id,
            pending=self._pending if push else None,
            base=self._base,
            snapshot=snapshot,
            theta_g=self._scratch,
            pull_buffer=self.wire.buffer("pull") if pull else None,
            lossy=self.wire.codec.name != "raw",
            keep_unsent=self._carry_residual or (snapshot is None and self._steps_since_sync > 0),
            pull=pull,
        )

    def _events_due(self) -> bool:
        return self._sync_due() or (self._overlap is not None and self._overlap.done())

    def _step_events(self) -> None:
        """The sync point when due, then the merge of a background sync that finished."""
        if self._sync_due():
            self._sync_point()
        if self._overlap is not None and self._overlap.done():
            started = time.monotonic()
            try:
                self._guarded(self._wait_and_merge)
            finally:
                self.stats.blocked_s += time.monotonic() - started

    def _wait_and_merge(self) -> bool:
        """Adopt the background sync in flight, waiting for it."""
        assert self._overlap is not None, "merging needs overlap"
        out = self._overlap.wait()
        self.stats.comm_s += out.comm_s
        merged = self._merge(out, background=True)
        self._backoff_s = self.config.initial_backoff_s
        self._raise_if_dropping_every_push()
        return merged

    def _merge(self, out: SyncOutcome, *, background: bool = False) -> bool:
        """Adopt a finished ``push_then_pull`` (docs/worker.md, "The sync path"): record
        the push's outcome, then θ_local ← θ_local(now) + c (or θ_g'). True when the model
        now holds the pull; raises what ended the sync early, after the recording."""
        self.stats.corrupted_transfers = self.client.corrupted_transfers
        dropped = self._record_push_outcome(out)
        if out.error is not None:
            raise out.error
        if not out.pulled:
            return False
        assert out.run_config is not None and out.version is not None, "a pull's outcome"
        theta_g = self._scratch  # θ_g', decoded by push_then_pull
        self.local_steps = out.run_config.local_steps or self.local_steps
        if dropped or out.correction is None:  # restart from the global model
            self.flat.load(theta_g)
        else:
            self.flat.add(out.correction)  # θ_local ← θ_local(now) + c
            if background:
                self._extend_round_by_held_steps(out)
        self._base, self._scratch = theta_g, self._base  # θ_base ← θ_g'
        self._carry_residual = False  # the correction kept it
        self.wire.adopt(out.run_config)
        self.version = out.version
        if not background and self._steps_since_sync == 0:
            self._start_round()
        self.stats.pulls += 1
        self.stats.bytes_pulled += out.bytes_pulled
        if not self._resuming:  # a resumed first pull saves once it is done (``_continue_unsent``)
            self._save_after_sync()  # adopted, on the training thread, before the next sync starts
        return True

    def _record_push_outcome(self, out: SyncOutcome) -> bool:
        """Record what the server did with the sync's push; True when it was dropped (the
        merge restarts from θ_g'); an unknown outcome keeps it for a retry."""
        pending = out.pending
        if pending is None:
            return False
        if out.push_reply is not None:
            assert pending.payload is not None, "a sent push has its payload"
            self.stats.bytes_pushed += pending.payload.numel()
            if out.push_reply.applied:
                self._push_acknowledged(out.push_reply)
                return False
            self.stats.pushes_refused += 1
            self._drop_unsent(NOT_APPLIED, f"push {pending.push_id} {NOT_APPLIED_WORDS}")
            return True
        if out.refused is not None:
            if out.drop_reason != NON_FINITE:
                self.stats.pushes_refused += 1
            self._drop_unsent(out.drop_reason, drop_words(pending.push_id, out.drop_reason, out.refused))
            return True
        return False

    def _extend_round_by_held_steps(self, out: SyncOutcome) -> None:
        """The steps trained while the reply was held for a group come on top of H_w, so the
        next push lands with the group's next one."""
        held_s = out.push_reply.held_s if out.push_reply is not None else 0.0
        pending = out.pending
        if held_s > 0 and pending is not None and pending.compute_s > 0:
            step_s = pending.compute_s / max(1, pending.num_local_steps)
            held_steps = min(self._steps_since_sync, math.floor(held_s / step_s))
            self._round_steps = self.local_steps + held_steps

    def _count_sync_time(self, elapsed_s: float) -> None:
        if self._overlap is None:
            super()._count_sync_time(elapsed_s)
        else:  # comm_s comes from the background thread's clock (at the merge) and rejoins
            self.stats.blocked_s += elapsed_s

    def _rejoin(self) -> bool:
        if self._overlap is None:
            return super()._rejoin()
        if self._overlap.in_flight:  # the pull buffer is the background thread's until it returns
            try:
                self._wait_and_merge()
            except UnknownWorkerError:
                pass  # expected: this worker is being rejoined
        started = time.monotonic()
        try:
            return super()._rejoin()
        finally:
            self.stats.comm_s += time.monotonic() - started

    # ------------------------------------------------------------- internals
    def _push_round(self) -> None:
        """Push without a pull (at close): the pending push, or a new one."""
        self._pack_push(last=True)
        self._merge(push_then_pull(self._link, self._request(pull=False)))

    def _pack_push(self, *, last: bool = False) -> None:
        """Inline: pack a new push with Δ = θ_base − θ_local unless one is pending or no
        step ran; a Δ that is not finite is dropped (nothing sent, no push id taken)."""
        if self._pending is not None or self._steps_since_sync == 0:
            return
        try:
            self._new_pending(self._scratch, last=last)
        except InvalidPayloadError as exc:
            self._drop_unsent(NON_FINITE, str(exc))
            return
        self._save_before_sending()

    def _new_pending(self, local: torch.Tensor, *, encode: bool = True, last: bool = False) -> PendingPush:
        """θ_local into ``local`` (N,) fp32 and a new ``self._pending`` with the round's steps
        and tokens; ``encode``: Δ = θ_base − θ_local encoded now (else by overlap's thread)."""
        self.flat.copy_into(local)  # θ_local, (N,) fp32
        payload = None
        if encode:
            delta = torch.sub(self._base, local, out=self._scratch)  # Δ = θ_base − θ_local, (N,)
            check_finite_delta(delta, self.worker_id, self._steps_since_sync)
            payload = self.wire.encode(delta)
        self._pending = PendingPush(
            payload=payload,
            push_id=self._next_push_id,
            base_version=self.version,
            num_local_steps=self._steps_since_sync,
            num_tokens=self._tokens_since_sync,
            compute_s=self.step_rate.seconds_for(self._steps_since_sync),
            last=last,
        )
        self._next_push_id += 1
        self._start_round()
        return self._pending

    def _start_round(self) -> None:
        """A new round starts now: no steps or tokens since the last push, its sync point at H_w."""
        self._steps_since_sync = 0
        self._tokens_since_sync = 0
        self._round_steps = None

    def _push_acknowledged(self, reply: pb.PushReply) -> None:
        """The server applied the pending push (a lossy codec's residual is kept)."""
        self._pending = None
        self._carry_residual = self.wire.codec.name != "raw"
        self.drops.applied()
        self.stats.count_applied(reply.held_s, reply.staleness)
        self.local_steps = reply.local_steps or self.local_steps
        self._rate_known = True  # from now on each push's compute_s carries the rate

    def _drop_unsent(self, reason: str, what: str) -> None:
        """Drop what the server has not received (the pending push and the steps since):
        the model restarts from θ_base, then the next pull; counted and logged."""
        pending = self._pending
        steps = self._steps_since_sync + (pending.num_local_steps if pending is not None else 0)
        tokens = self._tokens_since_sync + (pending.num_tokens if pending is not None else 0)
        self._pending = None
        self._carry_residual = False
        self.flat.load(self._base)
        self._start_round()
        if reason == NON_FINITE:
            self.stats.optimizer_states_cleared += reset_diverged_state(self.inner_optimizer, self.worker_id)
        self.stats.count_drop(reason, steps, tokens)
        error = InvalidPayloadError if reason == NON_FINITE else error_for_reason(reason) or AsyncDiLoCoError
        self.drops.note(error, what, FIXES.get(reason, FIX_OTHERWISE))
        log.warning(
            "worker %d: %s; dropped, with its %d inner steps (reason %s); restarting from the global model",
            self.worker_id,
            what,
            steps,
            reason,
        )

    def _before_rejoin(self) -> None:
        """Keep what the server has not acknowledged for the Join to decide (``_number_pushes``)."""
        self._restored_push_id = self._next_push_id

    def _forget_unsent(self) -> None:
        """Not resumed: an unacknowledged push may have been applied; drop it and the steps since."""
        if self._pending is not None or self._steps_since_sync > 0:
            self._drop_unsent(NOT_RESUMED, "the server did not resume this worker's registration")
        self._carry_residual = False

    # ---------------------------------------------------------- saved state
    def _save_before_sending(self) -> None:
        """Write-ahead: a new push is saved before any byte of it is sent (docs/operations.md)."""
        self._save_state()
        self._push_saved = self.state_dir is not None

    def _save_after_sync(self) -> None:
        """The save after an adopted sync, skipped when its push was saved before sending."""
        if self._push_saved:
            self._push_saved = False
            return
        self._save_state()

    def state_dict(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """The worker's own state, to continue after a restart (``load_state_dict``;
        saved into ``config.state_dir`` before each push is sent). Call it on the
        training thread; with overlap, a sync in flight is waited for and merged first.

        Args:
            extra: the caller's own state, ``torch.save``-able (e.g. its data position).
        Returns:
            ``WorkerBase.state_dict``'s keys and: ``version`` (θ_base's), ``theta_base``
            and ``theta_local`` (fp32 (N,) CPU copies; θ_local is the model),
            ``next_push_id``, ``steps_since_sync`` and ``tokens_since_sync`` (this
            round's inner steps and tokens so far), and ``pending``: an unacknowledged
            push (``push_id``, ``base_version``, ``num_local_steps``, ``num_tokens``,
            ``compute_s`` and its ``payload``, uint8 as sent) or None.
        """
        if self.group is not None:  # before the merge below
            self.group.check_state_dict(merge_in_flight=self._overlap is not None and self._overlap.in_flight)
        if self._overlap is not None and self._overlap.in_flight:
            self._guarded(self._wait_and_merge)  # θ_base and the pending push are the background's until then
        state = super().state_dict(extra)
        pending = self._pending
        payload = None if pending is None else pending.payload
        if pending is not None and payload is None and self._overlap is not None:
            payload = self._encode_for_saving(pending, self._overlap.snapshot)
            pending.payload = payload  # the bytes saved are the bytes sent: the background does not encode again
        state.update(
            version=self.version,
            theta_base=self._base.clone(),
            theta_local=self.flat.copy_into(torch.empty_like(self._base)),
            next_push_id=self._next_push_id,
            steps_since_sync=self._steps_since_sync,
            tokens_since_sync=self._tokens_since_sync,
            pending=None
            if pending is None or payload is None
            else {**_saved_fields(pending), "payload": payload.clone()},
        )
        return state

    def _encode_for_saving(self, pending: PendingPush, snapshot: torch.Tensor) -> torch.Tensor | None:
        """Encode overlap's Δ = θ_base − θ_local(t0) for saving (the push then sends these
        bytes); uint8, or None when Δ is not finite."""
        delta = torch.sub(self._base, snapshot)
        try:
            check_finite_delta(delta, self.worker_id, pending.num_local_steps)
        except InvalidPayloadError:
            return None
        return self.wire.encode(delta).clone()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict()`` before the worker joins; the first join continues the
        saved round if the server resumes it. Raises ConfigError as ``WorkerBase``'s."""
        if self.follower:
            return  # rank 0's state reaches the followers when the group joins
        super().load_state_dict(state)
        self._base.copy_(state["theta_base"])
        self.flat.load(state["theta_local"].to(self._base.dtype))
        self.version = int(state["version"])
        self._restored_push_id = int(state["next_push_id"])
        self._steps_since_sync = int(state["steps_since_sync"])  # counted on if the server resumes this worker
        self._tokens_since_sync = int(state["tokens_since_sync"])
        saved = state.get("pending")
        self._pending = None if saved is None else PendingPush(**saved)
