"""Reported rates are validated and bounded by the fleet, and a held push reply goes out
once its group cannot grow (schedule.py ``RATE_SPREAD``, ``GroupGate.wait`` with
``refresh``; registry.py ``check_rate``; intake.py ``PushIntake._group_now``)."""

from __future__ import annotations

import math
import threading

import pytest
import torch
from helpers import STUCK_S, FakeClock, wait_until

from asyncdiloco.algo.schedule import RATE_SPREAD, GroupGate, StepRateMeter
from asyncdiloco.errors import InvalidPayloadError
from asyncdiloco.ps import ParameterServerState
from asyncdiloco.ps.config import ServerConfig
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.tensors import Manifest

pytestmark = pytest.mark.timeout(60)

MANIFEST = Manifest.from_named_tensors([("w", torch.zeros(4))])


def _state(**kw):
    clock = FakeClock()
    return ParameterServerState(ServerConfig(port=0, **kw), clock=clock), clock


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -5.0])
def test_a_nan_infinite_or_negative_rate_is_refused_and_changes_nothing(bad):
    state, _ = _state(local_steps=20)
    a = state.join_worker(MANIFEST, "a", 10.0).worker_id
    with pytest.raises(InvalidPayloadError, match=r"steps_per_s is .*finite number of steps per second >= 0"):
        state.join_worker(MANIFEST, "b", bad)
    assert [w.worker_name for w in state.status().workers] == ["a"]  # the refused Join registered nobody
    b = state.join_worker(MANIFEST, "b", 10.0).worker_id
    with pytest.raises(InvalidPayloadError, match="steps_per_s is"):
        state.heartbeat(b, bad)
    assert state.local_steps_for(a) == state.local_steps_for(b) == 20  # b's rate is still 10


def test_a_rate_is_clamped_to_within_the_spread_of_the_fleets_median():
    meter = StepRateMeter(alpha=1.0)
    meter.report(1, 10.0)
    meter.report(2, 12.0)
    meter.report(3, 1e300)
    meter.report(4, 1e-6)
    assert meter.rates[3] == 11.0 * RATE_SPREAD  # median of 10 and 12
    assert meter.rates[4] == 12.0 / RATE_SPREAD  # median of 10, 12 and 110
    state, _ = _state(local_steps=20)
    a = state.join_worker(MANIFEST, "a", 10.0).worker_id
    b = state.join_worker(MANIFEST, "b", 10.0).worker_id
    state.heartbeat(b, 1e300)
    assert state.local_steps_for(a) >= 20 // int(RATE_SPREAD)  # at least H / 10, not 1 step
    # the auto window: at least one round of a worker at most RATE_SPREAD times a's speed
    assert state.run_config(a).group_window_s >= 20 / (10.0 * RATE_SPREAD)


def test_a_held_push_is_released_when_the_awaited_workers_lease_lapses():
    """The black-box fault: b reports a tiny rate and goes silent; a's push was held for
    the whole 600 s window although b's lease lapsed after 6 s."""
    state, clock = _state(local_steps=2, lease_s=6.0)
    a = state.join_worker(MANIFEST, "a", 20.0).worker_id
    state.intake.push(MANIFEST.pack([torch.zeros(4)]), worker_id=a, push_id=1, kind=pb.PUSH_KIND_INITIAL_PARAMETERS)
    b = state.join_worker(MANIFEST, "b", 1e-6).worker_id
    state.heartbeat(b, 1e-6)
    clock.advance(0.1)
    out = state.intake.push(MANIFEST.pack([torch.full((4,), 0.01)]), worker_id=a, push_id=2, base_version=state.version,
                     num_local_steps=2, compute_s=0.1)  # fmt: skip
    replies: list[pb.PushReply] = []
    held = threading.Thread(target=lambda: replies.append(state.intake.reply(out, a)), daemon=True)
    held.start()
    assert not state.groups.window.released(out.group_id, clock.now)  # b is expected: a's reply is held
    for _ in range(2):  # b silent past its lease (7 s > 6 s); a heartbeats and stays leased
        clock.advance(3.5)
        state.heartbeat(a, 20.0)
    held.join(timeout=STUCK_S)
    assert not held.is_alive() and replies[0].applied
    assert state.groups.window.release_time(out.group_id) is not None


def test_a_held_reply_rechecks_its_group_and_its_shrunk_window():
    clock = FakeClock()
    gate = GroupGate("window", clock)
    g = gate.arrive(1, {1, 2}, window_s=600.0)
    now: dict[str, object] = {"expected": {1, 2}, "window": 600.0}
    done: list[float] = []
    t = threading.Thread(target=lambda: done.append(gate.wait(g, refresh=lambda: (now["expected"], now["window"]))))
    t.start()
    now["window"] = 5.0  # the slow worker's rate went: the window is 5 s now
    clock.advance(6.0)
    t.join(timeout=STUCK_S)
    assert not t.is_alive() and gate.window.release_time(g) == 5.0
    g2 = gate.arrive(1, {1, 2}, window_s=600.0)
    t = threading.Thread(target=lambda: done.append(gate.wait(g2, refresh=lambda: ({1}, 600.0))))
    t.start()
    wait_until(lambda: gate.window.release_time(g2) is not None, "worker 2 is no longer expected")
    t.join(timeout=STUCK_S)
    assert not t.is_alive()
