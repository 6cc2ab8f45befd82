"""DyLU (Liu et al. 2024, Eq. 6) and the grace window (Alg. 2), alone and in the server."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from asyncdiloco._proto import parameter_server_pb2 as pb
from asyncdiloco.config import OuterConfig, ServerConfig
from asyncdiloco.ps.state import ParameterServerState
from asyncdiloco.schedule import GraceWindow, StepRateMeter, dylu_local_steps
from asyncdiloco.tensors import Manifest


def test_dylu_follows_eq6():
    # H_w = floor(v_w / max v · H), at least 1
    rates = {1: 1 / 0.58, 2: 1 / 0.75, 3: 1 / 1.51, 4: 1 / 3.33}  # the authors' speeds, s/step
    h = dylu_local_steps(rates, 50)
    assert h == {1: 50, 2: 38, 3: 19, 4: 8}
    assert dylu_local_steps({1: 100.0, 2: 0.1}, 10) == {1: 10, 2: 1}
    assert dylu_local_steps({}, 10) == {}


def test_step_rate_meter_uses_intervals_between_pushes():
    meter = StepRateMeter(alpha=0.5)
    meter.start(7, now=0.0)
    meter.record(7, 10, now=2.0)  # 5 steps/s
    assert meter.rates[7] == 5.0
    meter.record(7, 10, now=3.0)  # sample 10 → EMA 7.5
    assert meter.rates[7] == 7.5


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _push(state, manifest, wid, push_id, steps):
    payload = manifest.pack([torch.full((4,), 0.01)])
    return state.push(payload, worker_id=wid, push_id=push_id, base_version=state.version, num_local_steps=steps)


def test_server_tells_each_worker_its_dylu_local_steps():
    clock = FakeClock()
    state = ParameterServerState(ServerConfig(port=0, local_steps=20, dylu=True), clock=clock)
    manifest = Manifest.from_named_tensors([("w", torch.zeros(4))])
    fast, _, _ = state.join(manifest, "fast")
    slow, _, _ = state.join(manifest, "slow")
    state.push(manifest.pack([torch.zeros(4)]), worker_id=fast, push_id=1, kind=pb.PUSH_KIND_INITIAL_PARAMETERS)
    assert state.run_config(slow).local_steps == 20  # no rate measured yet
    for k in range(4):  # fast: 20 steps per second; slow: 20 steps per 4 seconds
        clock.t = k + 1.0
        out_fast = _push(state, manifest, fast, 2 + k, 20)
    clock.t = 4.0
    out_slow = _push(state, manifest, slow, 2, 20)
    assert out_fast.local_steps == 20
    assert out_slow.local_steps == 5  # floor(5 / 20 · 20)
    assert state.run_config(slow).local_steps == 5
    by_id = {w.worker_id: w for w in state.status().workers}
    assert by_id[slow].local_steps_per_round == 5 and by_id[slow].steps_per_s == pytest.approx(5.0)


def test_grace_window_holds_a_reply_until_the_window_closes():
    window = GraceWindow(grace_s=1.0, clock=time.monotonic)
    events = []
    window.arrive()  # push A applied

    def reply_a():
        window.wait()
        events.append("A replied")

    t = threading.Thread(target=reply_a)
    t.start()
    window.arrive()  # push B lands inside A's window
    events.append("B arrived")
    t.join(timeout=10)
    assert events == ["B arrived", "A replied"]
    assert GraceWindow(grace_s=0.0, clock=time.monotonic).wait() == 0.0


def test_grace_config_is_validated():
    from asyncdiloco.errors import ConfigError

    with pytest.raises(ConfigError, match="grace_s=-1"):
        ServerConfig(grace_s=-1)
    OuterConfig()  # defaults stay valid
