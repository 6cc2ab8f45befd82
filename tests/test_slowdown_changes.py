"""The worker's speed schedule (``--slowdown-changes``): parsing, checks, the factor at time t."""

from __future__ import annotations

import pytest

from asyncdiloco.errors import ConfigError
from asyncdiloco.job.slowdown import check_slowdown_changes, parse_slowdown_changes, slowdown_at


def test_parse_gives_time_factor_pairs():
    assert parse_slowdown_changes("30:4, 90:1") == ((30.0, 4.0), (90.0, 1.0))
    assert parse_slowdown_changes("0:2.5") == ((0.0, 2.5),)
    assert parse_slowdown_changes("") == ()


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("30", "item '30' is invalid: write SECONDS:FACTOR pairs"),
        ("a:2", "item 'a:2' is invalid"),
        ("10:0.5", "factor=0.5 at t=10.0 s is invalid: must be >= 1"),
        ("-1:2", "t=-1.0 s is invalid: give seconds since training began, >= 0"),
        ("10:2,10:3", "times must strictly increase (previous change at 10.0 s)"),
        ("20:2,10:3", "times must strictly increase (previous change at 20.0 s)"),
        ("inf:2", "t=inf s is invalid"),
        ("5:nan", "factor=nan at t=5.0 s is invalid"),
    ],
)
def test_bad_schedules_are_refused_naming_the_value(text, needle):
    with pytest.raises(ConfigError) as err:
        parse_slowdown_changes(text)
    assert needle in str(err.value)


def test_check_accepts_ints_and_returns_floats():
    assert check_slowdown_changes(((1, 2),)) == ((1.0, 2.0),)


def test_factor_at_time_t_is_the_last_change_at_or_before_t():
    changes = ((10.0, 4.0), (20.0, 1.5))
    assert [slowdown_at(t, 2.0, changes) for t in (0.0, 9.99, 10.0, 15.0, 20.0, 1e9)] == [2.0, 2.0, 4.0, 4.0, 1.5, 1.5]
    assert slowdown_at(5.0, 3.0, ()) == 3.0


def test_worker_cli_refuses_a_bad_schedule_in_one_line(cli_exit):
    code, err = cli_exit(["worker", "--server", "127.0.0.1:1", "--max-steps", "1", "--slowdown-changes", "5:0"])
    assert code == 2, err
    assert "factor=0.0 at t=5.0 s is invalid" in err and "Traceback" not in err
