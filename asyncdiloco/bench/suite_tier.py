"""The suite's two-region section: the runs (the flat server against the tier for each K
in ``SuiteConfig.tier_every``, sim_tier.py, on each of ``SuiteConfig.regions``), their
records, ``regions.jsonl`` and the report's section; suite.py runs them.
docs/algorithms.md, "Hierarchical tier".

    asyncdiloco bench --suite tier --out DIR
"""

from __future__ import annotations

import json
import pathlib
import statistics
import time

from asyncdiloco.bench.sim_tier import REGION_PROFILES, TierSimConfig, TierSimResult, simulate_tier


def tier_configs(cfg, profile: str) -> list[TierSimConfig]:
    """The flat run and the tier's runs (one per K) of ``profile``, for every seed of suite ``cfg``."""
    runs = []
    for seed in cfg.seeds:
        common = dict(
            profile=profile,
            total_steps=cfg.total_steps,
            local_steps=cfg.local_steps,
            seed=seed,
            eval_every_steps=cfg.eval_every_steps,
            job=cfg.job,
        )
        runs.append(TierSimConfig(method="flat", **common))
        runs += [TierSimConfig(method="tier", every=k, **common) for k in cfg.tier_every]
    return runs


def run_tier(run: TierSimConfig) -> dict:
    """One two-region run, timed: its JSON line."""
    started = time.monotonic()
    return tier_record(simulate_tier(run), time.monotonic() - started)


def tier_record(r: TierSimResult, real_s: float) -> dict:
    """One run as a JSON line."""
    c = r.config
    return {
        "clock": "virtual",
        "profile": c.profile,
        "method": c.method if c.method == "flat" else f"tier_k{c.every}",
        "every": c.every if c.method == "tier" else None,
        "seed": c.seed,
        "total_steps": c.total_steps,
        "local_steps": c.local_steps,
        "final_eval_loss": r.final_eval_loss,
        "virtual_wall_s": r.wall_s,
        "slow_link_bytes": r.slow_link_bytes,
        "total_bytes": r.total_bytes,
        "worker_pushes": r.worker_pushes,
        "upward_pushes": r.upward_pushes,
        "steps": r.steps,
        "curve": r.curve,
        "real_s": real_s,
    }


def tier_section(records: list[dict], cfg, out: pathlib.Path) -> str:
    """Write ``regions.jsonl`` (``records``, in run order, with their targets) and return
    the report's section."""
    add_targets(records, cfg.target_margin)
    (out / "regions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return tier_markdown(records, cfg)


def add_targets(records: list[dict], margin: float) -> None:
    """Target per profile = the flat server's mean final loss × (1 + margin); the time to it."""
    for profile in {r["profile"] for r in records}:
        ref = [r["final_eval_loss"] for r in records if r["profile"] == profile and r["method"] == "flat"]
        target = statistics.mean(ref) * (1 + margin)
        for r in records:
            if r["profile"] == profile:
                r["target_loss"] = target
                r["time_to_target_s"] = next((p["time_s"] for p in r["curve"] if p["eval_loss"] <= target), None)


def _ms(xs: list[float], digits: int) -> str:
    if not xs:
        return "—"
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.mean(xs):.{digits}f} ± {sd:.{digits}f}"


def tier_markdown(records: list[dict], cfg) -> str:
    """The report's section: one table per two-region profile."""
    lines = [
        "## Two regions: one flat server vs the hierarchical tier (`asyncdiloco server --parent`)",
        "",
        "Region A's workers sit next to the server, region B's across a slow link (every transfer pays its "
        "latency plus bytes ÷ bandwidth; workers wait for their push and pull). Flat: one server in A, so "
        "each B push and pull crosses the slow link. Tier: a regional server per region (the server's default "
        "outer optimizer), pushing every K regional pushes to a global server (the server's defaults too; it "
        "averages each region's push in over the two regions) that sits next to A's, so only B's every-K "
        "push and pull cross it. Same "
        f"workers, speeds, seeds {list(cfg.seeds)}, H = {cfg.local_steps} and budget ({cfg.total_steps} inner "
        f"steps); replies not grouped. Target = the flat server's final loss + {cfg.target_margin * 100:.0f}%. "
        "Slow-link MB: payload bytes over it, both directions. Raw runs: regions.jsonl.",
        "",
    ]
    for profile in cfg.regions:
        prof = REGION_PROFILES[profile]
        fast, slow = prof["fast"], prof["slow"]
        lines += [
            f"### {profile}: seconds/step {list(prof['speeds'])}, regions {list(prof['regions'])}, fast link "
            f"{fast.latency_s:g} s + {fast.bandwidth_Bps / 1e6:g} MB/s, slow link {slow.latency_s:g} s + "
            f"{slow.bandwidth_Bps / 1e6:g} MB/s",
            "",
            "| method | final loss | time to target (s) | reached | wall (s) | slow-link MB | pushes up |",
            "|---|---|---|---|---|---|---|",
        ]
        methods = list(dict.fromkeys(r["method"] for r in records if r["profile"] == profile))
        for m in methods:
            rs = [r for r in records if r["profile"] == profile and r["method"] == m]
            reached = [r["time_to_target_s"] for r in rs if r["time_to_target_s"] is not None]
            lines.append(
                f"| {m} | {_ms([r['final_eval_loss'] for r in rs], 3)} | "
                f"{_ms(reached, 0) if len(reached) == len(rs) else '—'} | {len(reached)}/{len(rs)} | "
                f"{_ms([r['virtual_wall_s'] for r in rs], 0)} | {_ms([r['slow_link_bytes'] / 1e6 for r in rs], 1)} | "
                f"{_ms([float(r['upward_pushes']) for r in rs], 0)} |"
            )
        lines.append("")
    return "\n".join(lines) + "\n"
