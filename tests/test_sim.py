"""The virtual-clock simulator: determinism, and the identities that tie it to the server."""

from __future__ import annotations

import dataclasses
import json

import pytest

from asyncdiloco.bench.sim import METHODS, SimConfig
from asyncdiloco.bench.simulate import simulate
from asyncdiloco.bench.suite import run_suite
from asyncdiloco.bench.suite_config import SuiteConfig
from asyncdiloco.errors import ConfigError
from asyncdiloco.job.config import JobConfig

TINY = JobConfig(n_layer=1, n_embd=32, n_head=2, context_len=16, batch_size=8, eval_batches=2)


def losses(result):
    return [p["eval_loss"] for p in result.curve]


def test_a_run_is_deterministic():
    cfg = SimConfig(
        method="async_dn_dylu",
        speeds_s_per_step=(0.58, 0.75, 1.51),
        total_steps=60,
        local_steps=5,
        job=TINY,
        eval_every_steps=20,
    )
    a, b = simulate(cfg), simulate(cfg)
    assert losses(a) == losses(b)
    assert [p["time_s"] for p in a.curve] == [p["time_s"] for p in b.curve]
    assert a.staleness_histogram == b.staleness_histogram


def test_async_dn_with_grace_on_equal_speeds_is_sync_diloco():
    # Liu et al. 2024: with c = 0 and a grace window, N simultaneous arrivals under Delayed
    # Nesterov are one synchronous Nesterov step on their mean, and every worker restarts
    # from the same model — so the async server code reproduces sync DiLoCo.
    kw = dict(
        speeds_s_per_step=(1.0, 1.0, 1.0),
        total_steps=60,
        local_steps=5,
        job=TINY,
        eval_every_steps=15,
        outer_lr=0.7,
        outer_momentum=0.9,
    )
    sync = simulate(SimConfig(method="sync_diloco", **kw))
    dn = simulate(SimConfig(method="async_dn", **kw))  # the server's auto window
    assert losses(dn) == pytest.approx(losses(sync), abs=1e-4)
    assert dn.group_size_histogram == [0, 0, 4] == sync.group_size_histogram
    no_grace = simulate(SimConfig(method="async_dn", grace_s=0.0, **kw))
    assert losses(no_grace) != pytest.approx(losses(sync), abs=1e-4)
    assert no_grace.group_size_histogram == [12]


def test_every_method_trains_exactly_the_budget():
    # 70 is no multiple of K·H = 3·8: the last round is cut to what remains
    kw = dict(speeds_s_per_step=(0.58, 0.75, 1.51), total_steps=70, local_steps=8, job=TINY, eval_every_steps=35)
    for method in METHODS:
        r = simulate(SimConfig(method=method, **kw))
        assert r.steps == 70, method
        assert r.curve[-1]["steps"] == 70, method


def test_dn_dylu_forms_full_groups_on_uneven_speeds():
    # DyLU knows the rates before the first push, and the window waits for every live
    # worker: every Delayed Nesterov buffer holds one push per worker from one model.
    cfg = SimConfig(
        method="async_dn_dylu",
        speeds_s_per_step=(0.58, 0.75, 1.51, 3.33),
        total_steps=450,
        local_steps=20,
        job=TINY,
        eval_every_steps=450,
    )
    r = simulate(cfg)
    assert r.group_size_histogram == [0, 0, 0, 10]  # 450 = 10 groups of H_w = 20 + 15 + 7 + 3
    assert r.staleness_histogram[:4] == [10, 10, 10, 10] and sum(r.staleness_histogram) == 40
    assert r.utilisation > 0.9


def test_leave_and_rejoin_changes_the_live_workers():
    cfg = SimConfig(
        method="async_dn_dylu",
        speeds_s_per_step=(1.0, 1.0, 1.0),
        total_steps=150,
        local_steps=5,
        job=TINY,
        eval_every_steps=150,
        leave_rejoin=(2, 10.0, 30.0),
    )
    r = simulate(cfg)
    assert r.steps == 150
    assert r.group_size_histogram[1] > 0 and r.group_size_histogram[2] > 0  # groups of 2 while worker 2 is away


