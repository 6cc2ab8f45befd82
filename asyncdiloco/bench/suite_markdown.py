"""The sync-vs-async suite's report.md, claims.json, tuning.json and plots, from the
numbers suite_report.py computes (either clock)."""

from __future__ import annotations

import json
import math
import pathlib
from typing import TYPE_CHECKING

from asyncdiloco.bench.plots import plot_suite
from asyncdiloco.bench.sim import METHODS
from asyncdiloco.bench.suite_report import (
    CLAIM_C_MAX_GAP,
    CLAIM_C_MIN_SPEEDUP,
    CLAIM_C_PROFILES,
    CLAIM_RULE,
    DEFAULT_METHOD,
    LOCALSGD,
    NAIVE_ASYNC,
    STANDARD,
    STRONGEST_MAX_GAP,
    STRONGEST_MIN_SPEEDUP,
    STRONGEST_PROFILES,
    claims_json,
    summarize,
)

if TYPE_CHECKING:
    from asyncdiloco.bench.suite_config import SuiteConfig


def _pct(x: float | None, sign: str = "+") -> str:
    if x is None:
        return "—"
    return f"{'+' if x > 0 else '-'}inf (diverged)" if math.isinf(x) else f"{x * 100:{sign}.2f}%"


def _gap_text(v: dict, key: str = "value") -> str:
    if v.get("diverged"):
        return "diverged"
    return f"{_pct(v[key])} (spread {_pct(v['spread'], '')})"


def _fmt(ms: tuple[float, float], digits: int = 3) -> str:
    m, s = ms
    return "—" if math.isnan(m) else f"{m:.{digits}f} ± {s:.{digits}f}"


def _loss(x: float | None) -> str:
    return "—" if x is None else f"{x:.3f}"


def _x(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}×"


def _verdict(ok: bool) -> str:
    return "**shown**" if ok else "**NOT shown**"


def claim_lines(summary: dict[str, dict]) -> list[str]:
    """The claims as report lines, each shown or not by the numbers and the rule."""
    lines = []
    for p, c in claims_json(summary).items():
        if "a" in c:
            a = c["a"]
            lines.append(
                f"- (a) [{p}] sync DiLoCo {a[STANDARD]:.3f} vs sync LocalSGD {a[LOCALSGD]:.3f}: gain "
                f"{_gap_text(a)} (target {a['target']}): {_verdict(a['shown'])}."
            )
        if "b" in c:
            b = c["b"]
            lines.append(
                f"- (b) [{p}] naive async Nesterov {b[NAIVE_ASYNC]:.3f} vs sync DiLoCo: {_gap_text(b)} "
                f"(target {b['target']}): {_verdict(b['shown'])}."
            )
        for key, label in (("c", "(c)"), ("strongest", "strongest")):
            if key in c:
                v = c[key]
                sp = (
                    f"reached its final loss on {v['reached']} seeds"
                    if v["speedup"] is None
                    else f"{_x(v['speedup'])} sooner to its final loss (pessimistic {_x(v['speedup_low'])})"
                )
                where = " (a target of issue 25 on this profile)" if v["applies"] else ""
                lines.append(
                    f"- {label} [{p}] {DEFAULT_METHOD} {v[DEFAULT_METHOD]:.3f} vs `{v['baseline']}` "
                    f"{v[v['baseline']]:.3f}: {_gap_text(v, 'loss_gap')}; {sp}; wall ratio at "
                    f"equal tokens {_x(v['wall_ratio'])} (target {v['target']}): {_verdict(v['shown'])}{where}."
                )
        if "utilisation" in c:
            u = c["utilisation"]
            lines.append(
                f"- utilisation [{p}] of {DEFAULT_METHOD}: {u['value']:.3f} (target {u['target']}): "
                f"{_verdict(u['shown'])}."
            )
        for m, y in c.get("beyond", {}).items():
            lines.append(
                f"- beyond the paper [{p}] {m} {y[m]:.3f}: {_gap_text(y)} vs {DEFAULT_METHOD}, "
                f"speed-up to its final loss {_x(y['speedup'])}, wall ratio {_x(y['wall_ratio'])}, loss at T "
                f"{_loss(y['loss_at_equal_wall'])} vs {_loss(y[DEFAULT_METHOD + '_at_equal_wall'])}: "
                f"{'beats it' if y['shown'] else 'does not beat it by more than twice the spread'}."
            )
    return lines


