"""The tries of one push or pull while it arrives corrupted (``PayloadCorruptedError``),
for client.py: how many, the backoff between them, and the move from the bulk data channel
to gRPC (docs/protocol.md, "Corrupted transfers").
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator

from asyncdiloco.errors import PayloadCorruptedError
from asyncdiloco.worker.bulk_client import BulkChannel

log = logging.getLogger(__name__)


class BulkCorrupted(PayloadCorruptedError):
    """A ``PayloadCorruptedError`` of a try over the bulk channel (it travels as its parent:
    it declares no reason of its own); ``CorruptedResends`` then goes on over gRPC."""


@contextlib.contextmanager
def over_bulk() -> Iterator[None]:
    """A ``PayloadCorruptedError`` raised inside (a transfer over the bulk channel) becomes
    a ``BulkCorrupted``."""
    try:
        yield
    except BulkCorrupted:
        raise
    except PayloadCorruptedError as exc:
        raise BulkCorrupted(str(exc)) from exc


class CorruptedResends:
    """The tries of one transfer: one that arrived corrupted is made again up to ``resends``
    more times, backing off from ``backoff_s`` seconds, doubling; when every try went over
    the bulk channel, it is marked unusable and as many tries go over gRPC.
    ``what`` names the transfer; ``on_corrupted`` is called once per corrupted try.
    """

    def __init__(
        self,
        what: str,
        *,
        channel: Callable[[], BulkChannel | None],
        resends: int,
        backoff_s: float,
        address: str,
        on_corrupted: Callable[[], None],
    ) -> None:
        self.what, self._channel, self._resends, self._backoff_s = what, channel, resends, backoff_s
        self._address, self._on_corrupted = address, on_corrupted
        #: The next try may go over the bulk channel (False: gRPC only).
        self.bulk = channel() is not None
        self._tries, self._delay_s = 0, backoff_s

    def failed(self, exc: PayloadCorruptedError) -> None:
        """A try arrived corrupted: wait before the next one, or move to gRPC.

        Raises:
            PayloadCorruptedError: every one of the ``1 + resends`` tries (over gRPC, after
                the bulk channel's round) was corrupted; the message names the count and
                what to check.
        """
        self._on_corrupted()
        self._tries += 1
        if self._tries <= self._resends:
            log.warning("%s arrived corrupted (%s); sending it again in %.2f s", self.what, exc, self._delay_s)
            time.sleep(self._delay_s)
            self._delay_s *= 2
            return
        over = isinstance(exc, BulkCorrupted)
        message = (
            f"{self.what} arrived corrupted {self._tries} times in a row "
            f"{'over the bulk data channel' if over else 'over gRPC'} (the limit is 1 + corrupted_resends="
            f"{self._resends}; last: {exc}); the network path to {self._address} corrupts data: check its links, "
            f"NICs and proxies"
        )
        channel = self._channel()
        if not (over and self.bulk and channel is not None):  # nothing to fall back from
            raise PayloadCorruptedError(message) from exc
        channel.suspect(BulkCorrupted(message))
        log.warning("%s arrived corrupted over the bulk data channel every time; sending it over gRPC", self.what)
        self.bulk, self._tries, self._delay_s = False, 0, self._backoff_s