def test_uneven_speeds_make_async_faster_and_stale():
    kw = dict(speeds_s_per_step=(1.0, 4.0), total_steps=40, local_steps=5, job=TINY, eval_every_steps=40)
    sync = simulate(SimConfig(method="sync_diloco", **kw))
    asyn = simulate(SimConfig(method="async_nesterov", **kw))
    assert asyn.wall_s < sync.wall_s  # nobody waits for the slow worker
    assert sync.utilisation < 0.7 < asyn.utilisation
    assert sum(asyn.staleness_histogram[1:]) > 0


def test_dylu_gives_the_slow_worker_fewer_local_steps():
    kw = dict(speeds_s_per_step=(1.0, 4.0), total_steps=80, local_steps=8, job=TINY, eval_every_steps=80)
    plain = simulate(SimConfig(method="async_dn", **kw))
    dylu = simulate(SimConfig(method="async_dn_dylu", **kw))
    assert dylu.updates > plain.updates  # the slow worker pushes every 2 steps instead of 8


def test_bad_method_is_refused():
    with pytest.raises(ConfigError, match="method='async_adam'"):
        SimConfig(method="async_adam", speeds_s_per_step=(1.0,), total_steps=10)


@pytest.mark.multiprocess
def test_suite_writes_runs_report_and_plots(tmp_path):
    cfg = SuiteConfig(
        profiles=("uneven",),
        methods=("sync_localsgd", "sync_diloco", "async_nesterov", "async_dn_dylu"),
        seeds=(0, 1),
        total_steps=40,
        local_steps=5,
        eval_every_steps=20,
        job=TINY,
        processes=2,
    )
    records = run_suite(cfg, str(tmp_path), progress=False)
    assert len(records) == 8
    lines = (tmp_path / "runs.jsonl").read_text().splitlines()
    assert len(lines) == 8 and all("target_loss" in json.loads(x) for x in lines)
    report = (tmp_path / "report.md").read_text()
    assert "| async_dn_dylu |" in report and "(a) [uneven]" in report and "(c) [uneven]" in report
    claims = json.loads((tmp_path / "claims.json").read_text())
    assert set(claims["uneven"]) >= {"a", "b", "c", "utilisation"}
    for key in ("a", "b", "c"):
        assert isinstance(claims["uneven"][key]["shown"], bool) and "value" in claims["uneven"][key]
    for name in ("loss_vs_tokens.png", "loss_vs_time.png", "utilisation.png", "staleness.png"):
        assert (tmp_path / name).stat().st_size > 1000


@pytest.mark.multiprocess
@pytest.mark.heavy
@pytest.mark.timeout(300)
def test_real_clock_suite_runs_processes_to_a_token_budget(tmp_path):
    cfg = SuiteConfig(
        profiles=("uneven",),
        methods=("sync_diloco", "async_dn_dylu"),
        seeds=(0,),
        total_steps=80,
        local_steps=5,
        eval_every_steps=40,
        job=TINY,
    )
    records = run_suite(cfg, str(tmp_path), progress=False, clock="real")
    assert [r["method"] for r in records] == ["sync_diloco", "async_dn_dylu"]
    for r in records:
        assert r["clock"] == "real"
        assert r["tokens"] >= 80 * TINY.tokens_per_step  # stopped once the budget was applied
        assert r["final_eval_loss"] < r["curve"][0]["eval_loss"]
        assert r["updates"] > 0 and 0 < r["utilisation"] <= 1
    report = (tmp_path / "report.md").read_text()
    assert "(real clock)" in report and "| async_dn_dylu |" in report