def target_lines(summary: dict[str, dict]) -> list[str]:
    """The issue's targets, one line each: met or not, on which profiles."""
    cj = claims_json(summary)
    lines = []
    for key, profiles, what in (
        (
            "c",
            CLAIM_C_PROFILES,
            f"(c) within {CLAIM_C_MAX_GAP:.0%} of tuned sync DiLoCo, ≥ {CLAIM_C_MIN_SPEEDUP}× sooner",
        ),
        (
            "strongest",
            STRONGEST_PROFILES,
            f"strongest: within {STRONGEST_MAX_GAP:.0%} of the best sync method, ≥ {STRONGEST_MIN_SPEEDUP}× sooner",
        ),
    ):
        for p in profiles:
            v = cj.get(p, {}).get(key)
            state = "not run" if v is None else ("met" if v["shown"] else "**not met**")
            lines.append(f"- {what} on {p}: {state}.")
    wins = [(p, m) for p, c in cj.items() for m, y in c.get("beyond", {}).items() if y["shown"]]
    if wins:
        lines.append("- beyond the paper beats the default on: " + ", ".join(f"{p} ({m})" for p, m in wins) + ".")
    elif any("beyond" in c for c in cj.values()):
        gaps = "; ".join(
            f"{m} on {p}: {_pct(y['value'])} (2·spread {_pct(None if y['spread'] is None else 2 * y['spread'], '')})"
            for p, c in cj.items()
            for m, y in c.get("beyond", {}).items()
        )
        lines.append(
            "- beyond the paper: **no method beyond the paper beat the default by more than twice the seed spread "
            f"on any profile** ({gaps})."
        )
    return lines


def tuning_markdown(tuning: dict) -> list[str]:
    """The tuning stage's section: the grid, every cell's final loss, each method's pick."""
    cells = [(lr, mom) for lr in tuning["lrs"] for mom in tuning["momenta"]]
    lines = [
        "## Tuning the outer step",
        "",
        f"Every tuned method ran each (η, μ) of the grid η ∈ {tuning['lrs']} × μ ∈ {tuning['momenta']} on the "
        f"`{tuning['profile']}` profile, seed {tuning['seed']} (not an evaluation seed), with the evaluation's "
        "budget; its pick is the cell of lowest final loss (ties: the earlier cell). The evaluation then runs "
        "each tuned method with its pick on every profile and seed.",
        "",
        "| method | " + " | ".join(f"η {lr:g}, μ {mom:g}" for lr, mom in cells) + " | pick | method's own |",
        "|---|" + "---|" * (len(cells) + 2),
    ]
    for method, losses in tuning["cells"].items():
        pick = tuple(tuning["picks"][method])
        own = tuning["own"].get(method)
        row = []
        for cell in cells:
            loss = losses.get(f"{cell[0]:g},{cell[1]:g}")  # suite.py's key of a cell
            text = "—" if loss is None else f"{loss:.4f}"
            row.append(f"**{text}**" if cell == pick else text)
        own_text = "—" if own is None else f"η {own[0]:g}, μ {own[1]:g}"
        lines.append(f"| {method} | " + " | ".join(row) + f" | η {pick[0]:g}, μ {pick[1]:g} | {own_text} |")
    lines.append("")
    for method, pick in tuning["picks"].items():
        own = tuning["own"].get(method)
        if method == DEFAULT_METHOD and own is not None and tuple(pick) != tuple(own):
            lines += [
                f"**The default's pick (η {pick[0]:g}, μ {pick[1]:g}) is not the server's default outer step "
                f"(η {own[0]:g}, μ {own[1]:g})**: the `{DEFAULT_METHOD}` rows below run the pick, which "
                "`asyncdiloco server` runs only with `--outer-lr`/`--outer-momentum` until its default is changed.",
                "",
            ]
    return lines


