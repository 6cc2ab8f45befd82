"""What a worker does as a rank of a torchrun group (worker/group.py has the protocol).

``GroupMember`` is a mixin of ``WorkerBase``: the join's broadcast of rank 0's state,
the per-step exchange on rank 0 (``_lead_step``) and on the followers (``_follow_step``),
the sharing of a due step's outcome (``_shared``), and the collective stop request. A
worker without a group never calls these (``self.group`` is None), except
``request_stop`` / ``should_stop``, which work alone too.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from asyncdiloco.errors import AsyncDiLoCoError, ConfigError
from asyncdiloco.worker.flat import FlatParams
from asyncdiloco.worker.group import UNCHANGED, LocalGroup, StepTotals, noted, portable, to_cpu

log = logging.getLogger(__name__)


class GroupMember:
    """The group half of ``WorkerBase`` (attributes below are WorkerBase's)."""

    group: LocalGroup | None
    follower: bool
    flat: FlatParams
    inner_optimizer: torch.optim.Optimizer
    restored_extra: dict[str, Any]
    stats: Any
    _tokens_since_sync: int
    _steps_since_sync: int
    _stop_requested: bool
    _group_stopping: bool
    _group_joined: bool
    _group_broken: bool
    _in_shared: bool

    _rate_known: bool

    def _events_due(self) -> bool:
        raise NotImplementedError

    def _report_rate(self) -> None:
        raise NotImplementedError

    def _after_step_events(self) -> None:
        raise NotImplementedError

    def _share_join(self, error: BaseException | None = None) -> None:
        """Every rank of a group, at join: rank 0's outcome (its exception, raised on the
        followers too), then its inner optimizer's state, ``restored_extra`` and parameters.
        Rank 0 joined inside ``LocalGroup.leading``: the followers wait for its end
        through the keep-alives, however long the join's retries took."""
        group = self.group
        assert group is not None, "a group's join"
        joined: dict[str, Any] | None = None
        if not self.follower:
            joined = {"error": portable(error)} if error is not None else {}
            if error is None:
                joined.update(inner_optimizer=to_cpu(self.inner_optimizer.state_dict()), extra=self.restored_extra)
        try:
            if self.follower:
                group.await_code()  # rank 0's keep-alives while it joins (``LocalGroup.leading``)
            else:
                group.send_code(UNCHANGED)
            joined = group.broadcast_object(joined)
        except Exception:
            if error is not None:
                return  # the join's own error is what rank 0 raises
            raise
        assert joined is not None, "rank 0 broadcasts its join"
        if "error" in joined:
            if self.follower:
                exc = joined["error"]
                noted(exc, f"raised by rank 0's join; rank {group.rank} raises it too")
                raise exc
            return
        if self.follower:
            self.inner_optimizer.load_state_dict(joined["inner_optimizer"])
            self.restored_extra = dict(joined["extra"])
        group.broadcast_params(self.flat.params)
        self._group_joined = True

    def _check_group_state_dict(self) -> None:
        """``state_dict`` is rank 0's, and on rank 0 it may not merge a background sync
        outside a step (the merge would change rank 0's model alone)."""
        group = self.group
        if group is None:
            return
        if self.follower:
            raise ConfigError(
                f"state_dict() on rank {group.rank} of the group: the group's state is rank 0's (it saves it in "
                f"state_dir after every sync); call it on rank 0"
            )
        overlap = getattr(self, "_overlap", None)
        if overlap is not None and overlap.in_flight and not self._in_shared and not self._group_broken:
            raise ConfigError(
                "state_dict() on rank 0 while an overlapped sync is in flight: merging it now would change rank 0's "
                "model alone; let the worker save its state (state_dir), or call it after close()"
            )

    def request_stop(self) -> None:
        """Ask to stop training after the current inner step: ``should_stop`` turns True
        at once for a worker alone, and on every rank of a group after the next inner
        step (the request rides on that step's exchange), so that every rank's loop
        ends after the same step and none is left alone in a collective."""
        self._stop_requested = True

    @property
    def should_stop(self) -> bool:
        """``request_stop`` was called (alone), or some rank's request reached every rank
        with an inner step's exchange (group): end the training loop now."""
        return self._stop_requested if self.group is None else self._group_stopping

    def _lead_step(self) -> None:
        """Rank 0's step exchange: the followers' tokens arrive before the sync point, so
        the push carries them; then the due step runs and every rank takes its outcome.
        Until the first push (DyLU) every step is due: its rate report is a heartbeat to
        the server, which the followers wait for through rank 0's keep-alives too."""
        due = self._events_due() or not self._rate_known
        totals = self._exchange(tokens=0, due=due)
        self._tokens_since_sync += totals.tokens
        self.stats.tokens += totals.tokens
        if due:
            self._shared(self._due_step)

    def _due_step(self) -> None:
        """Rank 0's due step: the rate report before the first push (may change H_w), then
        the step's events (a sync point, a merge)."""
        if not self._rate_known:
            self._report_rate()
        self._after_step_events()

    def _follow_step(self) -> None:
        """A follower's step exchange: send the tokens since the last one; mirror a due step."""
        tokens, self._tokens_since_sync = self._tokens_since_sync, 0
        self._steps_since_sync = 0
        if self._exchange(tokens=tokens, due=False).due:
            started = time.monotonic()
            try:
                self._shared(lambda: None)
            finally:
                self.stats.blocked_s += time.monotonic() - started

    def _exchange(self, *, tokens: int, due: bool) -> StepTotals:
        """``LocalGroup.exchange`` (group.py); a failed collective ends the group's training here.

        Raises:
            AsyncDiLoCoError: the exchange failed (a rank died, or the group timed out).
        """
        group = self.group
        assert group is not None, "a group's exchange"
        try:
            totals = group.exchange(tokens=tokens, stop=self._stop_requested, due=due)
        except RuntimeError as exc:
            self._group_broken = True
            raise AsyncDiLoCoError(
                f"rank {group.rank}: the group's step exchange failed ({exc}); a rank of the torchrun group died "
                f"or stalled past the group's timeout; restart the group (its state folder resumes it)"
            ) from exc
        self._group_stopping = self._group_stopping or totals.stop
        return totals

    def _shared(self, action: Callable[[], Any], *, broken_ok: bool = False) -> Any:
        """Run ``action`` on rank 0 and share its outcome (group.py ``share_outcome``):
        the model changed (every rank takes rank 0's parameters), or it raised (every
        rank raises it). Followers pass a no-op and return whether the model changed.
        While ``action`` runs (it may wait on the server for long), rank 0 keeps the
        followers' collective alive (``LocalGroup.leading``).

        Returns:
            ``action()``'s result on rank 0; on a follower, True when the model changed.
        """
        group = self.group
        assert group is not None and (broken_ok or not self._group_broken), "a live group shares outcomes"
        if self.follower:
            try:
                return group.share_outcome(self.flat.params)
            except BaseException:
                self._group_broken = True
                raise
        writes = self.flat.writes
        self._in_shared = True
        try:
            with group.leading(closing=broken_ok):  # the followers wait through keep-alives, however long
                result = action()
        except BaseException as exc:
            self._group_broken = True
            with contextlib.suppress(RuntimeError):  # a dead group: rank 0 raises its own error
                group.share_outcome(self.flat.params, error=exc)
            raise
        finally:
            self._in_shared = False
        group.share_outcome(self.flat.params, changed=self.flat.writes != writes, closing=broken_ok)
        return result
