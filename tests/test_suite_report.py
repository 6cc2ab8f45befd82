"""The suite's report and claims on synthetic records: what counts as shown, the times
to each baseline's own final loss, the loss at equal wall time, the strongest baseline,
and the tuning stage's picks (run_suite with an inline pool and a fake simulator run)."""

from __future__ import annotations

import concurrent.futures
import json

import pytest

from asyncdiloco.bench import suite, suite_markdown
from asyncdiloco.bench.suite import pick
from asyncdiloco.bench.suite_config import SuiteConfig, TuneGrid
from asyncdiloco.bench.suite_report import claims_json, summarize
from asyncdiloco.errors import ConfigError


def _rec(method: str, seed: int, curve: list[tuple[float, float]], *, mode: str = "async", tuned: bool = False, **kw):
    """A run record: ``curve`` as (time s, held-out loss) points, the last one the final model."""
    points = [
        {"steps": 40 * i, "tokens": 40 * i * 512, "time_s": t, "version": i, "eval_loss": loss}
        for i, (t, loss) in enumerate(curve)
    ]
    rec = {
        "profile": "uneven",
        "method": method,
        "seed": seed,
        "workers": 4,
        "speeds_s_per_step": [1.0] * 4,
        "final_eval_loss": curve[-1][1],
        "virtual_wall_s": curve[-1][0],
        "curve": points,
        "utilisation": 0.9,
        "updates": 10,
        "mean_staleness": 0.0,
        "staleness_histogram": [10],
        "bytes_up": 1000,
        "bytes_down": 1000,
        "mode": mode,
        "tuned": tuned,
    }
    rec.update(kw)
    return rec


def _finals(method: str, finals: list[float], *, end_s: float = 100.0, **kw) -> list[dict]:
    """One record per seed, each curve going straight from 4.0 to its final loss at ``end_s``."""
    return [_rec(method, s, [(0.0, 4.0), (end_s, f)], **kw) for s, f in enumerate(finals)]


def test_a_win_is_shown_only_beyond_twice_the_larger_seed_spread():
    near = _finals("async_dn_dylu", [1.99, 2.00, 2.01]) + _finals("async_dn_dylu_overlap", [1.975, 1.985, 1.995])
    c = claims_json(summarize(near))["uneven"]["beyond"]["async_dn_dylu_overlap"]
    # g = -0.75 %, s = 0.5 %: g + 2s = +0.25 %, not < 0
    assert c["value"] == pytest.approx(-0.0075) and c["spread"] == pytest.approx(0.005) and not c["shown"]
    clear = _finals("async_dn_dylu", [1.995, 2.00, 2.005]) + _finals("async_dn_dylu_overlap", [1.965, 1.97, 1.975])
    assert claims_json(summarize(clear))["uneven"]["beyond"]["async_dn_dylu_overlap"]["shown"]


def test_within_one_percent_counts_twice_the_spread_against_the_claim():
    def claim(default: list[float]) -> dict:
        sync = _finals("sync_diloco_tuned", [2.00, 2.00, 2.00], end_s=400.0, mode="sync", tuned=True)
        return claims_json(summarize(sync + _finals("async_dn_dylu", default)))["uneven"]["c"]

    tight = claim([2.004, 2.008, 2.012])  # g = 0.4 %, s = 0.2 %: g + 2s = 0.8 %
    assert tight["loss_shown"] and tight["baseline"] == "sync_diloco_tuned"
    loose = claim([1.99, 2.01, 2.03])  # g = 0.5 %, s = 1 %: g + 2s = 2.5 %
    assert loose["loss_gap"] == pytest.approx(0.005) and not loose["loss_shown"] and not loose["shown"]


def test_naive_async_that_diverges_is_worse_whatever_its_spread():
    recs = _finals("sync_diloco", [2.0, 2.01, 1.99], mode="sync") + _finals("async_nesterov", [80.0, 300.0, 9.0])
    b = claims_json(summarize(recs))["uneven"]["b"]
    assert b["shown"] and b["diverged"] and b["value"] is None


