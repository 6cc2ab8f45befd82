"""matplotlib, loaded only when a plot is drawn: it comes with the ``bench`` extra
(``pip install 'asyncdiloco[bench]'``), so a core install runs every benchmark and the
demo and writes their reports, only without the figures."""

from __future__ import annotations

import logging
import math
import pathlib
import statistics
from typing import Any

log = logging.getLogger(__name__)


def pyplot() -> Any | None:
    """``matplotlib.pyplot`` on the non-interactive Agg backend, or None (with one warning
    naming the fix) when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        log.warning("plots skipped: matplotlib is not installed (pip install 'asyncdiloco[bench]')")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_scale(sim: dict, applies: list[dict], path: pathlib.Path) -> bool:
    """The scale suite's figure (bench/scale_report.py): pushes/s demanded against what one
    shard applies, staleness, group and Delayed Nesterov buffer sizes, DyLU's H_w over time,
    the live workers, and the global model's loss. False when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return False
    cfg = sim["config"]
    dt = cfg["sample_every_s"]
    samples = sim["samples"]
    ts = [s["t_s"] for s in samples]
    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    ax = axes[0][0]
    ax.plot(
        [k * dt for k in range(len(sim["pushes_per_bin"]))], [n / dt for n in sim["pushes_per_bin"]], label="demanded"
    )
    ax.plot(ts, [s["unthrottled_pushes_per_s"] for s in samples], "--", label="if no reply were held")
    for a in applies:
        if a["registered"] == cfg["workers"]:
            ax.axhline(a["sustained_pushes_per_s"], color="grey", lw=0.8, ls=":")
            ax.annotate(f"1 shard, {a['numel']:,} params", (0, a["sustained_pushes_per_s"]), fontsize=7, va="bottom")
    ax.set_yscale("log")
    ax.set(xlabel="virtual time (s)", ylabel="pushes/s", title="pushes/s demanded vs one shard")
    ax.legend(fontsize=8)
    ax = axes[0][1]
    hist = sim["staleness_histogram"]
    ax.bar(range(len(hist)), hist, width=1.0)
    ax.axvline(sim["staleness"]["max_staleness"], color="red", lw=0.8, ls="--", label="max_staleness")
    ax.set(xlabel="staleness τ (versions)", ylabel="pushes", title="staleness")
    ax.legend(fontsize=8)
    ax = axes[0][2]
    groups, dn = sim["group_size_histogram"], sim["dn_buffer_histogram"]
    ax.bar(range(1, len(groups) + 1), groups, width=1.0, label="push groups released", alpha=0.7)
    ax.bar(range(1, len(dn) + 1), dn, width=1.0, label="DN momentum updates (buffer size)", alpha=0.7)
    ax.set(xlabel="pushes", ylabel="count", title="group sizes / Delayed Nesterov buffers")
    ax.legend(fontsize=8)
    ax = axes[1][0]
    hw = [(s["t_s"], s["h_w"]) for s in samples if s["h_w"]]
    if hw:
        t = [x for x, _ in hw]
        ax.fill_between(t, [h[1] for _, h in hw], [h[3] for _, h in hw], alpha=0.3, label="p10–p90")
        ax.plot(t, [h[2] for _, h in hw], label="median")
        ax.plot(t, [h[0] for _, h in hw], ":", label="min")
        ax.plot(t, [h[4] for _, h in hw], ":", label="max")
    ax.set(xlabel="virtual time (s)", ylabel="H_w (inner steps)", title="DyLU's H_w over the live workers")
    ax.legend(fontsize=8)
    ax = axes[1][1]
    ax.plot(ts, [s["alive"] for s in samples], label="alive")
    ax.plot(ts, [s["registered_live"] for s in samples], label="lease current")
    ax.plot(ts, [s["expected"] for s in samples], label="expected by a group")
    ax.set(xlabel="virtual time (s)", ylabel="workers", title="churn")
    ax.legend(fontsize=8)
    ax = axes[1][2]
    ax.plot(ts, [s["loss"] for s in samples])
    ax.set_yscale("log")
    ax.set(xlabel="virtual time (s)", ylabel="½ mean a (θ − θ*)²", title="global model's loss (noisy quadratic)")
    for a in axes.flat:
        a.grid(alpha=0.3)
    fig.suptitle(f"{cfg['workers']} workers, {cfg['speeds']}, seed {cfg['seed']}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def plot_suite(records: list[dict], summary: dict[str, dict], out: pathlib.Path) -> None:
    """The benchmark suite's figures (bench/suite_markdown.py): loss_vs_tokens.png and
    loss_vs_time.png (one panel per profile, the mean curve over seeds per row),
    utilisation.png and staleness.png (bars per row and profile; ``summary`` is
    suite_report.summarize's)."""
    plt = pyplot()
    if plt is None:
        return
    profiles = list(summary)
    rows = list(dict.fromkeys(r["method"] for r in records))
    for key, xlabel, name in (
        ("tokens", "tokens (characters)", "loss_vs_tokens.png"),
        ("time_s", "time (s)", "loss_vs_time.png"),
    ):
        fig, axes = plt.subplots(1, len(profiles), figsize=(5 * len(profiles), 4), squeeze=False)
        for ax, p in zip(axes[0], profiles):
            lowest = math.inf
            for m in rows:
                rs = [r for r in records if r["profile"] == p and r["method"] == m]
                if not rs:
                    continue
                n = min(len(r["curve"]) for r in rs)
                xs = [statistics.mean(r["curve"][i][key] for r in rs) for i in range(n)]
                ys = [statistics.mean(r["curve"][i]["eval_loss"] for r in rs) for i in range(n)]
                ax.plot(xs, ys, marker=".", markersize=3, label=m)
                lowest = min([lowest, *(y for y in ys if math.isfinite(y))])
            ax.set_title(p)
            ax.set(xlabel=xlabel, ylabel="held-out loss (nats/char)")
            ax.set_ylim(max(0.0, lowest - 0.2), 5.0)  # diverged runs leave the top of the plot
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / name, dpi=90)
        plt.close(fig)
    for metric, label, name in (
        ("util", "utilisation (busy ÷ wall)", "utilisation.png"),
        ("true_staleness", "mean true staleness (versions)", "staleness.png"),
    ):
        fig, ax = plt.subplots(figsize=(max(8, len(rows)), 4))
        width = 0.8 / max(1, len(profiles))
        for j, p in enumerate(profiles):
            vals = []
            for m in rows:
                s = summary[p]["rows"].get(m)
                v = math.nan if s is None else s[metric][0]
                if metric == "true_staleness" and s is not None and math.isnan(v):
                    v = s["staleness"][0]  # records without the true staleness: the arrival counter
                vals.append(0.0 if math.isnan(v) else v)
            ax.bar([i + j * width for i in range(len(rows))], vals, width, label=p)
        ax.set_xticks([i + width * (len(profiles) - 1) / 2 for i in range(len(rows))], rows, rotation=20, fontsize=8)
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=90)
        plt.close(fig)
