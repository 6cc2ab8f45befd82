"""The sync-vs-async suite on the real clock: a real server and worker processes.

Each run is ``asyncdiloco demo`` (demo.py) on 127.0.0.1 with the method's server flags,
the profile's speeds as per-step slowdowns (``--slowdown``, relative to the fastest
worker) and a token budget: the workers are stopped once the server has applied the
budget, so every method trains on the same number of tokens and the protocol, queuing
and staleness are real. Records have the fields of the virtual-clock suite (suite.py),
so ``report.md`` and the plots are made by the same code.

    asyncdiloco bench --suite quick --clock real --out DIR
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time

from asyncdiloco.demo import DemoConfig, run_demo
from asyncdiloco.sim import SimConfig, staleness_mean
from asyncdiloco.suite import PROFILES, SuiteConfig, _add_targets, peer_section, plot, report_markdown

#: Real-clock suites: fewer profiles (the real runs emulate fixed speeds only) and, for
#: ``quick``, the one profile the claims are about, so it fits in about 10 minutes.
REAL_SUITES = {
    "quick": SuiteConfig(profiles=("uneven",), total_steps=600, eval_every_steps=100),
    "full": SuiteConfig(profiles=("homogeneous", "uneven", "straggler"), total_steps=2400, eval_every_steps=200),
}

#: Grace window of the DN methods on the real clock, seconds (about one fast inner step
#: of the suite's small model on this kind of machine, as 0.5 virtual s is half a step).
REAL_GRACE_S = 0.05


def server_flags(cfg: SimConfig, grace_s: float) -> tuple[str, tuple[str, ...]]:
    """(mode, ``asyncdiloco server`` flags) of a method: the outer settings sim.py uses."""
    o = cfg.outer()
    flags = [
        "--local-steps", str(cfg.local_steps), "--outer-optimizer", o.optimizer, "--outer-lr", str(o.lr),
        "--outer-momentum", str(o.momentum), "--staleness", o.staleness, "--staleness-a", str(o.staleness_a),
    ]  # fmt: skip
    if o.optimizer == "delayed_nesterov":
        flags += ["--dn-buffer", str(o.dn_buffer), "--grace-s", str(grace_s)]
    if cfg.method == "async_dn_dylu":
        flags.append("--dylu")
    if cfg.method.startswith("sync"):
        flags += ["--mode", "sync", "--min-workers", str(len(cfg.speeds_s_per_step)), "--join-timeout-s", "30"]
        return "sync", tuple(flags)
    return "async", tuple(flags)


def run_real_suite(cfg: SuiteConfig, out_dir: str, progress: bool = True) -> list[dict]:
    """Run every (profile, method, seed) with real processes; write runs.jsonl, report.md, plots."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jsonl = out / "runs.jsonl"
    jsonl.unlink(missing_ok=True)
    records = []
    runs = [(p, m, s) for p in cfg.profiles for m in cfg.methods for s in cfg.seeds]
    for k, (profile, method, seed) in enumerate(runs, 1):
        prof = PROFILES[profile]
        speeds = prof["speeds"]
        sim_cfg = SimConfig(method=method, speeds_s_per_step=speeds, total_steps=cfg.total_steps,
                            local_steps=cfg.local_steps, seed=seed, job=cfg.job)  # fmt: skip
        mode, flags = server_flags(sim_cfg, REAL_GRACE_S)
        job = dataclasses.replace(cfg.job, seed=seed)
        demo = DemoConfig(
            num_workers=len(speeds), max_seconds=600.0, out_dir=str(out / "runs" / f"{profile}-{method}-{seed}"),
            slowdowns=tuple(s / min(speeds) for s in speeds), server_args=flags, job=job, eval_every_s=2.0,
            mode=mode, token_budget=cfg.total_steps * job.tokens_per_step,
        )  # fmt: skip
        if progress:
            print(f"[{k}/{len(runs)}] {profile} {method} seed {seed}", flush=True)
        started = time.monotonic()
        report = run_demo(demo, progress=False)
        rec = _record(profile, method, seed, sim_cfg, report, time.monotonic() - started)
        records.append(rec)
        with open(jsonl, "a") as f:
            f.write(json.dumps(rec) + "\n")
    _add_targets(records, cfg.target_margin)
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))
    (out / "report.md").write_text(
        report_markdown(records, cfg).replace("(virtual clock)", "(real clock)").replace(
            "Time is virtual seconds (workers scheduled by their seconds per step).",
            "Time is real seconds of training (server and worker processes on 127.0.0.1; speeds emulated by "
            "per-step delays relative to the fastest worker).",
        )
        + peer_section(cfg, out, progress)
    )
    plot(records, out)
    return records


def _record(profile: str, method: str, seed: int, sim_cfg: SimConfig, report: dict, real_s: float) -> dict:
    t0 = report["train_start_s"]
    train_s = max(report["wall_s"] - t0, 1e-9)
    curve = [
        {"steps": c["tokens"] // sim_cfg.job.tokens_per_step, "tokens": c["tokens"], "time_s": max(c["wall_s"] - t0, 0.0),
         "version": c["version"], "eval_loss": c["eval_loss"]}
        for c in report["eval_curve"]
    ]  # fmt: skip
    idle = [w.get("idle_s") or 0.0 for w in report["workers"]]
    hist = report["staleness_histogram"]
    return {
        "clock": "real",
        "profile": profile,
        "method": method,
        "seed": seed,
        "workers": len(report["workers"]),
        "speeds_s_per_step": list(sim_cfg.speeds_s_per_step),
        "local_steps": sim_cfg.local_steps,
        "total_steps": sim_cfg.total_steps,
        "tokens": report["tokens_applied"],
        "final_eval_loss": report["final_eval_loss"],
        "virtual_wall_s": train_s,  # the suite's column name; here real training seconds
        "utilisation": sum(max(0.0, 1 - i / train_s) for i in idle) / len(idle),
        "updates": report["version"],
        "staleness_histogram": hist,
        "mean_staleness": staleness_mean(hist),
        "bytes_up": report["bytes_pushed"],
        "bytes_down": report["bytes_pulled"],
        "curve": curve,
        "real_s": real_s,
        "median_round_s": (report.get("round_time_s") or {}).get("round"),  # sync runs
    }