def test_time_to_each_baseline_is_to_its_own_mean_final_loss_without_margin():
    sync = [
        _rec("sync_diloco_tuned", 0, [(0, 4.0), (150, 2.5), (300, 2.0)], mode="sync", tuned=True),
        _rec("sync_diloco_tuned", 1, [(0, 4.0), (150, 2.6), (300, 2.2)], mode="sync", tuned=True),
    ]
    default = [
        _rec("async_dn_dylu", s, [(0, 4.0), (40, 2.13), (60, 2.09), (80, 2.11), (100, 1.9)]) for s in (0, 1)
    ]  # the baseline's mean final loss is 2.1: reached at 60 s, not at 40 s (the old target, 2.1 × 1.02, was)
    rows = summarize(sync + default)["uneven"]["rows"]
    v = rows["async_dn_dylu"]["vs"]["sync_diloco_tuned"]
    assert v["target"] == pytest.approx(2.1) and v["time"] == (60, 0.0) and v["reached"] == "2/2"
    assert v["speedup"] == pytest.approx(300 / 60)  # the baseline's own time: each seed at its own final loss
    assert v["wall_ratio"] == pytest.approx(300 / 100)
    own = rows["sync_diloco_tuned"]["vs"]["sync_diloco_tuned"]
    assert own["time"] == (300, 0.0) and own["speedup"] == 1.0


def test_a_row_that_misses_the_baseline_on_one_seed_has_no_speed_up():
    sync = _finals("sync_diloco_tuned", [2.0, 2.0], end_s=300.0, mode="sync", tuned=True)
    default = [_rec("async_dn_dylu", 0, [(0, 4.0), (50, 1.9)]), _rec("async_dn_dylu", 1, [(0, 4.0), (50, 2.05)])]
    c = claims_json(summarize(sync + default))["uneven"]["c"]
    assert c["reached"] == "1/2" and c["speedup"] is None and not c["speed_shown"]
    assert c["wall_ratio"] == pytest.approx(6.0)  # still reported


def test_a_speed_up_must_clear_its_target_with_the_times_spread_against_it():
    sync = _finals("sync_diloco_tuned", [2.0, 2.0], end_s=300.0, mode="sync", tuned=True)
    fast = [_rec("async_dn_dylu", s, [(0, 4.0), (t, 1.99), (t + 50, 1.95)]) for s, t in enumerate((90.0, 110.0))]
    c = claims_json(summarize(sync + fast))["uneven"]["c"]
    assert c["speedup"] == pytest.approx(3.0)  # 300 / 100, above 2.7 ...
    assert c["speedup_low"] == pytest.approx(300 / (100 + 2 * 14.142135623730951))  # ... but not with 2 std: 2.34
    assert not c["speed_shown"]


def test_loss_at_equal_wall_reads_every_curve_when_the_first_row_has_finished():
    fast = [
        _rec("async_dn_dylu", 0, [(0, 4.0), (50, 2.5), (100, 2.0)]),
        _rec("async_dn_dylu", 1, [(0, 4.0), (105, 2.1)]),
    ]
    slow = [
        _rec("sync_diloco", s, [(0, 4.0), (50, 3.0), (100, 2.6), (200, 2.2), (300, 1.9 + s / 10)], mode="sync")
        for s in (0, 1)
    ]
    p = summarize(fast + slow)["uneven"]
    assert p["equal_wall_s"] == 105  # the async row has finished every seed by then; sync by 300
    assert p["rows"]["sync_diloco"]["loss_at_equal_wall"] == (pytest.approx(2.6), 0.0)
    assert p["rows"]["async_dn_dylu"]["loss_at_equal_wall"][0] == pytest.approx(2.05)


def test_strongest_is_the_best_tuned_synchronous_row():
    recs = (
        _finals("sync_localsgd", [1.90, 1.90], mode="sync")  # better, but not tuned
        + _finals("sync_diloco", [2.05, 2.05], mode="sync")
        + _finals("sync_diloco_tuned", [2.02, 2.02], mode="sync", tuned=True)
        + _finals("sync_diloco_adaptive", [1.99, 1.99], mode="sync", tuned=True)
        + _finals("async_dn_dylu", [1.95, 1.95], tuned=True)  # async: never a baseline
    )
    p = summarize(recs)["uneven"]
    assert p["strongest"] == "sync_diloco_adaptive" and p["strongest_tuned"]
    assert p["baseline_c"] == "sync_diloco_tuned"
    st = claims_json(summarize(recs))["uneven"]["strongest"]
    assert st["baseline"] == "sync_diloco_adaptive" and st["loss_gap"] == pytest.approx(1.95 / 1.99 - 1)
    untuned = summarize(_finals("sync_diloco", [2.05], mode="sync") + _finals("sync_localsgd", [2.0], mode="sync"))
    assert untuned["uneven"]["strongest"] == "sync_localsgd" and not untuned["uneven"]["strongest_tuned"]


