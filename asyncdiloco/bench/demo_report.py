"""The demo's report: report.json from the server's last status and each worker
process's stats file, the loss-curve plot, and the summary printed at the end (demo.py
runs the demo; the fields: docs/operations.md, "The demo"). A fleet on Ray (fleet/report.py) writes
the same report: ``report`` reads the run's settings and its workers through
``ReportedRun`` and ``ReportedWorker``, which the demo's ``DemoConfig`` and
``WorkerProcess`` and the fleet's own records both are."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import statistics
from typing import TYPE_CHECKING, Protocol

from asyncdiloco.bench.plots import pyplot
from asyncdiloco.job.dataset import CharCorpus
from asyncdiloco.wire._proto import parameter_server_pb2 as pb

if TYPE_CHECKING:
    from asyncdiloco.bench.demo import Outcome
    from asyncdiloco.job.config import JobConfig


class ReportedRun(Protocol):
    """What the report reads of the run's settings."""

    @property
    def mode(self) -> str: ...
    @property
    def worker_args(self) -> tuple[str, ...]: ...  # the flags every worker ran with
    @property
    def job(self) -> JobConfig: ...
    @property
    def max_seconds(self) -> float | None: ...  # training seconds per worker
    @property
    def leave_rejoin(self) -> tuple[int, float, float] | None: ...


class ReportedWorker(Protocol):
    """What the report reads of one worker process (its stats file is ``out/<stem>.json``)."""

    @property
    def index(self) -> int: ...
    @property
    def rejoin(self) -> bool: ...
    @property
    def name(self) -> str: ...
    @property
    def speed_factor(self) -> float: ...
    @property
    def left_s(self) -> float | None: ...
    @property
    def join_at_s(self) -> float | None: ...
    @property
    def stem(self) -> str: ...


def _run_config(rc: pb.RunConfig) -> dict:
    """What the server dictated (RunConfig): the outer step, H, DyLU and grouping."""
    fields = "mode outer_optimizer outer_lr outer_momentum local_steps dylu grouping".split()
    named = {k: getattr(rc, k) for k in fields}
    return {
        **named,
        "group_window_s": round(rc.group_window_s, 3),
        "group_max_wait_s": round(rc.group_max_wait_s, 3),
        "wire_codec": rc.wire_codec or "raw",
    }


def report(cfg: ReportedRun, out: pathlib.Path, o: Outcome) -> dict:
    """report.json: the run, the server's counters, one entry per worker process, the curve."""
    status = o.status
    seen = _server_view(status)
    per_worker = [_worker_entry(p, code, out, seen, o.train_start_unix_s) for p, code in zip(o.workers, o.exit_codes)]
    sync = cfg.mode == "sync"
    return {
        "mode": cfg.mode,
        "overlap": "--overlap" in cfg.worker_args,
        "rounds_committed": status.rounds_committed if sync else None,
        "rounds_failed": status.rounds_failed if sync else None,
        "round_time_s": _round_times([out / f"{p.stem}.json" for p in o.workers]) if sync else None,
        "server": o.address,
        "shard_addresses": list(o.shard_addresses),
        "initial_eval_loss": o.initial_loss,
        "final_eval_loss": o.final_loss,
        **_stop_fields(o.stop),
        "eval_loss_unit": "nats/char on the held-out split",
        "ln_vocab": math.log(CharCorpus.default().vocab_size),
        **_server_counters(status),
        "wall_s": o.wall_s,
        "tokens": sum(w["tokens"] for w in per_worker),
        "job": dataclasses.asdict(cfg.job),
        "max_seconds_per_worker": cfg.max_seconds,
        "leave_rejoin": list(cfg.leave_rejoin) if cfg.leave_rejoin is not None else None,
        "workers": per_worker,
        "eval_curve": o.curve,
        "train_start_s": o.train_start_s,  # when the global model existed: training time is wall_s − this
    }


def _stop_fields(stop: dict | None) -> dict:
    """How training ended: ``stop`` ("tokens": the budget was spent, "time": the cap
    passed, "workers": every worker exited first; None: not recorded), the bounds
    (``max_tokens``, ``max_seconds``), ``stop_train_s``, and ``stop_eval_loss`` with
    its ``stop_version`` and ``stop_tokens``: the global model evaluated when the workers
    were stopped, the last evaluation while training, before their closing pushes
    (``final_eval_loss`` is after them)."""
    stop = stop or {}
    return {
        "stop": stop.get("reason"),
        "max_tokens": stop.get("max_tokens"),
        "max_seconds": stop.get("max_seconds"),
        "stop_train_s": stop.get("train_s"),
        "stop_eval_loss": stop.get("eval_loss"),
        "stop_version": stop.get("version"),
        "stop_tokens": stop.get("tokens"),
    }


