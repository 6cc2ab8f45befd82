"""A worker's artificial slowness (``--slowdown``, ``--slowdown-changes``): the demo and the
benchmark suite give the workers of one machine different speeds, and a schedule changes
a worker's factor during the run.
"""

from __future__ import annotations

import math

from asyncdiloco.errors import ConfigError

#: A worker's speed schedule: ((t_s, factor), ...), strictly increasing t_s (seconds since
#: the worker began training), each factor >= 1 (the ``slowdown`` from t_s on).
SlowdownChanges = tuple[tuple[float, float], ...]


def parse_slowdown_changes(text: str) -> SlowdownChanges:
    """Parse ``"T1:F1,T2:F2"`` (``asyncdiloco worker --slowdown-changes``) into
    ``((T1, F1), (T2, F2))`` and check it (``check_slowdown_changes``); "" is no change.

    Raises:
        ConfigError: an item is not ``T:F``, or the schedule breaks a limit.
    """
    changes = []
    for item in (i.strip() for i in text.split(",") if i.strip()):
        t, sep, f = item.partition(":")
        try:
            if not sep:
                raise ValueError
            changes.append((float(t), float(f)))
        except ValueError:
            raise ConfigError(
                f"--slowdown-changes item {item!r} is invalid: write SECONDS:FACTOR pairs separated by commas, "
                f"e.g. 30:4,90:1 (from 30 s of training on 4x slower, from 90 s on full speed)"
            ) from None
    return check_slowdown_changes(tuple(changes))


def check_slowdown_changes(changes: SlowdownChanges) -> SlowdownChanges:
    """``changes`` as a tuple of (float, float) pairs, if every time is finite and >= 0,
    the times strictly increase and every factor is finite and >= 1.

    Raises:
        ConfigError: naming the pair and the limit it broke.
    """
    out, last = [], -math.inf
    for t_s, factor in changes:
        t_s, factor = float(t_s), float(factor)
        if not (math.isfinite(t_s) and t_s >= 0):
            raise ConfigError(f"slowdown change at t={t_s} s is invalid: give seconds since training began, >= 0")
        if not t_s > last:
            raise ConfigError(
                f"slowdown change at t={t_s} s is invalid: times must strictly increase (previous change at "
                f"{last} s); list the changes in time order, one per time"
            )
        if not (math.isfinite(factor) and factor >= 1.0):
            raise ConfigError(
                f"slowdown change to factor={factor} at t={t_s} s is invalid: "
                "must be >= 1 (1 = full speed, 2 = twice as slow)"
            )
        out.append((t_s, factor))
        last = t_s
    return tuple(out)


def slowdown_at(t_s: float, slowdown: float, changes: SlowdownChanges) -> float:
    """The slowdown factor in force ``t_s`` seconds after the worker began training:
    ``slowdown`` until the first change, then the factor of the last change at or
    before ``t_s``. ``changes`` as ``check_slowdown_changes`` returns it."""
    factor = slowdown
    for when_s, f in changes:
        if when_s > t_s:
            break
        factor = f
    return factor
