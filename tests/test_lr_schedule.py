"""lr_factor against hand-computed values, LRSchedule's validation, and the inner schedule
in the CLI worker's loop and the simulator's replicas (in-process), and the CLI flags."""

import math
import signal

import pytest
import torch

from asyncdiloco.algo.config import ASYNC_OUTER, SYNC_OUTER
from asyncdiloco.algo.lr_schedule import LRSchedule, lr_factor
from asyncdiloco.cli import app as cli
from asyncdiloco.cli import server as cli_server
from asyncdiloco.cli.train import run_worker
from asyncdiloco.errors import ConfigError
from asyncdiloco.flags.settings import SERVER
from asyncdiloco.job.config import JobConfig
from asyncdiloco.worker.config import WorkerConfig

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


# ------------------------------------------------------------------ inner: the worker's loop

TINY = dict(n_layer=1, n_embd=32, n_head=2, context_len=16, batch_size=8, eval_batches=1)


def record_inner_lrs(monkeypatch) -> list[float]:
    """The lr each inner ``step()`` runs at, for every inner optimizer JobConfig builds."""
    used: list[float] = []
    build = JobConfig.build_inner

    def recording(self, params):
        inner, scheduler = build(self, params)
        inner.register_step_pre_hook(lambda opt, *_: used.append(opt.param_groups[0]["lr"]))
        return inner, scheduler

    monkeypatch.setattr(JobConfig, "build_inner", recording)
    return used


@pytest.mark.timeout(60)
def test_cli_worker_loop_runs_inner_step_k_at_peak_times_lr_factor_k(start_server, monkeypatch):
    job = JobConfig(
        **TINY,
        inner_lr=2e-3,
        inner_lr_schedule="cosine",
        inner_warmup_steps=3,
        inner_total_steps=9,
        inner_min_ratio=0.2,
    )
    used = record_inner_lrs(monkeypatch)
    srv = start_server(local_steps=4)  # syncs at steps 4, 8, 12 do not touch the inner lr
    stats = run_worker(worker_config=WorkerConfig(server=srv.address), job=job, max_steps=12)
    assert stats.inner_steps == 12 and stats.pushes_applied >= 2
    assert used == [2e-3 * lr_factor(job.inner_schedule(), k) for k in range(12)]
    assert used[0] == pytest.approx(2e-3 / 3) and used[3] == 2e-3 and used[9:] == [pytest.approx(4e-4)] * 3


def test_default_inner_schedule_keeps_inner_lr_exactly():
    job = JobConfig(**TINY)
    inner, scheduler = job.build_inner([torch.nn.Parameter(torch.zeros(2))])
    for _ in range(3):
        inner.step()
        scheduler.step()
        assert inner.param_groups[0]["lr"] == job.inner_lr


def test_simulator_replicas_follow_the_same_inner_schedule(monkeypatch):
    from asyncdiloco.bench.sim import Replica, SimConfig
    from asyncdiloco.job.dataset import CharCorpus

    job = JobConfig(**TINY, inner_lr=1e-3, inner_lr_schedule="cosine", inner_warmup_steps=2, inner_total_steps=6)
    used = record_inner_lrs(monkeypatch)
    cfg = SimConfig(method="async_nesterov", speeds_s_per_step=(1.0,), total_steps=8, job=job)
    replica = Replica(cfg, CharCorpus.default(), 0)
    replica.train(3)
    replica.load(replica.base)  # a pull does not restart the schedule: it is keyed by the replica's steps
    replica.train(5)
    assert used == [1e-3 * lr_factor(job.inner_schedule(), k) for k in range(8)]


def test_job_config_schedule_errors_name_the_flag():
    with pytest.raises(ConfigError, match=r"inner lr schedule total=4 is invalid.*--inner-total-steps"):
        JobConfig(inner_lr_schedule="cosine", inner_warmup_steps=4, inner_total_steps=4)
    with pytest.raises(ConfigError, match=r"inner lr schedule min_ratio=-1.0 is invalid.*--inner-min-lr-ratio"):
        JobConfig(inner_min_ratio=-1.0)


# ------------------------------------------------------------------ the CLI's flags


def test_server_flags_build_the_outer_schedule_and_survive_the_demo_argv():
    args = cli.build_parser().parse_args(
        [
            "server",
            "--outer-lr-schedule",
            "cosine",
            "--outer-warmup-versions",
            "5",
            "--outer-total-versions",
            "50",
            "--outer-min-lr-ratio",
            "0.25",
        ]
    )
    outer = cli_server.config(args).outer
    assert outer.schedule() == LRSchedule(kind="cosine", warmup=5, total=50, min_ratio=0.25)
    again = cli.build_parser().parse_args(["server", *SERVER.argv(cli_server.config(args))])  # the demo's server's
    assert cli_server.config(again).outer == outer


def test_no_schedule_flag_is_the_servers_default_outer_config():
    args = cli.build_parser().parse_args(["server"])
    assert cli_server.config(args).outer == ASYNC_OUTER
    args = cli.build_parser().parse_args(["server", "--mode", "sync"])
    assert cli_server.config(args).outer == SYNC_OUTER


def test_worker_flags_reach_the_job_config(monkeypatch):
    import asyncdiloco._malloc
    import asyncdiloco.cli.train
    from asyncdiloco.worker.stats import WorkerStats

    seen = {}
    monkeypatch.setattr(asyncdiloco._malloc, "keep_large_blocks", lambda: None)
    monkeypatch.setattr(asyncdiloco.cli.train, "run_worker", lambda **kw: seen.update(kw) or WorkerStats())
    monkeypatch.setattr(signal, "signal", lambda *_: None)
    monkeypatch.setattr(torch, "set_num_threads", lambda _: None)
    args = cli.build_parser().parse_args(
        [
            "worker",
            "--server",
            "127.0.0.1:1",
            "--max-steps",
            "1",
            "--inner-lr-schedule",
            "cosine",
            "--inner-warmup-steps",
            "10",
            "--inner-total-steps",
            "100",
            "--inner-min-lr-ratio",
            "0.05",
        ]
    )
    assert args.func(args) == 0
    assert seen["job"].inner_schedule() == LRSchedule(kind="cosine", warmup=10, total=100, min_ratio=0.05)
