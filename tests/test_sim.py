"""The virtual-clock simulator: determinism, and the identities that tie it to the server."""

from __future__ import annotations

import json

import pytest

from asyncdiloco.bench.sim import METHODS, SimConfig, simulate
from asyncdiloco.bench.suite import SuiteConfig, run_suite
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
    from asyncdiloco.bench.suite_real import run_real_suite

    cfg = SuiteConfig(
        profiles=("uneven",),
        methods=("sync_diloco", "async_dn_dylu"),
        seeds=(0,),
        total_steps=80,
        local_steps=5,
        eval_every_steps=40,
        job=TINY,
    )
    records = run_real_suite(cfg, str(tmp_path), progress=False)
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