def test_pick_is_the_argmin_and_never_a_nan():
    losses = {(0.7, 0.6): 2.01, (0.7, 0.9): float("nan"), (1.0, 0.6): 1.99, (1.0, 0.9): 1.99}
    assert pick(losses) == (1.0, 0.6)  # ties: the earlier cell


def test_the_tuning_seed_cannot_be_an_evaluation_seed():
    with pytest.raises(ConfigError, match="tuning seed 1 is an evaluation seed"):
        SuiteConfig(profiles=("uneven",), tuned=("async_dn_dylu",), tune=TuneGrid(seed=1), seeds=(0, 1, 2))
    with pytest.raises(ConfigError, match="sync_localsgd cannot be tuned"):
        SuiteConfig(profiles=("uneven",), tuned=("sync_localsgd",))


class _InlinePool(concurrent.futures.Executor):
    """Runs each submitted call at once, in this thread."""

    def submit(self, fn, /, *args, **kwargs):
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_result(fn(*args, **kwargs))
        return fut


def _fake_run(args):
    """A simulator run whose final loss is lowest at (η 1.0, μ 0.8): 2 + |η − 1| + |μ − 0.8|."""
    profile, cfg = args
    o = cfg.outer()
    final = 2.0 + abs(o.lr - 1.0) + abs(o.momentum - 0.8) + cfg.seed / 1000
    rec = _rec(cfg.method, cfg.seed, [(0.0, 4.0), (100.0, final)])
    rec["profile"] = profile
    return rec


def test_the_tuning_stage_picks_per_method_on_its_own_seed(tmp_path, monkeypatch):
    monkeypatch.setattr(suite, "_run_one", _fake_run)
    monkeypatch.setattr(suite_markdown, "plot_suite", lambda records, summary, out: None)
    cfg = SuiteConfig(
        profiles=("uneven", "straggler"),
        methods=("sync_localsgd", "sync_diloco"),
        tuned=("sync_diloco", "async_dn_dylu"),
        tune=TuneGrid(seed=7, lrs=(0.7, 1.0), momenta=(0.6, 0.8, 0.9)),
        seeds=(0, 1),
        peer=False,
    )
    records = suite.run_suite(cfg, str(tmp_path), progress=False, pool=_InlinePool())
    grid = [json.loads(x) for x in (tmp_path / "tuning.jsonl").read_text().splitlines()]
    assert len(grid) == 2 * 6 and {r["seed"] for r in grid} == {7} and {r["profile"] for r in grid} == {"uneven"}
    tuning = json.loads((tmp_path / "tuning.json").read_text())
    assert tuning["picks"] == {"sync_diloco": [1.0, 0.8], "async_dn_dylu": [1.0, 0.8]}
    assert tuning["cells"]["sync_diloco"]["0.7,0.9"] == pytest.approx(2.0 + 0.3 + 0.1 + 0.007)
    assert {r["seed"] for r in records} == {0, 1}  # the evaluation never runs the tuning seed
    by_row = {(r["profile"], r["method"], r["seed"]): r for r in records}
    assert len(by_row) == len(records) == 2 * 4 * 2  # profiles × rows × seeds
    standard, tuned = by_row["uneven", "sync_diloco", 0], by_row["uneven", "sync_diloco_tuned", 0]
    assert (standard["outer_lr"], standard["outer_momentum"], standard["tuned"]) == (0.7, 0.9, False)
    assert (tuned["outer_lr"], tuned["outer_momentum"], tuned["tuned"]) == (1.0, 0.8, True)
    assert by_row["straggler", "async_dn_dylu", 1]["outer_lr"] == 1.0
    report = (tmp_path / "report.md").read_text()
    assert "## Tuning the outer step" in report and "| sync_diloco_tuned |" in report
    assert "**The default's pick (η 1, μ 0.8) is not the server's default" in report
    claims = json.loads((tmp_path / "claims.json").read_text())
    assert claims["uneven"]["c"]["baseline"] == "sync_diloco_tuned"