def _profile_heading(profile: str, records: list[dict]) -> str:
    from asyncdiloco.bench.profiles import PROFILES

    if profile in PROFILES:
        return f"## {profile}: {PROFILES[profile].describe()}"
    r = next(r for r in records if r["profile"] == profile)
    return f"## {profile}: {r['workers']} workers, seconds/step {r['speeds_s_per_step']}"


def _row_doc(name: str, s: dict) -> str:
    spec = METHODS.get(s["sim_method"])
    doc = spec.doc if spec is not None else ""
    if s["outer"] is not None and s["sim_method"] != LOCALSGD:
        how = "tuned" if s["tuned"] else "its own"
        doc += f" (outer η {s['outer'][0]:g}, μ {s['outer'][1]:g}: {how})"
    return f"`{name}`: {doc}"


def report_markdown(records: list[dict], cfg: SuiteConfig, clock: str = "virtual", tuning: dict | None = None) -> str:
    """The suite's report.md: setup and definitions, the tuning grid, two tables per
    profile (loss and time; what it cost), the claims and the issue's targets."""
    summary = summarize(records)
    time_is = (
        "virtual seconds (workers scheduled by their seconds per step)"
        if clock == "virtual"
        else "real seconds of training (server and worker processes on 127.0.0.1; speeds emulated by per-step "
        "delays relative to the fastest worker)"
    )
    split = clock == "virtual" and getattr(cfg, "final_on_split", False)
    held_out = (
        f"the final model on the whole validation split ({_split_chars(cfg)} characters), the curve every "
        f"{cfg.eval_every_steps} inner steps on {cfg.job.eval_batches * cfg.job.tokens_per_step:,} fixed characters "
        "drawn from it"
        if split
        else f"{cfg.job.eval_batches * cfg.job.tokens_per_step:,} fixed held-out characters"
    )
    lines = [
        f"# Sync vs async DiLoCo — benchmark report ({clock} clock)",
        "",
        f"Every row trains the same model and data to the same token budget ({cfg.total_steps} inner steps summed "
        f"over workers, exactly: the round that would exceed it is cut to what remains), seeds {list(cfg.seeds)}, "
        f"H = {cfg.local_steps}; mean ± std over the seeds. Held-out loss (nats/char): {held_out}. "
        f"Time is {time_is}.",
        "",
        "Columns: **final loss** at equal tokens; **loss at T**: each row's curve at T, the earliest time by which "
        "some row has finished its budget on every seed (its last evaluation at or before T); **time to X's final "
        "loss**: the first evaluation at or below X's mean final curve loss (no margin), mean over seeds, '—' "
        "unless every seed gets there, with the **speed-up** = X's own time to its final loss ÷ that time; "
        "**wall ratio** = the baseline's wall ÷ the row's wall at equal tokens. **outer steps**: momentum updates "
        "(sync rounds, completed Delayed Nesterov groups); **MB moved**: the bytes the links were charged for; "
        "**comm**: seconds in transfers, summed over workers; **true τ**: outer steps between the model a push "
        "started from and its apply; group sizes: pushes per outer step (sync: members per round).",
        "",
        CLAIM_RULE,
        "",
    ]
    if tuning:
        lines += tuning_markdown(tuning)
    for profile, p in summary.items():
        lines += _profile_tables(profile, p, records)
    lines += [
        "Histograms are summed over the seeds: true τ `[n(τ=0), n(τ=1), …]`; group sizes `[n(1 push), n(2), …]`. "
        "The arrival counter is the server's in-group τ (the k-th push of a group counts k − 1), not versions.",
        "",
        "## Claims",
        "",
        "(a), (b): Liu et al. 2024 (arXiv 2401.09135), Table 1, against sync DiLoCo with its paper's η 0.7, μ 0.9. "
        "(c): the default against tuned sync DiLoCo. strongest: the default against the best-tuned synchronous "
        "row. beyond: each method beyond the paper against the default.",
        "",
        *claim_lines(summary),
        "",
        "## Targets (issue 25)",
        "",
        *target_lines(summary),
        "",
        "Machine-readable: claims.json" + (", tuning.json" if tuning else "") + ". Plots: loss_vs_tokens.png, "
        "loss_vs_time.png, utilisation.png, staleness.png. Raw runs: runs.jsonl.",
        "",
    ]
    return "\n".join(lines)


