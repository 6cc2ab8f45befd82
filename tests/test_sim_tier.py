"""The two-region simulation (bench/sim_tier.py) and its section of the suite (suite_tier.py)."""

from __future__ import annotations

import functools
import json

import pytest

from asyncdiloco.bench.sim_tier import REGION_PROFILES, TierSimConfig, simulate_tier
from asyncdiloco.bench.suite import run_suite
from asyncdiloco.bench.suite_config import SuiteConfig
from asyncdiloco.errors import ConfigError
from asyncdiloco.job.config import JobConfig

TINY = JobConfig(n_layer=1, n_embd=32, n_head=2, context_len=16, batch_size=8, eval_batches=2)


@functools.cache
def _run(method: str, every: int = 4):
    """One run (cached: the tests share it; results are deterministic)."""
    cfg = TierSimConfig(method=method, every=every, total_steps=120, local_steps=5, eval_every_steps=40, job=TINY)
    return simulate_tier(cfg)


def test_flat_and_tier_train_the_same_budget_and_the_tier_crosses_the_slow_link_less():
    flat, tier = _run("flat"), _run("tier", every=4)
    assert flat.steps == tier.steps == 120  # every step reached the evaluated (global) model
    assert flat.upward_pushes == 0 and tier.upward_pushes > 0
    assert flat.worker_pushes == tier.worker_pushes == 120 // 5  # the same rounds of H steps
    # flat: every B push and pull crosses it; tier: one push and one pull per K regional pushes of B
    assert tier.slow_link_bytes < flat.slow_link_bytes
    assert tier.final_eval_loss == tier.curve[-1]["eval_loss"] and tier.curve[-1]["steps"] == 120


def test_a_tier_run_is_deterministic():
    a, b = _run("tier", every=2), _run.__wrapped__("tier", every=2)
    assert [p["eval_loss"] for p in a.curve] == [p["eval_loss"] for p in b.curve]
    assert (a.wall_s, a.slow_link_bytes) == (b.wall_s, b.slow_link_bytes)


def test_the_slow_link_makes_the_flat_server_slower_than_the_tier():
    flat, tier = _run("flat"), _run("tier", every=4)
    assert tier.wall_s < flat.wall_s  # B's workers wait for the slow link on every flat round


def test_bad_tier_runs_are_refused():
    with pytest.raises(ConfigError, match="method"):
        TierSimConfig(method="hier")
    with pytest.raises(ConfigError, match="every"):
        TierSimConfig(method="tier", every=0)
    with pytest.raises(ConfigError, match="regions"):
        SuiteConfig(profiles=(), regions=("nowhere",))


def test_the_suite_reports_the_two_region_rows(tmp_path):
    cfg = SuiteConfig(
        profiles=(),
        regions=tuple(REGION_PROFILES),
        tier_every=(2,),
        seeds=(0,),
        total_steps=60,
        local_steps=5,
        eval_every_steps=20,
        job=TINY,
        processes=1,
    )
    run_suite(cfg, str(tmp_path), progress=False)
    report = (tmp_path / "report.md").read_text()
    assert "## Two regions" in report and "| flat |" in report and "| tier_k2 |" in report
    rows = [json.loads(x) for x in (tmp_path / "regions.jsonl").read_text().splitlines()]
    assert [r["method"] for r in rows] == ["flat", "tier_k2"]
    assert all("time_to_target_s" in r and r["slow_link_bytes"] > 0 for r in rows)
