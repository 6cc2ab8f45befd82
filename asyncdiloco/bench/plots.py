"""matplotlib, loaded only when a plot is drawn: it comes with the ``bench`` extra
(``pip install 'asyncdiloco[bench]'``), so a core install runs every benchmark and the
demo and writes their reports, only without the figures."""

from __future__ import annotations

import logging
import pathlib
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
    ax.set_xlabel("virtual time (s)")
    ax.set_ylabel("pushes/s")
    ax.set_title("pushes/s demanded vs one shard")
    ax.legend(fontsize=8)
    ax = axes[0][1]
    hist = sim["staleness_histogram"]
    ax.bar(range(len(hist)), hist, width=1.0)
    ax.axvline(sim["staleness"]["max_staleness"], color="red", lw=0.8, ls="--", label="max_staleness")
    ax.set_xlabel("staleness τ (versions)")
    ax.set_ylabel("pushes")
    ax.set_title("staleness")
    ax.legend(fontsize=8)
    ax = axes[0][2]
    groups, dn = sim["group_size_histogram"], sim["dn_buffer_histogram"]
    ax.bar(range(1, len(groups) + 1), groups, width=1.0, label="push groups released", alpha=0.7)
    ax.bar(range(1, len(dn) + 1), dn, width=1.0, label="DN momentum updates (buffer size)", alpha=0.7)
    ax.set_xlabel("pushes")
    ax.set_ylabel("count")
    ax.set_title("group sizes / Delayed Nesterov buffers")
    ax.legend(fontsize=8)
    ax = axes[1][0]
    hw = [(s["t_s"], s["h_w"]) for s in samples if s["h_w"]]
    if hw:
        t = [x for x, _ in hw]
        ax.fill_between(t, [h[1] for _, h in hw], [h[3] for _, h in hw], alpha=0.3, label="p10–p90")
        ax.plot(t, [h[2] for _, h in hw], label="median")
        ax.plot(t, [h[0] for _, h in hw], ":", label="min")
        ax.plot(t, [h[4] for _, h in hw], ":", label="max")
    ax.set_xlabel("virtual time (s)")
    ax.set_ylabel("H_w (inner steps)")
    ax.set_title("DyLU's H_w over the live workers")
    ax.legend(fontsize=8)
    ax = axes[1][1]
    ax.plot(ts, [s["alive"] for s in samples], label="alive")
    ax.plot(ts, [s["registered_live"] for s in samples], label="lease current")
    ax.plot(ts, [s["expected"] for s in samples], label="expected by a group")
    ax.set_xlabel("virtual time (s)")
    ax.set_ylabel("workers")
    ax.set_title("churn")
    ax.legend(fontsize=8)
    ax = axes[1][2]
    ax.plot(ts, [s["loss"] for s in samples])
    ax.set_yscale("log")
    ax.set_xlabel("virtual time (s)")
    ax.set_ylabel("½ mean a (θ − θ*)²")
    ax.set_title("global model's loss (noisy quadratic)")
    for a in axes.flat:
        a.grid(alpha=0.3)
    fig.suptitle(f"{cfg['workers']} workers, {cfg['speeds']}, seed {cfg['seed']}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True
