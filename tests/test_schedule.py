"""DyLU (Liu et al. 2024, Eq. 6) and grouping (Alg. 2), alone and in the server."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from helpers import FakeClock

from asyncdiloco.algo.config import OuterConfig
from asyncdiloco.algo.schedule import GroupGate, GroupWindow, StepRateMeter, auto_window_s, dylu_local_steps
from asyncdiloco.errors import ConfigError
from asyncdiloco.ps.config import ServerConfig
from asyncdiloco.ps.state import ParameterServerState
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.tensors import Manifest


def test_dylu_follows_eq6():
    # H_w = floor(v_w / max v · H), at least 1
    rates = {1: 1 / 0.58, 2: 1 / 0.75, 3: 1 / 1.51, 4: 1 / 3.33}  # the authors' speeds, s/step
    h = dylu_local_steps(rates, 50)
    assert h == {1: 50, 2: 38, 3: 19, 4: 8}
    assert dylu_local_steps({1: 100.0, 2: 0.1}, 10) == {1: 10, 2: 1}
    assert dylu_local_steps({}, 10) == {}


def test_step_rate_meter_prefers_the_workers_own_compute_time():
    meter = StepRateMeter(alpha=0.5)
    meter.start(7, now=0.0)
    meter.record(7, 10, now=2.0)  # no compute_s: the interval since the join, 5 steps/s
    assert meter.rates[7] == 5.0
    meter.record(7, 10, now=30.0, compute_s=1.0)  # the worker's estimate: replaces, the wait does not count
    assert meter.rates[7] == 10.0
    meter.report(7, 7.5)
    assert meter.rates[7] == 7.5
    meter.record(7, 10, now=32.0)  # an interval (no compute_s) is averaged in: 0.5 · 7.5 + 0.5 · 5
    assert meter.rates[7] == 6.25
    meter.report(7, float("nan"))  # ignored
    meter.report(7, 0.0)
    assert meter.rates[7] == 6.25


def _state(**kw):
    clock = FakeClock()
    state = ParameterServerState(ServerConfig(port=0, local_steps=20, **kw), clock=clock)
    manifest = Manifest.from_named_tensors([("w", torch.zeros(4))])
    return state, manifest, clock


def _init(state, manifest, wid):
    state.intake.push(manifest.pack([torch.zeros(4)]), worker_id=wid, push_id=1, kind=pb.PUSH_KIND_INITIAL_PARAMETERS)


def _push(state, manifest, wid, push_id, steps, compute_s=0.0):
    payload = manifest.pack([torch.full((4,), 0.01)])
    return state.intake.push(
        payload, worker_id=wid, push_id=push_id, base_version=state.version, num_local_steps=steps, compute_s=compute_s
    )


def test_reported_rates_balance_the_first_round_before_any_push():
    state, manifest, _ = _state()
    slow, _, _ = state.join(manifest, "slow", steps_per_s=1 / 3.33)  # measured first: not the fastest for long
    assert state.local_steps_for(slow) == 20  # alone, it is the fastest
    fast, _, _ = state.join(manifest, "fast")
    state.heartbeat(fast, steps_per_s=1 / 0.58)  # timed over its first inner steps
    assert state.local_steps_for(fast) == 20
    assert state.local_steps_for(slow) == 3  # floor(0.58 / 3.33 · 20), before its first push
    assert state.run_config(slow).local_steps == 3 and state.run_config(slow).dylu


def test_dylu_takes_the_fastest_live_worker_and_follows_changing_speeds():
    state, manifest, _ = _state()
    a, _, _ = state.join(manifest, "a", steps_per_s=10.0)
    b, _, _ = state.join(manifest, "b", steps_per_s=5.0)
    _init(state, manifest, a)
    assert state.local_steps_for(b) == 10
    state.leave(a)  # the fastest left: b is now the fastest
    assert state.local_steps_for(b) == 20
    c, _, _ = state.join(manifest, "c", steps_per_s=5.0)
    for k in range(6):  # c speeds up to 20 steps/s of compute: its pushes say so
        _push(state, manifest, c, 2 + k, 20, compute_s=1.0)
    assert state.local_steps_for(c) == 20
    assert state.local_steps_for(b) == 5  # floor(5 / ~20 · 20)
    by_id = {w.worker_id: w for w in state.status().workers}
    assert by_id[b].local_steps_per_round == 5 and by_id[c].steps_per_s == pytest.approx(20.0, rel=0.05)


def test_dylu_off_gives_everyone_h():
    state, manifest, _ = _state(dylu=False)
    slow, _, _ = state.join(manifest, "slow", steps_per_s=0.1)
    state.join(manifest, "fast", steps_per_s=10.0)
    assert state.local_steps_for(slow) == 20


def test_window_is_anchored_at_the_first_arrival_and_never_chains():
    w = GroupWindow("window")
    live = {1, 2, 3}
    g1 = w.arrive(1, 0.0, live, window_s=1.0)
    assert w.arrive(2, 0.9, live, window_s=1.0) == g1  # inside the window
    assert not w.released(g1, 0.95)
    g2 = w.arrive(3, 1.8, live, window_s=1.0)  # a chained window would still hold g1
    assert g2 != g1 and w.release_time(g1) == 1.0 and w.released(g1, 1.8)
    assert w.deadline(g2) == pytest.approx(2.8)
    assert w.size_histogram == [0, 1]


def test_window_releases_as_soon_as_every_live_worker_arrived():
    w = GroupWindow("window")
    live = {1, 2}
    g = w.arrive(1, 0.0, live, window_s=5.0)
    assert not w.released(g, 0.1)
    assert w.arrive(2, 0.3, live, window_s=5.0) == g
    assert w.released(g, 0.3) and w.release_time(g) == 0.3
    # a worker that left is not waited for
    g = w.arrive(1, 1.0, live, window_s=5.0)
    w.recheck(1.2, {1})
    assert w.release_time(g) == 1.2


def test_barrier_releases_when_the_buffer_is_complete_or_at_its_cap():
    w = GroupWindow("barrier")
    g = w.arrive(1, 0.0, {1, 2}, window_s=30.0)
    assert w.arrive(1, 1.0, {1, 2}, window_s=30.0) == g  # the same worker twice: arrivals, not workers
    assert not w.released(g, 2.0)
    w.arrive(2, 3.0, {1, 2}, window_s=30.0, buffer_complete=True)
    assert w.release_time(g) == 3.0
    g = w.arrive(2, 4.0, {1, 2}, window_s=30.0)  # the other worker died: the cap releases it
    assert not w.released(g, 33.9) and w.released(g, 34.0) and w.release_time(g) == 34.0
    assert w.size_histogram == [1, 0, 1]


def test_off_releases_every_push_alone():
    w = GroupWindow("off")
    g = w.arrive(1, 0.0, {1, 2}, window_s=10.0)
    assert w.released(g, 0.0)
    with pytest.raises(ValueError, match="grouping 'ring' is unknown"):
        GroupWindow("ring")


def test_auto_window_is_one_round_of_the_fastest_worker():
    assert auto_window_s([1 / 0.58, 1 / 3.33], local_steps=20) == pytest.approx(20 * 0.58)
    assert auto_window_s([1 / 0.58, 1 / 3.33], local_steps=2) == pytest.approx(1.5 * 3.33)  # 1.5 slow steps
    assert auto_window_s([], local_steps=20) == 1.0
    assert auto_window_s([1e6], local_steps=1) == 0.05  # floor


def test_gate_holds_a_reply_until_the_last_live_worker_pushed():
    gate = GroupGate("window", time.monotonic)
    events = []
    g = gate.arrive(1, {1, 2}, window_s=60.0)
    started = threading.Event()

    def reply_1():
        started.set()
        gate.wait(g)
        events.append("1 replied")

    t = threading.Thread(target=reply_1)
    t.start()
    started.wait(10)
    events.append("2 arrives")
    assert gate.arrive(2, {1, 2}, window_s=60.0) == g
    t.join(timeout=10)
    assert not t.is_alive() and events == ["2 arrives", "1 replied"]


def test_gate_does_not_stall_past_the_cap_when_a_worker_died():
    gate = GroupGate("barrier", time.monotonic)
    g = gate.arrive(1, {1, 2}, window_s=0.2)  # worker 2 never pushes
    done = []
    t = threading.Thread(target=lambda: done.append(gate.wait(g)))
    t.start()
    t.join(timeout=30)
    assert not t.is_alive() and done[0] >= 0.0 and gate.window.release_time(g) == gate.window.deadline(g)


def test_server_groups_replies_and_a_leave_releases_the_group():
    state, manifest, clock = _state(grace_s=100.0)
    a, _, _ = state.join(manifest, "a", steps_per_s=1.0)
    b, _, _ = state.join(manifest, "b", steps_per_s=1.0)
    _init(state, manifest, a)
    out = _push(state, manifest, a, 2, 20)
    assert out.group_id and not state.groups.window.released(out.group_id, clock.now)
    state.leave(b)  # nobody else to wait for
    assert state.groups.window.released(out.group_id, clock.now)
    reply = state.intake.reply(out, a)
    assert reply.applied and reply.local_steps == 20
    assert list(state.status().group_size_histogram) == [1]


def test_sync_mode_never_groups():
    state, _, _ = _state(mode="sync")
    assert state.groups.window.mode == "off"


def test_grouping_config_is_validated():
    with pytest.raises(ConfigError, match="grace_s=-1"):
        ServerConfig(grace_s=-1)
    with pytest.raises(ConfigError, match="grouping='ring'"):
        ServerConfig(grouping="ring")
    with pytest.raises(ConfigError, match="group_max_wait_s=0"):
        ServerConfig(group_max_wait_s=0)
    OuterConfig()  # defaults stay valid


def test_server_defaults_are_the_suites_winner():
    d = ServerConfig()
    assert (d.outer.optimizer, d.dylu, d.grouping, d.grace_s) == ("delayed_nesterov", True, "window", None)
    assert ServerConfig(mode="sync").outer.optimizer == "nesterov"


def test_a_worker_that_stopped_pushing_stops_holding_groups_before_its_lease_lapses():
    state, manifest, clock = _state(lease_s=3600)
    a, _, _ = state.join(manifest, "a", steps_per_s=20.0)  # rounds of 1 s
    dead, _, _ = state.join(manifest, "dead", steps_per_s=20.0)
    _init(state, manifest, a)
    out = _push(state, manifest, a, 2, 20, compute_s=1.0)
    assert not state.groups.window.released(out.group_id, clock.now)  # "dead" may still come
    clock.now = 10.0  # more than two of its rounds plus the window without a push: not expected
    out = _push(state, manifest, a, 3, 20, compute_s=1.0)
    assert state.groups.window.released(out.group_id, clock.now)  # a group of one, released at once
    assert state.model.outer.config.dn_buffer == 0 and state.model.outer.arrivals == 0  # N = 1 expected worker
    assert {w.worker_id for w in state.status().workers if w.alive} == {a, dead}  # still leased


def test_a_reply_is_never_held_past_the_callers_deadline():
    gate = GroupGate("window", time.monotonic)
    g = gate.arrive(1, {1, 2}, window_s=600.0)
    done = []
    t = threading.Thread(target=lambda: done.append(gate.wait(g, max_wait_s=0.05)))
    t.start()
    t.join(timeout=30)
    assert not t.is_alive() and not gate.window.released(g, time.monotonic())


def test_stopping_releases_every_held_reply():
    gate = GroupGate("window", time.monotonic)
    g = gate.arrive(1, {1, 2}, window_s=600.0)
    t = threading.Thread(target=gate.wait, args=(g,))
    t.start()
    gate.close()
    t.join(timeout=30)
    assert not t.is_alive() and gate.window.released(g, time.monotonic())


def test_a_worker_without_a_rate_stops_holding_groups_after_the_longest_known_round():
    state, manifest, clock = _state(lease_s=3600)
    a, _, _ = state.join(manifest, "a", steps_per_s=20.0)  # rounds of 1 s
    ghost, _, _ = state.join(manifest, "ghost")  # joined, never steps, keeps its lease
    _init(state, manifest, a)
    clock.now = 10.0
    out = _push(state, manifest, a, 2, 20, compute_s=1.0)
    assert state.groups.window.released(out.group_id, clock.now)


def test_absurd_rates_are_clamped_and_the_auto_window_bounded():
    state, manifest, _ = _state()
    a, _, _ = state.join(manifest, "a", steps_per_s=1e-12)
    b, _, _ = state.join(manifest, "b", steps_per_s=1e300)
    assert state.run_config(a).group_window_s <= 600.0
    # b's rate is clamped to RATE_SPREAD (10) times a's: a runs H / 10, not 1 step
    assert state.local_steps_for(b) == 20 and state.local_steps_for(a) == 2


def test_barrier_needs_delayed_nesterov_and_releases_once_every_expected_worker_pushed():
    with pytest.raises(ConfigError, match="grouping='barrier'.*delayed_nesterov"):
        ServerConfig(grouping="barrier", outer=OuterConfig(optimizer="nesterov"))
    w = GroupWindow("barrier")
    g = w.arrive(1, 0.0, {1, 2}, window_s=30.0)
    w.arrive(2, 1.0, {1, 2}, window_s=30.0)  # a buffer of 4 would never fill with 2 workers
    assert w.release_time(g) == 1.0
