"""Dropped pseudo-gradients: their reasons, the fix to name for each, the count of drops in
a row that raises (``WorkerConfig.max_dropped_in_a_row``), and the inner optimizer's state
cleared after a non-finite one (docs/operations.md, "When a sync fails").
"""

from __future__ import annotations

import logging

import torch

from asyncdiloco.errors import AsyncDiLoCoError

log = logging.getLogger(__name__)

#: ``WorkerStats.drops`` keys of the drops without a refusal (a refusal's key is its reason):
#: Δ found not finite before it was sent (a diverged local model), a retry answered as a
#: duplicate never applied, a rejoin the server did not resume.
NON_FINITE = "non_finite"
NOT_APPLIED = "not_applied"
NOT_RESUMED = "not_resumed"

#: Why a push answered ``duplicate`` without ``applied`` is dropped: its id is at or below
#: the highest one the server applied for this worker, and its outcome is no longer known.
NOT_APPLIED_WORDS = (
    "answered as a duplicate that was not applied (its id is at or below the newest one the server applied "
    "for this worker)"
)

#: What the user can change when every push is dropped, by drop reason.
FIXES = {
    NON_FINITE: (
        "the local model diverges every round: check the data and the loss for NaN/Inf, lower the inner "
        "learning rate (--inner-lr) or clip the gradients"
    ),
    "invalid_payload": (
        "the server refuses its values (not finite, or over --max-abs-value): lower the inner learning rate "
        "(--inner-lr) or clip the gradients"
    ),
    "payload_too_large": "start the server with a larger --max-payload-bytes, or a smaller --wire-codec",
    "stale_push": (
        "every push arrives too stale: start the server with a larger --max-staleness, or lower H (--local-steps)"
    ),
    "unknown_version": "the server's version went back (a restart from an older checkpoint): check its checkpoints",
}
FIX_OTHERWISE = "the server's log says why it refused them"


def drop_words(push_id: int, reason: str, exc: BaseException) -> str:
    """How a dropped push is named in the log and in the error after too many drops."""
    if reason == NON_FINITE:
        return str(exc)
    return f"push {push_id} refused ({exc})"


class DropStreak:
    """Pseudo-gradients dropped in a row (refused, or not finite) since one was applied.

    Args:
        limit: ``config.max_dropped_in_a_row`` (0: never raise).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.count = 0
        #: The newest drop: (exception class, what happened, the fix).
        self.last: tuple[type[AsyncDiLoCoError], str, str] | None = None

    def note(self, error: type[AsyncDiLoCoError], what: str, fix: str) -> None:
        """One more dropped: ``what`` happened to it (a refusal of class ``error``, or a
        local check), and ``fix`` is what the user can change."""
        self.count += 1
        self.last = (error, what, fix)

    def applied(self) -> None:
        """A pseudo-gradient was applied: the count starts again from 0."""
        self.count = 0

    def raise_at_limit(self, who: str) -> None:
        """After ``limit`` drops in a row, raise once (the count starts again, so a caller
        who catches it and trains on is told again after as many more): a worker whose
        every push is dropped does not spin silently.

        Raises:
            the newest drop's class (InvalidPayloadError for a diverged model,
            StalePushError, PayloadTooLargeError, ...), naming ``who``, the count, the
            limit, the newest drop and the fix.
        """
        if not self.limit or self.count < self.limit or self.last is None:
            return
        error, what, fix = self.last
        count, self.count = self.count, 0
        raise error(
            f"{who}: the last {count} pseudo-gradients were all dropped, none applied (the limit is "
            f"max_dropped_in_a_row={self.limit}); the newest: {what}; {fix}"
        )


def reset_diverged_state(optimizer: torch.optim.Optimizer, worker_id: int) -> int:
    """After a non-finite pseudo-gradient: clear the inner optimizer's per-parameter state
    (AdamW's moments and step, SGD's momentum buffer) of every parameter whose state holds
    a NaN or ±Inf. One NaN gradient is enough to poison it, and restarting the model from
    the global one would not help: every later step would make θ_local NaN again. A
    cleared state starts afresh at the next step, as for a new parameter.

    Returns:
        How many parameters' states were cleared.
    """
    cleared = 0
    state = optimizer.state
    for param in list(state.keys()):
        values = [v for v in state[param].values() if isinstance(v, torch.Tensor) and v.is_floating_point()]
        if any(not bool(torch.isfinite(v).all()) for v in values):
            state[param] = {}
            cleared += 1
    if cleared:
        log.warning(
            "worker %d: the inner optimizer's state of %d parameter(s) held NaN/Inf (e.g. from one NaN "
            "gradient); cleared, they start afresh at the next step",
            worker_id,
            cleared,
        )
    return cleared
