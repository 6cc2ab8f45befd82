"""The client side of long-polled sync waits: ask again after a jittered pause growing from
``POLL_MIN_S`` to ``POLL_MAX_S`` until the answer is final. docs/protocol.md, "Long-polled waits".
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import TypeVar

#: The first pause between polls, seconds.
POLL_MIN_S = 0.05
#: Each pause is this many times the previous step.
POLL_GROWTH = 1.5
#: The longest pause between polls, seconds (far below the server's keep window, 15 s).
POLL_MAX_S = 1.0

R = TypeVar("R")


def poll(
    ask: Callable[[float], R],
    again: Callable[[R], bool],
    timeout_s: float,
) -> R:
    """Ask until the answer is final or ``timeout_s`` seconds passed.

    Args:
        ask: one call, given the seconds left of the whole wait (> 0); returns the reply.
        again: whether a reply asks for another poll (pending / not decided).
        timeout_s: seconds the whole wait may take, > 0.
    Returns:
        The last reply: final, or the one after which the wait ran out.
    Raises:
        Whatever ``ask`` raises (a refusal, the server unreachable): not retried here.
    """
    end = time.monotonic() + timeout_s
    step = POLL_MIN_S
    pause = threading.Event()  # never set: the pause between polls
    while True:
        reply = ask(max(end - time.monotonic(), 1e-3))
        left = end - time.monotonic()
        if not again(reply) or left <= 0:
            return reply
        pause.wait(min(left, step * random.uniform(0.5, 1.0)))
        step = min(POLL_MAX_S, step * POLL_GROWTH)


__all__ = ["POLL_MAX_S", "POLL_MIN_S", "poll"]