def test_overlap_under_grouping_keeps_groups_whole_and_workers_busy():
    # Workers train on while their group forms and run H_w more steps after the merge, so
    # their pushes stay in groups, and the group's early arrivals are no longer idle.
    kw = dict(
        speeds_s_per_step=(0.58, 0.75, 1.51, 3.33), total_steps=450, local_steps=20, job=TINY, eval_every_steps=450
    )
    plain = simulate(SimConfig(method="async_dn_dylu", **kw))
    eager = simulate(SimConfig(method="async_dn_dylu_overlap", **kw))
    assert eager.steps == plain.steps == 450
    assert (
        eager.group_size_histogram[-1] >= sum(eager.group_size_histogram) - 2
    )  # whole groups (the budget's end aside)
    assert eager.utilisation > plain.utilisation and eager.utilisation > 0.97


def test_overlap_with_a_worker_that_leaves_keeps_time_moving_forward():
    cfg = SimConfig(
        method="async_dn_dylu_overlap",
        speeds_s_per_step=(1.0, 1.0, 1.0),
        total_steps=150,
        local_steps=5,
        job=TINY,
        eval_every_steps=15,
        leave_rejoin=(2, 10.0, 30.0),
    )
    r = simulate(cfg)
    times = [p["time_s"] for p in r.curve]
    assert r.steps == 150 and times == sorted(times)
    assert all(b <= r.wall_s + 1e-9 for b in r.busy_s)
    assert r.busy_s[2] <= r.wall_s - 20.0 + 5.0  # away for 20 s: not busy then (one round of slack)


# ------------------------------------------------------------------ what the clock charges
def test_a_push_costs_latency_plus_bytes_over_bandwidth():
    from asyncdiloco.bench.sim_costs import Link, wire_bytes

    assert Link(latency_s=0.05, bandwidth_Bps=1e6).transfer_s(2e6) == pytest.approx(2.05)
    assert wire_bytes("raw", 500) == 2000 and wire_bytes("bf16", 500) == 1000 and wire_bytes("int8", 500) == 504
    # One worker, 2 rounds of 5 steps of 1 s; each push and pull moves 500 fp32 parameters
    # (2,000 bytes) over a link of 1 s latency and 1,000 B/s: 3 s each way.
    kw = dict(speeds_s_per_step=(1.0,), total_steps=10, local_steps=5, job=TINY, eval_every_steps=10, wire_params=500)
    free = simulate(SimConfig(method="async_dn_dylu", **kw))
    paid = simulate(SimConfig(method="async_dn_dylu", links=(Link(latency_s=1.0, bandwidth_Bps=1000.0),), **kw))
    assert free.wall_s == pytest.approx(10.0) and free.comm_s == 0.0
    assert paid.wall_s == pytest.approx(3 + 5 + 3 + 3 + 5 + 3)  # pull, round, push, pull, round, push
    assert paid.bytes_up == 2 * 2000 and paid.comm_s == pytest.approx(5 * 3.0)  # 2 pushes, 3 pulls
    assert losses(paid) == losses(free)  # the clock changes, the training does not
    bf16 = simulate(SimConfig(method="async_dn_dylu", links=paid.config.links, wire_codec="bf16", **kw))
    assert bf16.wall_s == pytest.approx(2 + 5 + 2 + 2 + 5 + 2) and bf16.bytes_up == 2 * 1000
    assert losses(bf16) != losses(free) and losses(bf16) == pytest.approx(losses(free), abs=1e-3)  # values via bf16


