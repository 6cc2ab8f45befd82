"""The scale simulation (bench/sim_scale.py, bench/scale_report.py): every push accounted
for, histograms that sum to the pushes, and S needed computed from the measured numbers."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from asyncdiloco.bench.scale_report import run_scale, shards_needed
from asyncdiloco.bench.sim_scale import ScaleConfig, simulate
from asyncdiloco.errors import ConfigError
from asyncdiloco.ps.config import ServerConfig

#: 50 workers, churn fast enough that some join, leave and are killed within 150 virtual s.
SMALL = ScaleConfig(workers=50, duration_s=150.0, mean_lifetime_s=400.0, apply_sizes=(), numel=256)


def check_accounting(sim: dict) -> None:
    p = sim["pushes"]
    applied = p["applied"]
    assert p["sent"] == applied + p["refused"] == sum(sim["pushes_per_bin"])
    assert p["refused"] == sum(n for k, n in sim["refused_by_reason"].items() if not k.startswith("heartbeat_"))
    assert sim["applied_by_server"] == applied == sim["version"]
    assert sum(sim["staleness_histogram"]) == applied
    assert sum((k + 1) * n for k, n in enumerate(sim["group_size_histogram"])) == applied
    assert sum((k + 1) * n for k, n in enumerate(sim["dn_buffer_histogram"])) + sim["dn_open_arrivals"] == applied
    assert sum(sim["h_w_histogram"]) == sim["server_cpu"]["calls"]["pull"]  # one H_w per pull
    assert sim["server_cpu"]["calls"]["push"] == p["sent"]


def test_the_report_accounts_for_every_push_and_computes_s_from_the_measurements(tmp_path):
    result = run_scale(SMALL, str(tmp_path), progress=False)
    sim, applies = result["simulation"], result["apply"]
    check_accounting(sim)
    p = sim["pushes"]
    assert p["joins"] > SMALL.workers and p["leaves"] + p["crashes"] > 0  # churn happened
    assert 1 <= min(s["alive"] for s in sim["samples"])
    assert len(sim["h_w_histogram"]) == SMALL.local_steps
    # S needed from the measured numbers: ceil(demanded / sustained)
    demand = sim["demand"]["pushes_per_s"]
    assert demand == pytest.approx(p["sent"] / SMALL.duration_s)
    cpu = sim["server_cpu"]
    assert cpu["sustained_pushes_per_s"] == pytest.approx(1 / cpu["per_push_cpu_s"])
    assert cpu["s_needed"] == math.ceil(demand / cpu["sustained_pushes_per_s"])
    assert [(a["numel"], a["registered"]) for a in applies] == [(256, 1), (256, 50)]
    for a in applies:
        assert a["s_needed"] == max(1, math.ceil(demand * a["per_push_cpu_s"] - 1e-9))
        assert a["sustained_pushes_per_s"] == pytest.approx(1 / a["per_push_cpu_s"])
    # the files: JSON lines (the measurements, then the simulation), the report, the plot
    lines = [json.loads(line) for line in (tmp_path / "scale.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in lines] == ["apply_cost", "apply_cost", "simulation"]
    report = (tmp_path / "report.md").read_text()
    for section in ("Pushes per second", "Staleness", "Groups and Delayed Nesterov", "DyLU's H_w", "Churn"):
        assert f"## {section}" in report
    pytest.importorskip("matplotlib")
    assert (tmp_path / "scale.png").stat().st_size > 0


def test_refused_pushes_are_accounted_for_and_the_run_is_deterministic(monkeypatch):
    # a max_staleness below the workers' count: the late pushes of each group are refused
    # and their workers restart from a pull, as a real worker does
    defaults = ScaleConfig.server_config

    def strict(self: ScaleConfig) -> ServerConfig:
        cfg = defaults(self)
        return dataclasses.replace(cfg, outer=dataclasses.replace(cfg.outer, max_staleness=5))

    monkeypatch.setattr(ScaleConfig, "server_config", strict)
    cfg = dataclasses.replace(SMALL, workers=20, duration_s=100.0)
    a, b = simulate(cfg), simulate(cfg)
    check_accounting(a)
    assert a["refused_by_reason"].get("stale_push", 0) > 0
    assert a["staleness"]["max"] <= 5
    for key in ("pushes", "staleness_histogram", "group_size_histogram", "dn_buffer_histogram", "h_w_histogram"):
        assert a[key] == b[key], key
    assert [s["loss"] for s in a["samples"]] == [s["loss"] for s in b["samples"]]


def test_shards_needed():
    assert shards_needed(100.0, 0.004) == 1  # 0.4 s of work per second
    assert shards_needed(100.0, 0.025) == 3  # 2.5 s per second
    assert shards_needed(100.0, 0.025, bookkeeping_s=0.005) == 4  # 100·0.02 / (1 − 0.5)
    assert shards_needed(100.0, 0.025, bookkeeping_s=0.01) is None  # the bookkeeping alone fills a core


@pytest.mark.parametrize(
    "field, value", [("workers", 1), ("crash_fraction", 1.5), ("speed_distribution", "uniform"), ("duration_s", 0)]
)
def test_bad_config_names_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        ScaleConfig(**{field: value})
