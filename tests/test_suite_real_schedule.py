"""suite_real maps a profile's virtual schedule onto the real clock as its docstring says:
speeds ÷ v_min become slowdowns, virtual times × r / v_min become real seconds."""

from __future__ import annotations

import pytest

from asyncdiloco.bench.profiles import PROFILES, Profile
from asyncdiloco.bench.sim import SimConfig
from asyncdiloco.bench.suite_config import REAL_SUITES
from asyncdiloco.bench.suite_real import REAL_STEP_S, changes_flag, real_schedule, server_flags
from asyncdiloco.errors import ConfigError


def test_changing_profile_maps_times_by_r_over_the_fastest_speed():
    r = 0.02  # real s per step at --slowdown 1
    sched = real_schedule(PROFILES["changing"], r)  # speeds (0.58, 0.75, 1.51, 3.33); at t=100: w0 -> 3.33, w3 -> 0.58
    assert sched.real_s_per_virtual_s == pytest.approx(r / 0.58)
    assert sched.slowdowns == pytest.approx((1.0, 0.75 / 0.58, 1.51 / 0.58, 3.33 / 0.58))
    t_real = 100.0 * r / 0.58
    (c0,), (), (), (c3,) = sched.slowdown_changes
    assert c0 == pytest.approx((t_real, 3.33 / 0.58)) and c3 == pytest.approx((t_real, 1.0))
    assert sched.leave_rejoin is None
    # a worker of speed v takes r·v/v_min real s per step, so the change lands after the same number of its steps
    assert t_real / (r * sched.slowdowns[0]) == pytest.approx(100.0 / 0.58)


def test_leave_rejoin_profile_maps_both_times():
    sched = real_schedule(PROFILES["leave_rejoin"], 0.01)  # speeds all 1.0; worker 3 away from 60 to 200
    assert sched.slowdowns == (1.0, 1.0, 1.0, 1.0)
    assert sched.leave_rejoin == pytest.approx((3, 0.6, 2.0))
    assert sched.slowdown_changes == ((), (), (), ())


def test_the_fastest_speed_counts_changed_speeds_too():
    sched = real_schedule(Profile(speeds_s_per_step=(2.0, 4.0), speed_changes=((10.0, 1, 1.0),)), 0.1)
    assert sched.slowdowns == (2.0, 4.0)  # relative to 1.0, the fastest speed anyone reaches
    assert sched.slowdown_changes == ((), ((1.0, 1.0),))


def test_changes_become_the_worker_flag():
    assert changes_flag(((1.5, 5.741379), (3.0, 1.0))) == ("--slowdown-changes", "1.5000:5.74138,3.0000:1")
    assert changes_flag(()) == ()


@pytest.mark.parametrize("r", [0.0, -1.0, float("nan")])
def test_bad_step_time_is_refused(r):
    with pytest.raises(ConfigError, match="real_s_per_step=.* is invalid"):
        real_schedule(PROFILES["uneven"], r)


def test_full_real_suite_covers_every_profile_and_quick_stays_uneven():
    assert REAL_SUITES["full"].profiles == ("homogeneous", "uneven", "straggler", "changing", "leave_rejoin")
    assert REAL_SUITES["quick"].profiles == ("uneven",) and len(REAL_SUITES["quick"].seeds) == 3


def test_sync_quorum_does_not_wait_for_the_worker_that_is_away():
    prof = PROFILES["leave_rejoin"]
    cfg = SimConfig(
        method="sync_diloco", speeds_s_per_step=prof.speeds_s_per_step, total_steps=100, leave_rejoin=prof.leave_rejoin
    )
    _, flags, _ = server_flags(cfg)
    assert flags[flags.index("--min-workers") + 1] == "3"


def test_real_methods_get_the_simulators_server_settings():
    from asyncdiloco.cli import app as cli
    from asyncdiloco.cli.server import config

    kw = dict(speeds_s_per_step=(1.0, 2.0), total_steps=100)
    mode, flags, worker_args = server_flags(SimConfig(method="async_dn_dylu", **kw))
    pace = ("--step-s", str(REAL_STEP_S))  # every real run's steps last at least that long
    assert mode == "async" and worker_args == pace
    args = cli.build_parser().parse_args(["server", *flags])
    server = config(args)
    sim = SimConfig(method="async_dn_dylu", **kw).server_config()
    assert (server.outer, server.dylu, server.grouping, server.grace_s) == (
        sim.outer,
        sim.dylu,
        sim.grouping,
        sim.grace_s,
    )
    assert server_flags(SimConfig(method="async_dn_dylu_overlap", **kw))[2] == ("--overlap", *pace)
    _, flags, _ = server_flags(SimConfig(method="async_nesterov", **kw))
    server = config(cli.build_parser().parse_args(["server", *flags]))
    assert (server.outer.optimizer, server.dylu, server.grouping) == ("nesterov", False, "off")


def test_rate_figures_compare_the_rates_dylu_used_with_the_measured_compute():
    from asyncdiloco.bench.suite_real import rate_figures

    def worker(index, factor, compute_rate, reported, h_w):
        return {
            "index": index,
            "speed_factor": factor,
            "timed_steps": 100,
            "compute_s": 100 / compute_rate,
            "steps_per_s": reported,
            "local_steps_per_round": h_w,
        }

    workers = [worker(0, 1.0, 20.0, 20.0, 20), worker(1, 2.0, 10.0, 11.5, 11), {"index": 2, "timed_steps": 0}]
    figs = rate_figures(workers, 20)
    assert [w["index"] for w in figs["workers"]] == [0, 1]  # a worker that timed nothing (sync) is left out
    slow = figs["workers"][1]
    assert slow["rate_ratio_error"] == pytest.approx(0.15)  # 11.5/20 against 10/20
    assert slow["h_ratio_error"] == pytest.approx(0.10) and slow["dylu_local_steps"] == 10
    assert figs["max_rate_ratio_error"] == pytest.approx(0.15) and not figs["within_target"]
    assert rate_figures([{"index": 0, "timed_steps": 0}], 20) is None


def test_the_pace_sleeps_inside_the_step_to_the_padded_slowed_time(monkeypatch):
    from asyncdiloco.cli import train

    slept = []
    monkeypatch.setattr(train.time, "sleep", slept.append)
    pace = train._Pace(3.0, (), step_s=0.05)
    pace.in_step(0, 0.0, so_far_s=0.01)  # first step: c is its forward and backward
    pace.after_step(0.02 + slept[-1])  # it computed 0.02 s at full speed
    pace.in_step(1, 1.0, so_far_s=0.01)
    assert slept == pytest.approx([3 * 0.05 - 0.01, 3 * 0.05 - 0.02])
    fast = train._Pace(1.0, ())
    fast.in_step(0, 0.0, so_far_s=0.01)
    assert len(slept) == 2  # full speed, no padding: no sleep