def test_a_sync_round_pays_a_quorum_round_trip_and_a_ring_allreduce():
    from asyncdiloco.bench.sim_costs import Link, ring_allreduce_s, sync_round_comm_s

    links = [Link(0.01, 100.0), Link(0.02, 50.0), Link(0.0, 1000.0)]
    # 2(N − 1) steps of B/N bytes, each paced by the slowest link: 4 · (0.02 + 100 / 50)
    assert ring_allreduce_s(links, 300.0) == pytest.approx(8.08)
    assert sync_round_comm_s(links, 300.0) == pytest.approx(2 * 0.02 + 8.08)
    assert ring_allreduce_s(links[:1], 300.0) == 0.0
    kw = dict(speeds_s_per_step=(1.0, 1.0), total_steps=20, local_steps=5, job=TINY, eval_every_steps=20)
    two = (Link(0.1, 1000.0), Link(0.2, 500.0))
    r = simulate(SimConfig(method="sync_diloco", links=two, wire_params=500, **kw))
    comm = 2 * 0.2 + 2 * (0.2 + 1000 / 500)  # 2,000 bytes: quorum, then 2 ring steps of 1,000 bytes
    assert r.wall_s == pytest.approx(2 * (5 + comm)) and r.comm_s == pytest.approx(2 * 2 * comm)
    assert r.bytes_up == r.bytes_down == 2 * 2 * 2000  # 2 rounds x 2 members x 2(N − 1)/N · B
    assert r.outer_steps == 2 and r.true_staleness_histogram == [4]


def test_step_noise_is_deterministic_per_seed_and_worker():
    from asyncdiloco.bench.sim_costs import Noise, StepTimer

    noise = Noise(sigma=0.5, stall_prob=0.05, stall_s=10.0, drift_sigma=0.1)

    def draws(seed, worker, n=2000):
        return StepTimer(noise, seed, worker, lambda t: 2.0).steps_s(0.0, n)

    a = draws(0, 1)
    assert a == draws(0, 1) and a != draws(1, 1) and a != draws(0, 2)
    assert max(a) > 10.0  # stalls and a heavy tail
    mean = sum(a) / len(a)  # 2 s × jitter and drift of mean about 1, plus 0.05 × 10 s of stalls
    assert 2.0 < mean < 3.5
    quiet = StepTimer(Noise(), 0, 0, lambda t: 2.0 if t < 5 else 3.0).steps_s(0.0, 4)
    assert quiet == [2.0, 2.0, 2.0, 3.0]  # speed changes apply from the step that starts after them


def test_sync_adaptive_gives_each_member_steps_in_proportion_to_its_measured_rate():
    kw = dict(speeds_s_per_step=(1.0, 2.0, 4.0), total_steps=84, local_steps=8, job=TINY, eval_every_steps=84)
    r = simulate(SimConfig(method="sync_diloco_adaptive", **kw))
    first, *rest = r.local_steps_log
    assert first == [8, 4, 4]  # the slowest times its first 4 steps (first untimed) before it knows its H_w
    assert all(h == [8, 4, 2] for h in rest[:-1]) and sum(map(sum, r.local_steps_log)) == 84
    assert r.estimated_rates == pytest.approx([1.0, 0.5, 0.25])
    assert r.wall_s == pytest.approx(
        16.0 + 8.0 * (len(rest) - 1) + max(1.0 * rest[-1][0], 2.0 * rest[-1][1], 4.0 * rest[-1][2])
    )
    plain = simulate(SimConfig(method="sync_diloco", **kw))
    assert all(h == [8, 8, 8] for h in plain.local_steps_log[:-1]) and plain.wall_s > r.wall_s


def test_rates_come_from_the_workers_timings_not_from_the_simulator(monkeypatch):
    from asyncdiloco.bench.sim_costs import Noise
    from asyncdiloco.ps.state import ParameterServerState

    told = []
    join = ParameterServerState.join_worker

    def spy(self, manifest, worker_name="", steps_per_s=0.0, *args, **kwargs):
        told.append(steps_per_s)
        return join(self, manifest, worker_name, steps_per_s, *args, **kwargs)

    monkeypatch.setattr(ParameterServerState, "join_worker", spy)
    speeds = (0.5, 1.0, 2.0)
    kw = dict(speeds_s_per_step=speeds, total_steps=120, local_steps=8, job=TINY, eval_every_steps=120)
    exact = simulate(SimConfig(method="async_dn_dylu", **kw))
    assert told == [0.0, 0.0, 0.0]  # no rate at join
    assert exact.estimated_rates == pytest.approx([1 / s for s in speeds])  # noise-free timings are exact
    noisy = simulate(SimConfig(method="async_dn_dylu", noise=Noise(sigma=0.3), **kw))
    assert noisy.estimated_rates != pytest.approx([1 / s for s in speeds], rel=1e-3)
    assert noisy.estimated_rates == pytest.approx([1 / s for s in speeds], rel=0.5)