def _stop_text(report: dict) -> str:
    """The summary's line on how training ended (empty when the run did not record it)."""
    why = report.get("stop")
    if why is None:
        return ""
    cap = f"cap {report['max_seconds']:g} s"
    budget = f"budget {report['max_tokens']:,} tokens" if report.get("max_tokens") is not None else "no token budget"
    text = {
        "tokens": f"  stopped on tokens: {report.get('stop_tokens') or 0:,} applied (the {budget}) after "
        f"{report['stop_train_s']:.0f} s of training ({cap})\n",
        "time": f"  stopped on time: {report['stop_train_s']:.0f} s of training (the {cap}), "
        f"{report.get('stop_tokens') or 0:,} tokens applied ({budget})\n",
        "workers": f"  every worker exited before the {budget} and the {cap}\n",
    }[why]
    if report.get("stop_eval_loss") is not None:
        text += (
            f"  held-out loss at the stop {report['stop_eval_loss']:.3f} (version {report['stop_version']}), "
            f"after the closing pushes {report['final_eval_loss']:.3f} (version {report['version']})\n"
        )
    return text


def _server_counters(status: pb.StatusReply) -> dict:
    """The report's fields from the server's last status."""
    hist = list(status.staleness_histogram)
    while len(hist) > 1 and hist[-1] == 0:
        hist.pop()
    pushes = {k: getattr(status, k) for k in ("version", "applied_pushes", "rejected_pushes", "duplicate_pushes")}
    moved = {k: getattr(status, k) for k in ("bytes_pushed", "bytes_pulled", "pulls")}
    return {
        **pushes,
        "staleness_histogram": hist,
        **moved,
        "tokens_applied": status.tokens,
        "outer_optimizer": status.outer_optimizer,
        "staleness_weighting": status.staleness_weighting,
        "local_steps": status.run_config.local_steps,
        "run_config": _run_config(status.run_config),
        "group_size_histogram": list(status.group_size_histogram),
        "divergence_warnings": status.divergence_warnings,
        "num_parameters": sum(math.prod(t.shape) for t in status.manifest.tensors),
    }


def _server_view(status: pb.StatusReply) -> dict[str, dict]:
    """Per worker name, the server's counters, summed over a process's own rejoins (lapsed leases)."""
    view: dict[str, dict] = {}
    for w in status.workers:
        agg = view.setdefault(w.worker_name, {"pushes": 0, "tokens": 0, "worker_ids": []})
        agg["pushes"] += w.applied_pushes
        agg["tokens"] += w.tokens
        agg["worker_ids"].append(w.worker_id)
    return view


def _worker_entry(
    p: ReportedWorker,
    code: int | None,
    out: pathlib.Path,
    server_view: dict[str, dict],
    train_start_unix_s: float | None,
) -> dict:
    """One worker process in the report: its stats file (none if it crashed) and the server's view."""
    stats_path = out / f"{p.stem}.json"
    stats = json.loads(stats_path.read_text()) if stats_path.exists() else {}
    seen = server_view.get(p.name, {"pushes": 0, "tokens": 0, "worker_ids": []})
    began = stats.get("train_started_unix_s")
    staleness = stats.get("staleness")
    return {
        "index": p.index,
        "rejoin": p.rejoin,
        "name": p.name,
        "worker_ids": seen["worker_ids"],
        "speed_factor": p.speed_factor,
        "slowdown_changes": stats.get("slowdown_changes", ""),
        "exit_code": code,
        "train_started_s": round(began - train_start_unix_s, 3) if began and train_start_unix_s else None,
        "left_s": None if p.left_s is None else round(p.left_s, 3),
        "join_at_s": None if p.join_at_s is None else round(p.join_at_s, 3),
        "pushes": seen["pushes"],
        "tokens": stats.get("tokens", seen["tokens"]),  # a crashed worker wrote no stats file
        "inner_steps": stats.get("inner_steps", 0),
        "pushes_refused": stats.get("pushes_refused", 0),
        "sync_failures": stats.get("sync_failures", 0),
        "comm_s": round(stats.get("comm_s", 0.0), 3),
        "idle_s": round(stats.get("idle_s", stats.get("blocked_s", stats.get("comm_s", 0.0))), 3),
        "blocked_s": round(stats.get("blocked_s", 0.0), 3),
        "held_s": round(stats.get("held_s", 0.0), 3),
        # DyLU's inputs (async): seconds and count of the timed inner steps, the rate reported last, H_w
        "compute_s": round(stats.get("compute_s", 0.0), 3),
        "timed_steps": stats.get("timed_steps", 0),
        "steps_per_s": stats.get("steps_per_s", 0.0),
        "local_steps_per_round": stats.get("local_steps_per_round"),
        "blocked_fraction": round(stats["blocked_s"] / stats["wall_s"], 4) if stats.get("wall_s") else None,
        "mean_staleness": sum(staleness) / len(staleness) if staleness else None,
        "rounds_committed": stats.get("rounds_committed"),
        "rounds_failed": stats.get("rounds_failed"),
        "heals": stats.get("heals"),
    }


