"""DyLU's rates measure the time in inner steps only (algo/rates.py, worker/base.py).

The estimator and the workers run on fake clocks here (the server's clock is only used
for leases): a worker's step takes exactly what its model's forward pass adds to its
clock, and held replies, data loading and the caller's own work between steps move the
same clock without being inner-step compute. Nothing depends on how fast this machine is.
"""

from __future__ import annotations

import pytest
import torch
from helpers import FakeClock
from torch import nn

from asyncdiloco.algo.config import OuterConfig
from asyncdiloco.algo.rates import RATE_WINDOW, InnerStepRate
from asyncdiloco.algo.schedule import dylu_local_steps
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.tensors import Manifest
from asyncdiloco.worker.async_worker import AsyncDiLoCoWorker
from asyncdiloco.worker.client import ParameterServerClient
from asyncdiloco.worker.config import WorkerConfig

pytestmark = pytest.mark.timeout(120)

H = 20


# ------------------------------------------------------------------ the estimator
def _steps(rate: InnerStepRate, clock: FakeClock, durations, between_s: float = 0.0) -> None:
    for d in durations:
        clock.advance(between_s)  # data loading, the caller's work: not compute
        rate.begin()
        clock.advance(d)
        rate.end()
        clock.advance(1.0)  # a sync inside the step hook: not compute
        rate.resume()


def test_a_step_is_timed_from_its_first_forward_to_its_optimizer_step():
    clock = FakeClock()
    rate = InnerStepRate(clock)
    _steps(rate, clock, [5.0, 0.1, 0.1, 0.1], between_s=0.7)
    assert rate.steps == 4 and rate.timed_steps == 3  # the first (warm-up) step is not timed
    assert rate.steps_per_s == pytest.approx(10.0)
    assert rate.compute_s == pytest.approx(0.3)
    rate.begin()
    clock.advance(0.05)
    rate.begin()  # gradient accumulation: the second forward is part of the same step
    clock.advance(0.05)
    assert rate.end() == pytest.approx(0.1)


def test_a_step_without_a_forward_is_timed_from_the_end_of_the_previous_ones_sync():
    clock = FakeClock()
    rate = InnerStepRate(clock, skip=0)
    rate.resume()
    clock.advance(0.2)
    assert rate.end() == pytest.approx(0.2)
    assert rate.end() is None  # no start known: not timed
    assert rate.steps_per_s == pytest.approx(5.0)


def test_warm_up_and_stalls_do_not_move_the_median():
    clock = FakeClock()
    rate = InnerStepRate(clock)
    _steps(rate, clock, [20.0, 3.0, 0.1, 0.1])  # one warm-up step skipped, one slow among three timed
    assert rate.steps_per_s == pytest.approx(10.0)
    _steps(rate, clock, [0.1] * 20 + [30.0])  # one stall in the window: left out
    assert rate.steps_per_s == pytest.approx(10.0)
    _steps(rate, clock, [0.1] * 20 + [0.3, 0.3])  # two slow steps: the mean counts one
    assert rate.steps_per_s == pytest.approx(15 / (14 * 0.1 + 0.3))


def test_a_speed_change_is_followed_within_the_window():
    clock = FakeClock()
    rate = InnerStepRate(clock)
    _steps(rate, clock, [0.1] * 40)
    _steps(rate, clock, [0.4] * (RATE_WINDOW - 1))
    assert 2.5 < rate.steps_per_s < 3.0  # on its way: one fast step left in the window
    _steps(rate, clock, [0.4])
    assert rate.steps_per_s == pytest.approx(2.5)
    assert rate.seconds_for(5) == pytest.approx(2.0)


def test_simulated_step_times_are_estimated_as_timed_ones():
    rate = InnerStepRate(clock=lambda: 0.0)
    assert rate.step_took(9.0) is None  # the first step: warm-up, not timed
    for d in (0.2, 0.2, 0.2, None):  # None: a step whose time is unknown
        rate.step_took(d)
    assert rate.steps == 5 and rate.timed_steps == 3
    assert rate.steps_per_s == pytest.approx(5.0) and rate.seconds_for(10) == pytest.approx(2.0)


def test_the_estimator_refuses_a_bad_window():
    with pytest.raises(ValueError, match="window"):
        InnerStepRate(window=0)


