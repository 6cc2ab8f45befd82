"""The suite's runs on the real clock (suite.py ``run_suite(..., clock="real")``): each
(profile, method, seed) is a demo of real processes with the method's server flags
(``server_flags``), the profile's speeds as slowdowns of padded steps (``REAL_STEP_S``),
its speed changes and leave mapped onto real seconds by a calibrated scale
(``real_schedule``), and the suite's token budget; its record has the virtual suite's
fields plus DyLU's measured rates (``rate_figures``). docs/algorithms.md, "The benchmark
suite" ("Clocks") and the real-clock results."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import time

from asyncdiloco.bench.demo import DemoConfig, run_demo
from asyncdiloco.bench.profiles import PROFILES, Profile
from asyncdiloco.bench.sim import METHODS, SimConfig, staleness_mean
from asyncdiloco.bench.suite_config import SuiteConfig, sim_config
from asyncdiloco.errors import AsyncDiLoCoError, ConfigError
from asyncdiloco.flags.settings import SERVER_RUN

#: Seconds between the demo's evaluations of the global model: fine enough that the time
#: to the target resolves a 3x speed-up of runs that train for tens of seconds.
REAL_EVAL_EVERY_S = 0.5

#: Seconds a full-speed inner step lasts at least (``asyncdiloco worker --step-s``): the
#: suite's model trains a step in about 6-20 ms here, so a round of the fastest worker
#: (H = 20) lasted about 0.2 s and its push, pull and the group's transfers were a large
#: share of it (utilisation 0.74-0.76); a real DiLoCo round lasts minutes against its
#: transfers. The step is padded with a sleep inside it (the rate sees it as compute), so
#: the slowdowns keep their ratios. docs/algorithms.md, "Real clock".
REAL_STEP_S = 0.05

#: Token budget of a calibration demo, in inner steps summed over workers.
CALIBRATION_STEPS = 300
#: The method a calibration demo runs (its r hardly depends on the method).
CALIBRATION_METHOD = "async_nesterov_poly"


@dataclasses.dataclass(frozen=True)
class RealSchedule:
    """A profile on the real clock (times in seconds of training, from each worker's
    start for the speed changes and from the demo's ``train_start_s`` for the leave)."""

    #: ``--slowdown`` per worker: speed ÷ the fastest speed v_min.
    slowdowns: tuple[float, ...]
    #: Per worker, ``((t_s, F), ...)`` for ``--slowdown-changes``.
    slowdown_changes: tuple[tuple[tuple[float, float], ...], ...]
    #: (worker index, leave at s, rejoin at s) for ``DemoConfig.leave_rejoin``, or None.
    leave_rejoin: tuple[int, float, float] | None
    #: Real seconds per virtual second, r / v_min.
    real_s_per_virtual_s: float


def real_schedule(profile: Profile, real_s_per_step: float) -> RealSchedule:
    """Map a ``suite.PROFILES`` entry onto the real clock: speeds become slowdowns
    relative to v_min (the fastest speed, initial or changed), virtual times t become
    t × real_s_per_step / v_min.

    Args:
        profile: its ``speeds_s_per_step``, ``speed_changes`` ((t, worker, v), ...) and
            ``leave_rejoin`` ((worker, leave t, rejoin t)), virtual seconds.
        real_s_per_step: r, real seconds per inner step of a worker at ``--slowdown 1``.
    Raises:
        ConfigError: r is not a positive number.
    """
    if not (math.isfinite(real_s_per_step) and real_s_per_step > 0):
        raise ConfigError(f"real_s_per_step={real_s_per_step} is invalid: give the measured seconds per step, > 0")
    speeds = tuple(profile.speeds_s_per_step)
    changes = tuple(profile.speed_changes)
    v_min = min(speeds + tuple(v for _, _, v in changes))
    scale = real_s_per_step / v_min
    per_worker: list[list[tuple[float, float]]] = [[] for _ in speeds]
    for t, w, v in sorted(changes):
        per_worker[w].append((t * scale, v / v_min))
    lr = profile.leave_rejoin
    return RealSchedule(
        slowdowns=tuple(v / v_min for v in speeds),
        slowdown_changes=tuple(tuple(c) for c in per_worker),
        leave_rejoin=(lr[0], lr[1] * scale, lr[2] * scale) if lr is not None else None,
        real_s_per_virtual_s=scale,
    )


def changes_flag(changes: tuple[tuple[float, float], ...]) -> tuple[str, ...]:
    return ("--slowdown-changes", ",".join(f"{t:.4f}:{f:.6g}" for t, f in changes)) if changes else ()


def calibrate_real_s_per_step(profile: str, cfg: SuiteConfig, out_dir: pathlib.Path) -> float:
    """r: real seconds per inner step at ``--slowdown 1``, measured by a short demo of
    ``profile``'s initial speeds (``CALIBRATION_METHOD``, ``CALIBRATION_STEPS``) on this
    machine, pooled over its workers: Σ (wall − blocked) ÷ Σ inner steps × slowdown."""
    speeds = PROFILES[profile].speeds_s_per_step
    sim_cfg = SimConfig(
        method=CALIBRATION_METHOD,
        speeds_s_per_step=speeds,
        total_steps=CALIBRATION_STEPS,
        local_steps=cfg.local_steps,
        job=cfg.job,
    )
    mode, flags, worker_args = server_flags(sim_cfg)
    demo = DemoConfig(
        num_workers=len(speeds),
        max_seconds=1200.0,
        out_dir=str(out_dir),
        slowdowns=tuple(s / min(speeds) for s in speeds),
        server_args=flags,
        job=cfg.job,
        eval_every_s=60.0,
        mode=mode,
        token_budget=CALIBRATION_STEPS * cfg.job.tokens_per_step,
        worker_args=worker_args,
    )
    run_demo(demo, progress=False)
    r = measured_real_s_per_step(out_dir)
    if r is None:
        raise AsyncDiLoCoError(f"the calibration demo in {out_dir} trained no steps; see its worker-*.log")
    return r


def measured_real_s_per_step(run_dir: pathlib.Path) -> float | None:
    """Real seconds per inner step at slowdown 1 in a finished async demo, from its
    workers' stats files (those without speed changes); None if none trained."""
    busy_s = steps = 0.0
    for path in sorted(pathlib.Path(run_dir).glob("worker-*.json")):
        st = json.loads(path.read_text())
        if st.get("slowdown_changes") or "wall_s" not in st or not st.get("inner_steps"):
            continue  # changing speeds or a sync worker (no wall_s): no single factor to divide by
        busy_s += st["wall_s"] - st["blocked_s"]
        steps += st["inner_steps"] * st["slowdown"]
    return busy_s / steps if steps else None


def server_flags(cfg: SimConfig) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """(mode, ``asyncdiloco server`` flags, ``asyncdiloco worker`` flags) of a method: the
    flags that rebuild ``cfg.server_config("real")`` in the demo's server process."""
    server = cfg.server_config("real")
    overlap = ("--overlap",) if METHODS[cfg.method].overlap else ()
    return server.mode, SERVER_RUN.argv(server), (*overlap, "--step-s", str(REAL_STEP_S))


def run_real(cfg: SuiteConfig, out: pathlib.Path, progress: bool, real_s_per_step: float | None) -> list[dict]:
    """Run every (profile, method, seed) of ``cfg`` as a demo, one after the other; write
    each record to runs.jsonl as it finishes (suite.py ``run_suite`` writes the report).

    Args:
        real_s_per_step: r of ``real_schedule`` for the profiles with speed changes or a
            leave; None: measured per such profile by ``calibrate_real_s_per_step``.
    """
    jsonl = out / "runs.jsonl"
    jsonl.unlink(missing_ok=True)
    records = []
    runs = [(p, m, s) for p in cfg.profiles for m in cfg.methods for s in cfg.seeds]
    schedules: dict[str, tuple[RealSchedule, float, str]] = {}  # profile -> (schedule, r, where r came from)
    for k, (profile, method, seed) in enumerate(runs, 1):
        if profile not in schedules:
            schedules[profile] = _schedule(cfg, profile, out, progress, real_s_per_step)
        if progress:
            print(f"[{k}/{len(runs)}] {profile} {method} seed {seed}", flush=True)
        rec = _run_one(cfg, profile, method, seed, schedules[profile], out / "runs" / f"{profile}-{method}-{seed}")
        records.append(rec)
        with open(jsonl, "a") as f:
            f.write(json.dumps(rec) + "\n")
    return records


def _schedule(
    cfg: SuiteConfig, profile: str, out: pathlib.Path, progress: bool, real_s_per_step: float | None
) -> tuple[RealSchedule, float, str]:
    """``profile``'s schedule on the real clock, its r and where r came from."""
    prof = PROFILES[profile]
    r, source = real_s_per_step, "given"
    if r is None and (prof.speed_changes or prof.leave_rejoin is not None):
        if progress:
            print(f"calibrating {profile}: real seconds per step at slowdown 1", flush=True)
        r, source = calibrate_real_s_per_step(profile, cfg, out / "runs" / f"{profile}-calibration"), "calibration"
    elif r is None:
        r, source = 1.0, "unused"  # fixed speeds: only the slowdowns matter
    return real_schedule(prof, r), r, source


def _run_one(
    cfg: SuiteConfig,
    profile: str,
    method: str,
    seed: int,
    schedule: tuple[RealSchedule, float, str],
    run_dir: pathlib.Path,
) -> dict:
    """One demo of (profile, method, seed) to the suite's token budget: its record."""
    sched, r, source = schedule
    sim_cfg = sim_config(cfg, profile, method, seed)
    mode, flags, worker_args = server_flags(sim_cfg)
    job = dataclasses.replace(cfg.job, seed=seed)
    demo = DemoConfig(
        num_workers=len(sim_cfg.speeds_s_per_step),
        max_seconds=1200.0,
        out_dir=str(run_dir),
        slowdowns=sched.slowdowns,
        server_args=flags,
        job=job,
        eval_every_s=REAL_EVAL_EVERY_S,
        worker_args=worker_args,
        mode=mode,
        token_budget=cfg.total_steps * job.tokens_per_step,
        leave_rejoin=sched.leave_rejoin,
        per_worker_args=tuple(changes_flag(c) for c in sched.slowdown_changes),
    )
    started = time.monotonic()
    report = run_demo(demo, progress=False)
    rec = _record(profile, method, seed, sim_cfg, report, time.monotonic() - started)
    rec["schedule"] = {
        "real_s_per_step": r if source != "unused" else None,
        "real_s_per_step_from": source,
        "real_s_per_virtual_s": sched.real_s_per_virtual_s if source != "unused" else None,
        "slowdowns": list(sched.slowdowns),
        "slowdown_changes": [list(map(list, c)) for c in sched.slowdown_changes],
        "leave_rejoin": list(sched.leave_rejoin) if sched.leave_rejoin else None,
    }
    rec["measured_real_s_per_step"] = measured_real_s_per_step(run_dir) if mode == "async" else None
    return rec


#: How far a worker's rate ratio (v_w / v of the fastest) as DyLU used it may be from the
#: ratio of the compute rates it measured over the whole run (the issue's target).
RATE_RATIO_TARGET = 0.10


def rate_figures(workers: list[dict], local_steps: int) -> dict | None:
    """DyLU's inputs of one async run against what the workers' compute was.

    Per worker process that timed inner steps (``report.json``'s ``workers[]``):
    ``compute_steps_per_s``, its timed steps over their seconds (the mean over the run:
    the true compute rate); ``steps_per_s``, the rate it reported last (the server's, up
    to ``RATE_SPREAD``); ``local_steps_per_round``, the H_w it was told last; and, with
    the fastest worker's compute rate as 1, ``rate_ratio_error`` (reported ratio ÷
    compute ratio − 1, target within ±``RATE_RATIO_TARGET``), ``h_ratio_error`` ((H_w / H)
    ÷ compute ratio − 1: it includes DyLU's rounding down, at most one step in H_w) and
    ``dylu_local_steps`` (⌊compute ratio · H⌋, what exact rates would give). None for a
    sync run (nothing timed).
    """
    rows = [w for w in workers if w.get("timed_steps") and w.get("compute_s")]
    if not rows:
        return None
    true = [w["timed_steps"] / w["compute_s"] for w in rows]
    fastest = max(range(len(rows)), key=lambda i: true[i])
    out = []
    for w, v in zip(rows, true, strict=True):
        ratio = v / true[fastest]
        reported = w["steps_per_s"] / rows[fastest]["steps_per_s"] if rows[fastest]["steps_per_s"] else math.nan
        h_w = w.get("local_steps_per_round") or 0
        out.append(
            {
                "index": w["index"],
                "speed_factor": w["speed_factor"],
                "compute_steps_per_s": round(v, 3),
                "steps_per_s": round(w["steps_per_s"], 3),
                "local_steps_per_round": h_w,
                "dylu_local_steps": max(1, math.floor(ratio * local_steps + 1e-9)),
                "rate_ratio_error": round(reported / ratio - 1, 4),
                "h_ratio_error": round(h_w / local_steps / ratio - 1, 4),
            }
        )
    worst = max(abs(r["rate_ratio_error"]) for r in out)
    return {"workers": out, "max_rate_ratio_error": worst, "within_target": worst <= RATE_RATIO_TARGET}


def rate_section(records: list[dict]) -> str:
    """report.md's table of DyLU's measured rates per async run (``rate_figures``)."""
    lines = [
        "## DyLU's rates against the measured compute (real clock)\n",
        f"Per run and worker: the compute rate it measured over the run (steps/s), the rate DyLU used "
        f"(reported last), H_w, ⌊ratio · H⌋ of the measured rates, and the errors of the used rate ratio "
        f"(target ±{RATE_RATIO_TARGET:.0%}) and of H_w / H (includes DyLU's rounding down).\n",
        "| run | utilisation | worker (×slower) | compute steps/s | used steps/s | H_w | ⌊ratio·H⌋ "
        "| rate ratio err | H ratio err |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for rec in records:
        figs = rec.get("rates")
        if not figs:
            continue
        run, util = f"{rec['profile']} {rec['method']} {rec['seed']}", f"{rec['utilisation']:.3f}"
        for w in figs["workers"]:
            lines.append(
                f"| {run} | {util} | {w['index']} (×{w['speed_factor']:.2f}) | "
                f"{w['compute_steps_per_s']:.2f} | {w['steps_per_s']:.2f} | {w['local_steps_per_round']} | "
                f"{w['dylu_local_steps']} | {w['rate_ratio_error']:+.1%} | {w['h_ratio_error']:+.1%} |"
            )
            run = util = ""
    return "\n".join(lines) + "\n"


def _record(profile: str, method: str, seed: int, sim_cfg: SimConfig, report: dict, real_s: float) -> dict:
    t0 = report["train_start_s"]
    train_s = max(report["wall_s"] - t0, 1e-9)
    curve = [
        {
            "steps": c["tokens"] // sim_cfg.job.tokens_per_step,
            "tokens": c["tokens"],
            "time_s": max(c["wall_s"] - t0, 0.0),
            "version": c["version"],
            "eval_loss": c["eval_loss"],
        }
        for c in report["eval_curve"]
    ]
    idle_by_index: dict[int, float] = {}  # a worker that left and rejoined: its processes' idle time summed
    for w in report["workers"]:
        idle_by_index[w["index"]] = idle_by_index.get(w["index"], 0.0) + (w.get("idle_s") or 0.0)
    idle = list(idle_by_index.values())
    hist = report["staleness_histogram"]
    return {
        "clock": "real",
        "profile": profile,
        "method": method,
        "seed": seed,
        "workers": len(sim_cfg.speeds_s_per_step),
        "worker_processes": len(report["workers"]),
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
        "group_size_histogram": report.get("group_size_histogram") or [],
        "run_config": report.get("run_config"),
        "bytes_up": report["bytes_pushed"],
        "bytes_down": report["bytes_pulled"],
        "curve": curve,
        "real_s": real_s,
        "median_round_s": (report.get("round_time_s") or {}).get("round"),  # sync runs
        "rates": rate_figures(report["workers"], sim_cfg.local_steps),
    }