def test_non_iid_workers_draw_from_disjoint_slices_of_the_training_text():
    from asyncdiloco.job.dataset import BatchStream, CharCorpus

    corpus = CharCorpus.default()
    streams = [BatchStream(corpus, 4, 16, 0, i, shard=i, num_shards=4) for i in range(4)]
    spans = [(s.data.storage_offset(), s.data.storage_offset() + s.data.numel()) for s in streams]
    assert spans[0][0] == 0 and spans[-1][1] == corpus.train.numel()
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # contiguous, disjoint, covering the split
    x, y = next(streams[2])
    text = corpus.decode(streams[2].data)
    assert all(corpus.decode(row) in text for row in x)
    with pytest.raises(ConfigError, match="shard=4 of num_shards=4"):
        BatchStream(corpus, 4, 16, 0, 0, shard=4, num_shards=4)


def test_true_staleness_counts_outer_steps_between_pull_and_apply():
    kw = dict(speeds_s_per_step=(1.0, 1.0, 1.0), total_steps=60, local_steps=5, job=TINY, eval_every_steps=60)
    grouped = simulate(SimConfig(method="async_dn", **kw))  # whole groups: one synchronous step each
    assert grouped.staleness_histogram[:4] == [4, 4, 4, 0]  # versions: the arrival's place in its group
    assert grouped.true_staleness_histogram == [12] and grouped.outer_steps == 4
    kw["speeds_s_per_step"] = (1.0, 4.0)
    naive = simulate(SimConfig(method="async_nesterov", **kw))  # every push is an outer step
    assert naive.true_staleness_histogram == naive.staleness_histogram[: len(naive.true_staleness_histogram)]
    assert naive.mean_true_staleness > 0
    assert naive.outer_steps == naive.updates


def test_look_ahead_point_is_theta_minus_lambda_eta_mu_m():
    import torch

    from asyncdiloco.algo.config import ASYNC_OUTER
    from asyncdiloco.algo.outer import look_ahead_point, make_outer_optimizer

    theta = torch.tensor([1.0, 2.0])
    outer = make_outer_optimizer(theta, dataclasses.replace(ASYNC_OUTER, dn_buffer=1))
    outer.step(torch.tensor([0.5, -1.0]), version=0)  # m = Δ
    assert outer.momentum_steps == 1
    out = look_ahead_point(outer, 1, torch.empty(2), lam=2.0)
    assert torch.allclose(out, theta - 2.0 * 0.7 * 0.6 * torch.tensor([0.5, -1.0]))
    assert torch.equal(look_ahead_point(outer, 1, torch.empty(2), lam=0.0), theta)


def test_the_simulated_worker_reports_its_rate_as_the_real_worker_does():
    """The simulator's rate path is the real worker's: the same estimator and probe cadence,
    and a stall inside the window does not move the rate (the longest step is left out)."""
    from asyncdiloco.bench.sim_costs import RATE_PROBE_STEPS, WorkerRate
    from asyncdiloco.worker.base import WorkerBase

    assert RATE_PROBE_STEPS == WorkerBase.RATE_PROBE_STEPS
    rate = WorkerRate()
    reports = [rate.step(d) for d in (5.0, 0.5, 0.5, 9.0, 0.5, 0.5, 0.5)]  # warm-up, then a stall
    assert reports[:3] == [None, None, None]  # the first step is not timed; 3 timed steps per report
    assert reports[3] == pytest.approx(2.0)  # 0.5, 0.5, 9.0: the longest left out
    assert reports[6] == pytest.approx(2.0)
    rate.reporting = False
    assert rate.step(0.5) is None
    assert rate.compute_s(10, measured_s=99.0) == pytest.approx(5.0)  # steps / v_w, not the measured sum