# ------------------------------------------------------- workers against a server
class ClockedModel(nn.Module):
    """A linear model whose forward pass adds ``cost_s`` to its worker's fake clock."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 1)
        self.clock = clock
        self.cost_s = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock.advance(self.cost_s)
        return self.lin(x)


class Machine:
    """One worker on its own fake clock: ``step_s`` per inner step (``warm_up`` times that
    for its first two steps), ``between_s`` of data loading before each, ``after_sync_s``
    of the caller's evaluation (under ``no_grad``) after each sync, and ``held_s`` added to
    every push (a reply the server held)."""

    def __init__(self, address: str, name: str, step_s: float, *, after_sync_s=0.0, held_s=0.0, warm_up=5.0):
        self.clock = FakeClock()
        self.model = ClockedModel(self.clock)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.worker = AsyncDiLoCoWorker(self.model, self.opt, WorkerConfig(server=address, worker_name=name))
        self.worker.step_rate = InnerStepRate(self.clock)
        self.step_s, self.after_sync_s, self.warm_up = step_s, after_sync_s, warm_up
        #: (steps of the push, steps at the current speed before it ended, H_w of its reply)
        self.pushes: list[tuple[int, int, int]] = []
        self.steps = self.steps_at_speed = 0
        push = self.worker.client.push

        def held_push(*args, **kwargs):
            reply = push(*args, **kwargs)
            self.clock.advance(held_s)
            self.pushes.append((kwargs["num_local_steps"], self.steps_at_speed, reply.local_steps))
            return reply

        self.worker.client.push = held_push  # type: ignore[method-assign]

    def step(self) -> None:
        pushed = len(self.pushes)
        self.clock.advance(0.01)  # data loading
        self.model.cost_s = self.step_s * (self.warm_up if self.steps < 2 else 1.0)
        x = torch.randn(8, 4)
        nn.functional.mse_loss(self.model(x), x.sum(dim=1, keepdim=True)).backward()
        self.steps += 1
        self.steps_at_speed += 1
        self.opt.step()  # every H_w-th step syncs
        self.opt.zero_grad()
        if len(self.pushes) > pushed and self.after_sync_s:
            self.model.cost_s = self.after_sync_s  # an evaluation: no gradients, not compute
            with torch.no_grad():
                self.model(x)

    def set_speed(self, step_s: float) -> None:
        self.step_s, self.steps_at_speed = step_s, 0


def _fleet(start_server, machines_kw):
    srv = start_server(
        local_steps=H, dylu=True, grouping="off", outer=OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0)
    )
    init = ParameterServerClient(srv.address)
    model = ClockedModel(FakeClock())
    manifest = Manifest.from_module(model)
    joined = init.join(manifest, "init")
    init.push(
        manifest.pack(list(model.parameters())),
        worker_id=joined.worker_id,
        push_id=1,
        base_version=0,
        kind=pb.PUSH_KIND_INITIAL_PARAMETERS,
    )
    init.leave(joined.worker_id)
    init.close()
    machines = [Machine(srv.address, name, **kw) for name, kw in machines_kw]
    for m in machines:
        m.worker.join()
    return srv, machines


def _run_until(machines, done) -> None:
    """Step the machine whose clock is furthest behind, as concurrent machines would."""
    while not done():
        min(machines, key=lambda m: m.clock.now).step()


def _close(machines) -> None:
    for m in machines:
        m.worker.close()


def test_the_issues_fleet_gets_h_w_in_proportion_to_compute_from_its_first_push(start_server):
    # Steps of 0.05 / 0.1 / 0.2 s; the slowest evaluates for 0.75 s after each sync; the
    # fastest's replies are held 0.3 s; everyone loads data between steps and warms up
    # for two slow steps. On main the rates came out 17.6 / 5.7 / 4.7 (true 20 / 10 / 5).
    srv, machines = _fleet(
        start_server,
        [
            ("fast", {"step_s": 0.05, "held_s": 0.3}),
            ("medium", {"step_s": 0.1}),
            ("slow", {"step_s": 0.2, "after_sync_s": 0.75}),
        ],
    )
    try:
        _run_until(machines, lambda: min(len(m.pushes) for m in machines) >= 6)
        status = {w.worker_name: w for w in srv.state.status().workers}
        rates = [status[n].steps_per_s for n in ("fast", "medium", "slow")]
        for got, want in zip(rates, (1.0, 0.5, 0.25), strict=True):
            assert got / rates[0] == pytest.approx(want, rel=0.10)
        assert [status[n].local_steps_per_round for n in ("fast", "medium", "slow")] == [20, 10, 5]
        for m, h_w in zip(machines, (20, 10, 5), strict=True):
            assert [steps for steps, _, _ in m.pushes] == [h_w] * len(m.pushes)  # the first push too
    finally:
        _close(machines)


def test_status_shows_the_rate_dylu_uses(start_server):
    srv, machines = _fleet(start_server, [("a", {"step_s": 0.05}), ("b", {"step_s": 0.15})])
    try:
        _run_until(machines, lambda: min(len(m.pushes) for m in machines) >= 2)
        rows = srv.state.status().workers
        shown = {w.worker_id: w.steps_per_s for w in rows if w.alive}
        with srv.state.locks.books:
            used = srv.state.registry.live_rates()
        assert shown == used
        told = dylu_local_steps(shown, H)
        assert {w.worker_id: w.local_steps_per_round for w in rows if w.alive} == told
        assert [m.worker.local_steps for m in machines] == [told[m.worker.worker_id] for m in machines]
    finally:
        _close(machines)


def test_a_fleet_follows_a_speed_change_within_the_window(start_server):
    srv, machines = _fleet(start_server, [("fast", {"step_s": 0.05}), ("changes", {"step_s": 0.1})])
    fast, changes = machines
    try:
        _run_until(machines, lambda: len(changes.pushes) >= 3)
        assert changes.worker.local_steps == 10
        changes.set_speed(0.4)  # four times slower from here: H_w 10 -> 2
        _run_until(machines, lambda: len(changes.pushes) > 3 and changes.pushes[-1][1] >= RATE_WINDOW)
        told = [h_w for _, _, h_w in changes.pushes[3:]]  # H_w in the replies since the change
        assert told[0] < 10  # lowered from the first push after the change
        assert told[-1] == 2  # followed fully with the first push after RATE_WINDOW steps at the new speed
        assert told == sorted(told, reverse=True)
        status = {w.worker_name: w for w in srv.state.status().workers}
        assert status["changes"].steps_per_s / status["fast"].steps_per_s == pytest.approx(0.125, rel=0.10)
    finally:
        _close(machines)