def _round_times(stats_paths: list[pathlib.Path]) -> dict | None:
    """Medians over the workers' round logs, seconds: wall time between two committed
    rounds (``round``), waiting for the quorum, collective plus upload, commit wait."""
    between, quorum, collective, commit = [], [], [], []
    for path in stats_paths:
        if not path.exists():
            continue
        rounds = json.loads(path.read_text()).get("rounds", [])
        ends = [r["end_s"] for r in rounds if r["committed"]]
        between += [b - a for a, b in zip(ends, ends[1:])]
        quorum += [r["quorum_wait_s"] for r in rounds]
        collective += [r["allreduce_s"] for r in rounds]
        commit += [r["commit_wait_s"] for r in rounds]
    if not between:
        return None
    med = lambda xs: round(statistics.median(xs), 4) if xs else None  # noqa: E731
    return {
        "round": med(between),
        "quorum_wait": med(quorum),
        "allreduce_and_upload": med(collective),
        "commit_wait": med(commit),
        "samples": len(between),
    }


def plot(
    curve: list[dict], path: pathlib.Path, vocab_size: int, mode: str = "async", title: str = "asyncdiloco demo"
) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((ax1, "wall_s", "wall time (s)"), (ax2, "tokens", "tokens applied (characters)")):
        ax.plot([c[key] for c in curve], [c["eval_loss"] for c in curve], marker="o", ms=3)
        ax.axhline(math.log(vocab_size), ls="--", c="gray", lw=0.8, label=f"ln(vocab) = {math.log(vocab_size):.2f}")
        ax.set(xlabel=label, ylabel="held-out loss (nats/char)")
        ax.grid(alpha=0.3)
        ax.legend()
    kind = "synchronous (quorum allreduce)" if mode == "sync" else "asynchronous"
    fig.suptitle(f"{title}: global model, {kind} DiLoCo")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def print_summary(report: dict, out: pathlib.Path, title: str = "asyncdiloco demo") -> None:
    hist = report["staleness_histogram"]
    stale = sum(hist[1:])
    print(
        f"\n{title}: {len(report['workers'])} worker{'s' if len(report['workers']) != 1 else ''}, "
        f"{report['wall_s']:.0f} s, {report['tokens']:,} tokens\n"
        f"  held-out loss {report['initial_eval_loss']:.3f} -> {report['final_eval_loss']:.3f} nats/char\n"
        + _stop_text(report)
        + f"  version {report['version']}: {report['applied_pushes']} pushes applied, "
        f"{report['rejected_pushes']} refused, "
        f"{stale} applied with staleness > 0 (histogram {hist})\n"
        f"  bytes pushed {report['bytes_pushed']:,}, pulled {report['bytes_pulled']:,}\n"
        + (
            f"  rounds committed {report['rounds_committed']}, aborted {report['rounds_failed']}; "
            f"median round times (s) {report['round_time_s']}\n"
            if report["mode"] == "sync"
            else ""
        )
        + "".join(
            f"  {w['name']}: {w['inner_steps']} steps, {w['pushes']} pushes, {w['tokens']:,} tokens, "
            f"idle {w['idle_s']:.1f} s\n"
            for w in report["workers"]
        )
        + f"  report: {out / 'report.json'}, plot: {out / 'loss_curve.png'}",
        flush=True,
    )
