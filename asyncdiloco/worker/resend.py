"""Resending what arrived corrupted in transit (``PayloadCorruptedError``), for client.py.

A push or pull whose payload CRC-32 or header CRC-32 (wire/header_crc.py) differs is made
again: a push with the same header and push id (the refusal applied nothing), a pull from
the start, up to ``resends`` more times with a backoff from ``backoff_s`` doubling. When
every try went over the bulk data channel, the channel is marked unusable as when it is
down (``BulkChannel.suspect``: gRPC until its backoff passes) and the transfer gets as many
tries over gRPC; only when the last of those arrived corrupted too is it raised.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from asyncdiloco.errors import PayloadCorruptedError
from asyncdiloco.worker.bulk_client import BulkChannel

log = logging.getLogger(__name__)

_T = TypeVar("_T")


class BulkCorrupted(PayloadCorruptedError):
    """A ``PayloadCorruptedError`` of a try over the bulk channel (it travels as its parent:
    it declares no reason of its own); ``resending_corrupted`` then goes on over gRPC."""


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


def resending_corrupted(
    call: Callable[[bool], _T],
    what: str,
    *,
    channel: Callable[[], BulkChannel | None],
    resends: int,
    backoff_s: float,
    address: str,
    on_corrupted: Callable[[], None],
) -> _T:
    """``call(bulk)``, made again while it arrives corrupted (module docstring).

    Args:
        call: one try; ``bulk`` False: over gRPC only. Its bulk-channel part runs inside
            ``over_bulk``.
        what: names the transfer in messages ("push 6 of worker 2").
        channel: the client's bulk channel now (None: none).
        resends: tries after the first of each round (``corrupted_resends``).
        backoff_s: seconds before the first resend; doubles with each.
        address: the server's gRPC address, for the message.
        on_corrupted: called once per corrupted try (the client's count).
    Raises:
        PayloadCorruptedError: every one of the ``1 + resends`` tries (over gRPC, after the
            bulk channel's round) was corrupted; the message names the count and what to check.
        Whatever else ``call`` raises.
    """
    bulk = channel() is not None
    while True:
        try:
            return _round(call, what, bulk, resends, backoff_s, address, on_corrupted)
        except BulkCorrupted as exc:  # the last try of the round went over the bulk channel
            now = channel()
            if not bulk or now is None:  # closed meanwhile: nothing to fall back from
                raise PayloadCorruptedError(str(exc)) from exc.__cause__
            now.suspect(exc)
            log.warning("%s arrived corrupted over the bulk data channel every time; sending it over gRPC", what)
            bulk = False


def _round(
    call: Callable[[bool], _T],
    what: str,
    bulk: bool,
    resends: int,
    backoff_s: float,
    address: str,
    on_corrupted: Callable[[], None],
) -> _T:
    """Up to ``1 + resends`` tries of ``call(bulk)`` while it arrives corrupted."""
    delay_s = backoff_s
    for attempt in range(1, resends + 2):
        try:
            return call(bulk)
        except PayloadCorruptedError as exc:
            on_corrupted()
            if attempt > resends:
                over = isinstance(exc, BulkCorrupted)
                error = BulkCorrupted if over else PayloadCorruptedError
                where = "over the bulk data channel" if over else "over gRPC"
                raise error(
                    f"{what} arrived corrupted {attempt} times in a row {where}"
                    f" (the limit is 1 + corrupted_resends={resends}; last: {exc}); the network path to {address} "
                    f"corrupts data: check its links, NICs and proxies"
                ) from exc
            log.warning("%s arrived corrupted (%s); sending it again in %.2f s", what, exc, delay_s)
            time.sleep(delay_s)
            delay_s *= 2
    raise AssertionError("unreachable")  # pragma: no cover
