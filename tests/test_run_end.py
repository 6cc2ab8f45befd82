"""A run's end: the workers' closing pushes (``PushHeader.last``) take the outer step's
direct term alone, divided by the N the workers trained under (algo/outer.py
``step_closing``), so they do not set the global model back."""

from __future__ import annotations

import dataclasses
import pathlib
import time

import pytest
import torch

from asyncdiloco.algo.config import OuterConfig
from asyncdiloco.algo.outer import DelayedNesterov, OuterOptimizer
from asyncdiloco.bench.sim_async import RunEndConfig, simulate_run_end
from asyncdiloco.errors import InvalidPayloadError
from asyncdiloco.job.config import JobConfig
from asyncdiloco.ps.config import DurabilityConfig, ServerConfig
from asyncdiloco.ps.durable.store import DurableStore
from asyncdiloco.ps.push.shard_order import ShardOrder
from asyncdiloco.ps.state import ParameterServerState
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.tensors import Manifest

DN = OuterConfig(optimizer="delayed_nesterov", lr=0.5, momentum=0.8, dn_buffer=0)


def test_a_closing_push_moves_theta_by_its_direct_term_and_keeps_the_momentum():
    theta = torch.zeros(4)
    dn = DelayedNesterov(theta, DN)
    for _ in range(4):  # one complete buffer of 4: m moves, last_n = 4
        dn.step(torch.ones(4), version=0, num_workers=4)
    m, b, before = dn.momentum_buffer.clone(), dn.delta_buffer.clone(), theta.clone()
    assert dn.last_n == 4 and dn.arrivals == 0
    # two of the four have left: N stays 4 for the closing push, not 2
    assert dn.closing_workers(2) == 4 and dn.closing_workers(6) == 6
    dn.step_closing(torch.full((4,), 2.0), 0.5, version=3, num_workers=dn.closing_workers(2))
    torch.testing.assert_close(theta, before - 0.5 * 0.5 * 2.0 / 4)  # η·s·Δ/N
    assert torch.equal(dn.momentum_buffer, m) and torch.equal(dn.delta_buffer, b) and dn.arrivals == 0


def test_a_plain_optimizers_closing_push_is_its_direct_term():
    theta = torch.zeros(3)
    opt = OuterOptimizer(theta, OuterConfig(optimizer="nesterov", lr=0.7, momentum=0.9))
    opt.step(torch.ones(3), version=0)
    m, before = opt.momentum_buffer.clone(), theta.clone()
    opt.step_closing(torch.ones(3), version=1, num_workers=5)  # not divided by N
    torch.testing.assert_close(theta, before - 0.7)
    assert torch.equal(opt.momentum_buffer, m)


def test_shard_zero_tells_the_other_shards_a_push_is_closing():
    order = ShardOrder(7, 1, 1.0, 4, closing=True)
    assert ShardOrder.decode(order.encode()) == order
    assert ShardOrder.decode(ShardOrder(7, 1, 1.0, 4).encode()).closing is False  # the 4-field form still reads
    with pytest.raises(InvalidPayloadError):
        ShardOrder.decode("7,1,0x1.0p+0,4,open")


MANIFEST = Manifest.from_named_tensors([("w", torch.zeros(4))])


def _state(folder: pathlib.Path) -> tuple[ParameterServerState, DurableStore]:
    config = ServerConfig(
        port=0,
        lease_s=86400,
        outer=DN,
        grouping="off",
        dylu=False,
        durability=DurabilityConfig(checkpoint_dir=str(folder), checkpoint_every=1000),
    )
    state = ParameterServerState(config, clock=lambda: 0.0)
    store = DurableStore(config.durability, config)
    store.open(state.durability)
    return state, store


def test_the_runs_end_through_the_server_keeps_n_and_replays_the_same(tmp_path):
    state, store = _state(tmp_path)
    ids = [state.join(MANIFEST, f"w{i}")[0] for i in range(3)]
    state.intake.push(
        MANIFEST.pack([torch.zeros(4)]), worker_id=ids[0], push_id=1, kind=pb.PUSH_KIND_INITIAL_PARAMETERS
    )
    for i in ids:  # one whole group of 3: a momentum update with N = 3
        state.intake.push(MANIFEST.pack([torch.ones(4)]), worker_id=i, push_id=2, num_local_steps=4, num_tokens=40)
    m = state.model.outer.momentum_buffer.clone()
    theta = state.params.clone()
    outcomes = []
    for k, i in enumerate(ids):  # the run's end: each pushes a partial round, then leaves
        delta = torch.full((4,), 0.25 * (k + 1))
        out = state.intake.push(
            MANIFEST.pack([delta]),
            worker_id=i,
            push_id=3,
            base_version=state.version,
            num_local_steps=1,
            num_tokens=10,
            last=True,
        )
        state.leave(i)
        outcomes.append(out)
        theta -= DN.lr * delta / 3  # N = 3 for each, not 3, 2, 1
    assert [(o.closing, o.num_workers) for o in outcomes] == [(True, 3)] * 3
    torch.testing.assert_close(state.params, theta)
    assert torch.equal(state.model.outer.momentum_buffer, m)
    st = state.status()
    assert (st.version, st.applied_pushes, st.tokens) == (6, 6, 3 * 40 + 3 * 10)  # every push counted
    store.close(final_checkpoint=False)  # killed: the closing pushes are in the log only
    again, store2 = _state(tmp_path)
    try:
        assert again.version == 6
        torch.testing.assert_close(again.params, theta)  # replayed as closing pushes
        assert again.model.outer.last_n == 3
    finally:
        store2.close()