def _profile_tables(profile: str, p: dict, records: list[dict]) -> list[str]:
    """One profile's two tables: loss and time against the baselines; what it cost."""
    rows = p["rows"]
    bases = [b for b in dict.fromkeys((p["baseline_c"], p["strongest"])) if b is not None]
    lines = [
        _profile_heading(profile, records),
        "",
        "Rows: " + "; ".join(_row_doc(n, s) for n, s in rows.items()) + ".",
        "",
        f"T = {p['equal_wall_s']:.0f} s. Baselines: claim (c) `{p['baseline_c'] or 'not run'}`; strongest "
        f"synchronous `{p['strongest'] or 'not run'}`"
        + ("" if p["strongest_tuned"] or p["strongest"] is None else " (no sync row was tuned)")
        + ".",
        "",
        "| row | final loss | loss at T | "
        + " | ".join(f"time to {b}'s final loss (s) | speed-up" for b in bases)
        + " | wall (s) | "
        + " | ".join(f"wall ratio vs {b}" for b in bases)
        + " |",
        "|---|---|---|" + "---|---|" * len(bases) + "---|" + "---|" * len(bases),
    ]
    for name, s in rows.items():
        cells = [name if not s["diverged"] else f"{name} (diverged {s['diverged']}/{s['seeds']})"]
        cells += [_fmt(s["loss"]), _fmt(s["loss_at_equal_wall"])]
        for b in bases:
            v = s["vs"][b]
            t = _fmt(v["time"], 0) if v["speedup"] is not None else f"never on {_unreached(v['reached'])}"
            cells += [t, _x(v["speedup"])]
        cells.append(_fmt(s["wall"], 0))
        cells += [_x(s["vs"][b]["wall_ratio"]) for b in bases]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "| row | outer steps | MB moved | comm (s) | utilisation | true τ (mean) | true τ histogram | "
        "group sizes | arrival counter τ (mean) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in rows.items():
        mb = (s["bytes"][0] / 1e6, s["bytes"][1] / 1e6)
        lines.append(
            f"| {name} | {_fmt(s['outer_steps'], 0)} | {_fmt(mb, 1)} | {_fmt(s['comm_s'], 1)} | "
            f"{_fmt(s['util'], 2)} | {_fmt(s['true_staleness'], 2)} | {s['true_staleness_hist'] or '—'} | "
            f"{s['group_hist'] or '—'} | {_fmt(s['staleness'], 2)} |"
        )
    lines.append("")
    return lines


def _unreached(reached: str) -> str:
    k, n = (int(x) for x in reached.split("/"))
    return f"{n - k}/{n} seeds"


def _split_chars(cfg: SuiteConfig) -> str:
    from asyncdiloco.job.dataset import CharCorpus

    return f"{sum(y.numel() for _, y in cfg.job.split_set(CharCorpus.default())):,}"


def write_outputs(
    records: list[dict], cfg: SuiteConfig, out: pathlib.Path, clock: str, extra: str = "", tuning: dict | None = None
) -> None:
    """runs.jsonl, report.md, claims.json (and tuning.json) and the plots of a finished suite."""
    (out / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = summarize(records)
    (out / "claims.json").write_text(json.dumps(claims_json(summary), indent=2) + "\n")
    if tuning:
        (out / "tuning.json").write_text(json.dumps(tuning, indent=2) + "\n")
    (out / "report.md").write_text(report_markdown(records, cfg, clock, tuning) + extra)
    plot_suite(records, summarize(records), out)
