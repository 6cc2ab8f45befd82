"""The sync-vs-async benchmark suite on the virtual clock.

Runs every method (sim.METHODS) on worker-speed profiles with the same model, data,
token budget and seeds, and writes ``runs.jsonl`` (one line per run), ``report.md``
(a table per profile, mean ± std over seeds, and the three claims of Liu et al. 2024,
arXiv 2401.09135, checked against the numbers) and PNG plots (loss vs tokens, loss vs
time, utilisation, staleness).

    asyncdiloco bench --suite quick --clock virtual --out DIR
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import statistics
import time

from asyncdiloco.errors import ConfigError
from asyncdiloco.job import JobConfig
from asyncdiloco.sim import METHODS, SimConfig, SimResult, simulate, staleness_mean

#: name -> (seconds per inner step per worker, speed changes, leave/rejoin)
PROFILES: dict[str, dict] = {
    "homogeneous": {"speeds": (1.0, 1.0, 1.0, 1.0)},
    "uneven": {"speeds": (0.58, 0.75, 1.51, 3.33)},  # the authors' notebook
    "straggler": {"speeds": (1.0, 1.0, 1.0, 10.0)},
    "changing": {"speeds": (0.58, 0.75, 1.51, 3.33), "changes": ((100.0, 0, 3.33), (100.0, 3, 0.58))},
    "leave_rejoin": {"speeds": (1.0, 1.0, 1.0, 1.0), "leave_rejoin": (3, 60.0, 200.0)},
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class SuiteConfig:
    profiles: tuple[str, ...]
    methods: tuple[str, ...] = METHODS
    seeds: tuple[int, ...] = (0, 1, 2)
    total_steps: int = 800
    local_steps: int = 20
    eval_every_steps: int = 100
    #: Target loss = sync DiLoCo's final loss × (1 + target_margin).
    target_margin: float = 0.02
    #: Grace window of the DN methods, virtual seconds (Liu et al. 2024, Alg. 2; without
    #: it DN does not reduce to synchronous DiLoCo even on equal speeds).
    grace_s: float = 0.5
    #: The model and data every run trains (small, so the quick suite fits in minutes).
    job: JobConfig = dataclasses.field(default_factory=lambda: JobConfig(n_layer=1, n_embd=64, context_len=32, batch_size=16))

    def __post_init__(self) -> None:
        unknown = [p for p in self.profiles if p not in PROFILES]
        if unknown:
            raise ConfigError(f"profiles {unknown} are unknown: choose from {sorted(PROFILES)}")
        if len(self.seeds) < 1:
            raise ConfigError("give at least one seed (3 or more for mean ± std)")


SUITES = {
    "quick": SuiteConfig(profiles=("homogeneous", "uneven"), total_steps=600, eval_every_steps=100),
    "full": SuiteConfig(profiles=tuple(PROFILES), total_steps=2400, eval_every_steps=200),
}


def run_suite(cfg: SuiteConfig, out_dir: str, progress: bool = True) -> list[dict]:
    """Run every (profile, method, seed); write runs.jsonl, report.md and plots."""
    from tqdm import tqdm

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jsonl = out / "runs.jsonl"
    jsonl.unlink(missing_ok=True)
    runs = [(p, m, s) for p in cfg.profiles for m in cfg.methods for s in cfg.seeds]
    records = []
    with tqdm(total=len(runs) * cfg.total_steps, disable=not progress, unit="step", dynamic_ncols=True) as bar:
        for profile, method, seed in runs:
            prof = PROFILES[profile]
            sim_cfg = SimConfig(
                method=method, speeds_s_per_step=prof["speeds"], total_steps=cfg.total_steps,
                local_steps=cfg.local_steps, seed=seed, eval_every_steps=cfg.eval_every_steps,
                speed_changes=prof.get("changes", ()), leave_rejoin=prof.get("leave_rejoin"),
                grace_s=cfg.grace_s if method.startswith("async_dn") else 0.0, job=cfg.job,
            )  # fmt: skip
            bar.set_postfix_str(f"{profile} {method} seed {seed}")
            done = [0]

            def tick(steps: int) -> None:
                bar.update(steps - done[0])
                done[0] = steps

            started = time.monotonic()
            result = simulate(sim_cfg, progress=tick)
            bar.update(cfg.total_steps - done[0])
            rec = _record(profile, result, time.monotonic() - started)
            records.append(rec)
            with open(jsonl, "a") as f:
                f.write(json.dumps(rec) + "\n")
    _add_targets(records, cfg.target_margin)
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))
    (out / "report.md").write_text(report_markdown(records, cfg) + peer_section(cfg, out, progress))
    plot(records, out)
    return records


def peer_section(cfg: SuiteConfig, out: pathlib.Path, progress: bool = True) -> str:
    """The torchft row (PEERS.md): its synchronous DiLoCo on the same model, data order,
    H and token budget, 4 replicas at full speed; or why it was skipped."""
    from asyncdiloco.peer_torchft import run_peer, torchft_available

    head = "## Peer: torchft synchronous DiLoCo (4 replicas, equal speeds, same model, data, H and tokens)\n\n"
    if not torchft_available():
        return head + ("torchft is not installed, so this row was skipped: `pip install 'asyncdiloco[peer]'` "
                       "(after torch) adds it.\n")  # fmt: skip
    if progress:
        print("peer: torchft DiLoCo", flush=True)
    job = cfg.job
    try:
        r = run_peer(replicas=4, steps=cfg.total_steps // 4, local_steps=cfg.local_steps, out_dir=str(out / "peer"),
                     n_layer=job.n_layer, n_embd=job.n_embd, context_len=job.context_len, batch_size=job.batch_size)
    except RuntimeError as exc:  # fmt: skip
        return head + f"torchft run failed: {exc}\n"
    (out / "peer.json").write_text(json.dumps(r) + "\n")
    return head + (
        f"| peer | final loss | median round (s) | outer steps | wall (s) |\n|---|---|---|---|---|\n"
        f"| {r['peer']} | {r['final_eval_loss']:.3f} | {r['median_round_s']:.3f} | {r['outer_steps']} | "
        f"{r['wall_s']:.1f} |\n\nCompare with sync_diloco on the homogeneous profile above (seed 0 here).\n"
    )


def _record(profile: str, r: SimResult, real_s: float) -> dict:
    c = r.config
    return {
        "clock": "virtual",
        "profile": profile,
        "method": c.method,
        "seed": c.seed,
        "workers": len(c.speeds_s_per_step),
        "speeds_s_per_step": list(c.speeds_s_per_step),
        "local_steps": c.local_steps,
        "total_steps": c.total_steps,
        "tokens": c.total_steps * c.job.tokens_per_step,
        "final_eval_loss": r.final_eval_loss,
        "virtual_wall_s": r.wall_s,
        "utilisation": r.utilisation,
        "updates": r.updates,
        "staleness_histogram": r.staleness_histogram,
        "mean_staleness": staleness_mean(r.staleness_histogram),
        "bytes_up": r.bytes_up,
        "bytes_down": r.bytes_down,
        "curve": r.curve,
        "real_s": real_s,
    }


def _add_targets(records: list[dict], margin: float) -> None:
    """Target per profile = mean final loss of sync DiLoCo × (1 + margin); time to it."""
    for profile in {r["profile"] for r in records}:
        ref = [r["final_eval_loss"] for r in records if r["profile"] == profile and r["method"] == "sync_diloco"]
        target = statistics.mean(ref) * (1 + margin) if ref else math.nan
        for r in records:
            if r["profile"] == profile:
                r["target_loss"] = target
                r["time_to_target_s"] = next((p["time_s"] for p in r["curve"] if p["eval_loss"] <= target), None)


def _mean_std(xs: list[float]) -> tuple[float, float]:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return math.nan, math.nan
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def _fmt(ms: tuple[float, float], digits: int = 3) -> str:
    m, s = ms
    return "—" if math.isnan(m) else f"{m:.{digits}f} ± {s:.{digits}f}"


def summarize(records: list[dict]) -> dict[tuple[str, str], dict]:
    """(profile, method) -> mean/std of the metrics over seeds."""
    out = {}
    for key in sorted({(r["profile"], r["method"]) for r in records}):
        rs = [r for r in records if (r["profile"], r["method"]) == key]
        reached = [r["time_to_target_s"] for r in rs if r["time_to_target_s"] is not None]
        out[key] = {
            "loss": _mean_std([r["final_eval_loss"] for r in rs]),
            "wall": _mean_std([r["virtual_wall_s"] for r in rs]),
            "ttt": _mean_std(reached) if len(reached) == len(rs) else (math.nan, math.nan),
            "reached": f"{len(reached)}/{len(rs)}",
            "util": _mean_std([r["utilisation"] for r in rs]),
            "updates": _mean_std([r["updates"] for r in rs]),
            "staleness": _mean_std([r["mean_staleness"] for r in rs]),
            "bytes": _mean_std([r["bytes_up"] + r["bytes_down"] for r in rs]),
            "seeds": len(rs),
        }
    return out


def claims(summary: dict) -> list[str]:
    """The three claims of the issue, each shown or honestly not shown by the numbers."""
    lines = []

    def loss(p, m):
        return summary.get((p, m), {}).get("loss", (math.nan, math.nan))[0]

    def ttt(p, m):
        return summary.get((p, m), {}).get("ttt", (math.nan, math.nan))[0]

    for p in sorted({k[0] for k in summary}):
        d, l = loss(p, "sync_diloco"), loss(p, "sync_localsgd")
        if not math.isnan(d) and not math.isnan(l):
            noise = max(summary[(p, "sync_diloco")]["loss"][1], summary[(p, "sync_localsgd")]["loss"][1])
            verdict = "shown" if l - d > noise else ("NOT shown (the gap is within the seeds' std)" if d < l else "NOT shown")
            lines.append(f"- (a) [{p}] sync DiLoCo {d:.3f} vs sync LocalSGD {l:.3f} at equal steps: "
                         f"{verdict} ({(l - d) / l * 100:+.1f}%).")  # fmt: skip
        n = loss(p, "async_nesterov")
        if not math.isnan(n) and not math.isnan(d):
            lines.append(f"- (b) [{p}] naive async Nesterov {n:.3f} vs sync DiLoCo {d:.3f}: "
                         f"{'shown' if n > d * 1.02 else 'NOT shown'} (clearly worse = more than 2% higher).")  # fmt: skip
        x = loss(p, "async_dn_dylu")
        if not math.isnan(x) and not math.isnan(d):
            gap = (x - d) / d * 100
            t_sync, t_x = ttt(p, "sync_diloco"), ttt(p, "async_dn_dylu")
            speed = t_sync / t_x if t_x and not math.isnan(t_x) and not math.isnan(t_sync) else math.nan
            reach = (f"reaches the target in {t_x:.0f} s vs {t_sync:.0f} s (speed-up {speed:.2f}×)"
                     if not math.isnan(speed) else "does not reach the target on every seed")  # fmt: skip
            lines.append(
                f"- (c) [{p}] async DN+DyLU {x:.3f} vs sync DiLoCo {d:.3f} ({gap:+.1f}%; within ~1%: "
                f"{'yes' if gap <= 1.0 else 'no'}); it {reach}."
            )
    return lines


def report_markdown(records: list[dict], cfg: SuiteConfig) -> str:
    summary = summarize(records)
    seeds = len(cfg.seeds)
    lines = [
        "# Sync vs async DiLoCo — benchmark report (virtual clock)",
        "",
        f"Methods run on the same model, data, token budget ({cfg.total_steps} inner steps summed over workers) and "
        f"seeds {list(cfg.seeds)}; H = {cfg.local_steps}; mean ± std over {seeds} seeds. Time is virtual seconds "
        f"(workers scheduled by their seconds per step). Target loss = sync DiLoCo's final loss + "
        f"{cfg.target_margin * 100:.0f}%.",
        "",
    ]
    for profile in cfg.profiles:
        prof = PROFILES[profile]
        lines += [f"## {profile}: seconds/step {list(prof['speeds'])}"
                  + (f", speed changes {list(prof['changes'])}" if "changes" in prof else "")
                  + (f", worker {prof['leave_rejoin'][0]} away {prof['leave_rejoin'][1]:g}–{prof['leave_rejoin'][2]:g} s"
                     if "leave_rejoin" in prof else ""), "",
                  "| method | final loss | time to target (s) | reached | wall (s) | utilisation | updates | mean staleness | MB moved |",
                  "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for method in cfg.methods:
            s = summary.get((profile, method))
            if s is None:
                continue
            mb = (s["bytes"][0] / 1e6, s["bytes"][1] / 1e6)
            lines.append(
                f"| {method} | {_fmt(s['loss'])} | {_fmt(s['ttt'], 0)} | {s['reached']} | {_fmt(s['wall'], 0)} | "
                f"{_fmt(s['util'], 2)} | {_fmt(s['updates'], 0)} | {_fmt(s['staleness'], 2)} | {_fmt(mb, 1)} |"
            )
        lines.append("")
    lines += ["## Claims (Liu et al. 2024, Table 1)", "", *claims(summary), "",
              "Plots: loss_vs_tokens.png, loss_vs_time.png, utilisation.png, staleness.png. Raw runs: runs.jsonl.", ""]  # fmt: skip
    return "\n".join(lines)


def plot(records: list[dict], out: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profiles = sorted({r["profile"] for r in records})
    methods = [m for m in METHODS if any(r["method"] == m for r in records)]
    for key, xlabel, name in (("tokens", "tokens (characters)", "loss_vs_tokens.png"),
                              ("time_s", "virtual time (s)", "loss_vs_time.png")):  # fmt: skip
        fig, axes = plt.subplots(1, len(profiles), figsize=(5 * len(profiles), 4), squeeze=False)
        for ax, p in zip(axes[0], profiles):
            lowest = math.inf
            for m in methods:
                rs = [r for r in records if r["profile"] == p and r["method"] == m]
                xs = [pt[key] for pt in rs[0]["curve"]]
                ys = [statistics.mean(r["curve"][i]["eval_loss"] for r in rs if i < len(r["curve"])) for i in range(len(xs))]
                ax.plot(xs, ys, marker=".", label=m)
                lowest = min([lowest, *(y for y in ys if math.isfinite(y))])
            ax.set_title(p)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("held-out loss (nats/char)")
            ax.set_ylim(max(0.0, lowest - 0.2), 5.0)  # diverged runs leave the top of the plot
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=90)
        plt.close(fig)
    summary = summarize(records)
    for metric, label, name in (("util", "utilisation (busy ÷ wall)", "utilisation.png"),
                                ("staleness", "mean staleness (versions)", "staleness.png")):  # fmt: skip
        fig, ax = plt.subplots(figsize=(8, 4))
        width = 0.8 / max(1, len(profiles))
        for j, p in enumerate(profiles):
            vals = [summary[(p, m)][metric][0] for m in methods]
            ax.bar([i + j * width for i in range(len(methods))], vals, width, label=p)
        ax.set_xticks([i + width * (len(profiles) - 1) / 2 for i in range(len(methods))], methods, rotation=20, fontsize=8)
        ax.set_ylabel(label)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / name, dpi=90)
        plt.close(fig)