def test_the_closing_pushes_of_a_runs_end_do_not_set_the_model_back():
    """The demo's end on the virtual clock (4 workers at 1, 1.5, 2, 3 s/step, stopped mid-round):
    the global model after the closing pushes is no worse than just before them; sent as
    ordinary pushes (N shrinking 4, 3, 2, 1, buffers of partial rounds completed), the same
    pushes make it worse."""
    job = JobConfig(n_layer=1, n_embd=32, n_head=2, context_len=16, batch_size=8)
    cfg = RunEndConfig(stop_s=95.0, local_steps=10, job=job)
    ruled = simulate_run_end(cfg)
    assert [n for *_, n in ruled.closing] == [4, 4, 4, 4]
    assert any(steps < h_w for _, steps, h_w, _ in ruled.closing), "the stop falls mid-round"
    assert ruled.final_version == ruled.before_version + len(ruled.closing)
    assert ruled.final_loss <= ruled.before_loss
    plain = simulate_run_end(RunEndConfig(stop_s=95.0, local_steps=10, job=job, mark_closing=False))
    assert [n for *_, n in plain.closing] == [4, 3, 2, 1]
    assert plain.tokens == ruled.tokens  # the same pushes, the same accounting
    assert plain.final_loss > ruled.final_loss


# ------------------------------------------------------------ the demo's stop
class _Popen:
    def __init__(self) -> None:
        self.terminated = False

    def poll(self):
        return 0 if self.terminated else None

    def terminate(self) -> None:
        self.terminated = True


class _Worker:
    def __init__(self) -> None:
        self.popen = _Popen()


class _Evaluator:
    """The demo's evaluator, without a server: a status with ``tokens``, one evaluation."""

    def __init__(self, tokens: int) -> None:
        self.tokens, self.evaluations = tokens, 0
        self.client = self

    def status(self) -> pb.StatusReply:
        return pb.StatusReply(initialized=True, version=12, tokens=self.tokens)

    def evaluate_global(self):
        self.evaluations += 1
        return EvalResult(version=12, loss=2.5)


@dataclasses.dataclass
class EvalResult:
    version: int
    loss: float


@pytest.mark.parametrize(("tokens", "started_s_ago", "why"), [(1000, 1.0, "tokens"), (10, 100.0, "time")])
def test_the_demo_evaluates_then_stops_every_worker_at_its_budget_or_cap(tmp_path, tokens, started_s_ago, why):
    from asyncdiloco.bench.demo import DemoConfig, _Watch
    from asyncdiloco.bench.demo_report import _stop_fields, _stop_text

    cfg = DemoConfig(num_workers=2, out_dir=str(tmp_path), token_budget=1000, max_seconds=60.0)
    ev, workers = _Evaluator(tokens), [_Worker(), _Worker()]
    watch = _Watch(cfg, ev, workers, time.monotonic(), initial_loss=4.2)
    watch.training_since = time.monotonic() - started_s_ago  # an injected start: no waiting
    assert watch.poll() is None  # the run ends here
    assert ev.evaluations == 1 and all(w.popen.terminated for w in workers)
    info = watch.stop_info()
    assert (info["reason"], info["eval_loss"], info["version"], info["tokens"]) == (why, 2.5, 12, tokens)
    report = {**_stop_fields(info), "final_eval_loss": 2.4, "version": 16}
    assert report["stop"] == why and report["max_tokens"] == 1000 and report["max_seconds"] == 60.0
    text = _stop_text(report)
    assert f"stopped on {why}" in text
    assert "at the stop 2.500 (version 12), after the closing pushes 2.400 (version 16)" in text


def test_the_demo_trains_on_below_its_budget_and_cap(tmp_path):
    from asyncdiloco.bench.demo import DemoConfig, _Watch

    cfg = DemoConfig(num_workers=1, out_dir=str(tmp_path), token_budget=1000, max_seconds=60.0, eval_every_s=1e9)
    ev, workers = _Evaluator(999), [_Worker()]
    watch = _Watch(cfg, ev, workers, time.monotonic(), initial_loss=4.2)
    watch.training_since = time.monotonic()
    assert watch.poll() is not None and not workers[0].popen.terminated and ev.evaluations == 0
    assert watch.stop_info()["reason"] == "workers"  # were they all to exit now
