"""A sharded server's order: shard 0 decides every push (accept, τ, s(τ), N, the version
it makes) and the followers apply their part in that order (``OrderGate``), a part that
never comes as a zero pseudo-gradient after ``shard_fill_timeout_s``. The decision rides
in the ``adl-shard-order`` metadata as ``"V,τ,s(τ) as float.hex,N"``.
docs/architecture.md, "A sharded parameter server".
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from asyncdiloco.errors import InvalidPayloadError

log = logging.getLogger(__name__)

#: gRPC metadata key of a shard-0 decision (reply trailer on shard 0, call metadata to followers).
METADATA_KEY = "adl-shard-order"


@dataclasses.dataclass(frozen=True)
class ShardOrder:
    """Shard 0's decision on one pseudo-gradient push.

    Attributes:
        version_after: V + 1, the version the push makes (its place in the order).
        tau: staleness τ on shard 0. weight: s(τ). num_workers: N, the live workers.
        closing: a worker's closing push (outer.py ``step_closing``): the direct term alone.
    """

    version_after: int
    tau: int
    weight: float
    num_workers: int
    closing: bool = False

    def encode(self) -> str:
        text = f"{self.version_after},{self.tau},{float(self.weight).hex()},{self.num_workers}"
        return text + ",closing" if self.closing else text

    @classmethod
    def decode(cls, text: str) -> ShardOrder:
        """Raises InvalidPayloadError: not ``"V,τ,weight-hex,N"`` (then ``",closing"`` for
        a closing push) with V ≥ 1, τ ≥ 0, N ≥ 1."""
        try:
            v, tau, weight, n, *rest = text.split(",")
            if rest not in ([], ["closing"]):
                raise ValueError(text)
            order = cls(int(v), int(tau), float.fromhex(weight), int(n), closing=bool(rest))
        except ValueError:
            order = None
        if order is None or order.version_after < 1 or order.tau < 0 or order.num_workers < 1:
            raise InvalidPayloadError(
                f"metadata {METADATA_KEY}={text!r} is not 'V,tau,weight-hex,N' with V >= 1, tau >= 0, N >= 1; "
                f"send the decision shard 0 returned"
            )
        return order


#: The decision that came with the push being received on this thread (transport/grpc_service.py sets it).
CURRENT: contextvars.ContextVar[ShardOrder | None] = contextvars.ContextVar("adl_shard_order", default=None)


def order_from_metadata(metadata) -> ShardOrder | None:
    """The decision in gRPC invocation metadata (pairs of key, value), or None."""
    for key, value in metadata or ():
        if key == METADATA_KEY:
            return ShardOrder.decode(value if isinstance(value, str) else value.decode())
    return None


class OrderGate:
    """A follower shard's wait for its turn in shard 0's order (module docstring).

    Args:
        version: () -> the shard's current version.
        fill_zero: (decision, worker id of the waiting push) -> applies zero pseudo-gradients
            until the version is ``decision.version_after − 1`` (the apply lock taken inside).
        timeout_s: how long a push waits for the one before it before that one is filled with zeros.
        clock: monotonic seconds.
    """

    def __init__(
        self,
        version: Callable[[], int],
        fill_zero: Callable[[ShardOrder, int], None],
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._version = version
        self._fill_zero = fill_zero
        self.timeout_s = timeout_s
        self._clock = clock
        self._cond = threading.Condition()
        #: Pseudo-gradients applied as zeros because their part never came (metrics, tests).
        self.zero_filled = 0
        #: Pushes waiting for their turn now.
        self.waiting = 0

    def wait_turn(self, order: ShardOrder, worker_id: int) -> None:
        """Block until the version is ``order.version_after − 1``; after ``timeout_s``, fill the gap with zeros."""
        deadline = self._clock() + self.timeout_s
        with self._cond:
            self.waiting += 1
            try:
                while self._version() < order.version_after - 1:
                    remaining = deadline - self._clock()
                    if remaining <= 0:
                        break
                    self._cond.wait(remaining)
            finally:
                self.waiting -= 1
        if self._version() < order.version_after - 1:
            missing = order.version_after - 1 - self._version()
            log.warning(
                "shard order: %d push(es) before version %d never reached this shard within %.1f s; "
                "applying them as zero pseudo-gradients",
                missing,
                order.version_after,
                self.timeout_s,
            )
            self._fill_zero(order, worker_id)
            self.notify()

    def notify(self) -> None:
        """The version moved: wake the waiting pushes."""
        with self._cond:
            self._cond.notify_all()
