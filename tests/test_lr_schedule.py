"""lr_factor against hand-computed values, and LRSchedule's validation."""

import math

import pytest

from asyncdiloco.errors import ConfigError
from asyncdiloco.lr_schedule import LRSchedule, lr_factor

COSINE = LRSchedule(kind="cosine", warmup=10, total=110, min_ratio=0.1)


def test_default_schedule_is_exactly_one_everywhere():
    assert all(lr_factor(LRSchedule(), t) == 1.0 for t in (0, 1, 10, 10**9))


def test_warmup_starts_at_one_over_w_and_peaks_at_w_minus_one():
    assert lr_factor(COSINE, 0) == pytest.approx(0.1)  # (0 + 1) / 10: the first update moves
    assert lr_factor(COSINE, 4) == pytest.approx(0.5)
    assert lr_factor(COSINE, 9) == 1.0  # the last warmup step is the peak
    assert lr_factor(COSINE, 10) == 1.0  # the cosine starts at the peak


def test_cosine_midpoint_is_halfway_between_peak_and_floor():
    assert lr_factor(COSINE, 60) == pytest.approx(0.1 + 0.9 * 0.5)  # (t − W)/(T − W) = 1/2
    quarter = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4))
    assert lr_factor(COSINE, 35) == pytest.approx(quarter)


def test_cosine_stays_at_the_floor_from_total_on():
    assert lr_factor(COSINE, 109) == pytest.approx(0.1, abs=1e-3)
    assert [lr_factor(COSINE, t) for t in (110, 111, 10**6)] == [0.1, 0.1, 0.1]


def test_cosine_decreases_monotonically_after_warmup():
    values = [lr_factor(COSINE, t) for t in range(10, 120)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_constant_with_warmup_ramps_then_holds():
    sched = LRSchedule(kind="constant", warmup=4)
    assert [lr_factor(sched, t) for t in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_cosine_without_warmup_starts_at_the_peak():
    sched = LRSchedule(kind="cosine", total=2, min_ratio=0.0)
    assert [lr_factor(sched, t) for t in range(3)] == [1.0, pytest.approx(0.5), 0.0]


def test_negative_step_is_refused():
    with pytest.raises(ValueError, match="step is -1"):
        lr_factor(COSINE, -1)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"kind": "linear"}, "kind='linear' is invalid: choose one of"),
        ({"warmup": -1}, "warmup=-1 is invalid"),
        ({"kind": "cosine", "warmup": 10, "total": 10}, r"total=10 is invalid: .*total > warmup=10"),
        ({"kind": "cosine"}, r"total=0 is invalid"),
        ({"min_ratio": 1.5}, r"min_ratio=1.5 is invalid: must lie in \[0, 1\]"),
        ({"min_ratio": -0.1}, r"min_ratio=-0.1 is invalid"),
    ],
)
def test_invalid_schedules_name_the_value_and_the_limit(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        LRSchedule(**kwargs)
