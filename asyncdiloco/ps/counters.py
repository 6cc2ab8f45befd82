"""The parameter server's status numbers: pushes applied, refused and retried, bytes,
pulls, tokens and the staleness histogram (StatusReply; part of every checkpoint).

Guarded by the state's books lock (records.py ``StateLocks``): every method is called
with it held.
"""

from __future__ import annotations

import dataclasses

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


@dataclasses.dataclass
class Counters:
    """Server-wide totals since the run began (restored from checkpoints).

    Args:
        histogram_buckets: buckets of ``staleness_histogram`` (>= 2); the last counts
            every larger τ.
    """

    histogram_buckets: int
    applied_pushes: int = 0
    rejected_pushes: int = 0
    duplicate_pushes: int = 0
    bytes_pushed: int = 0
    bytes_pulled: int = 0
    pulls: int = 0
    tokens: int = 0
    #: Applied pseudo-gradients per staleness τ (sync rounds count at τ = 0).
    staleness_histogram: list[int] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.staleness_histogram = [0] * self.histogram_buckets

    def count_applied(self, tau: int, num_tokens: int) -> None:
        """One pseudo-gradient (or one member's share of a round) of staleness ``tau`` was applied."""
        self.applied_pushes += 1
        self.tokens += num_tokens
        self.staleness_histogram[min(tau, len(self.staleness_histogram) - 1)] += 1

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
