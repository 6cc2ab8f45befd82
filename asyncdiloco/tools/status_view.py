"""The server's ``Status`` as a plain dict (``asyncdiloco status --json``; keys with their
units, ``last_seen_s``) and as a text table (``asyncdiloco status``); docs/operations.md,
"Status from the command line". The last bucket of the staleness histogram counts every
larger τ, so a ``max`` there is a lower bound (``max_is_lower_bound``).
"""

from __future__ import annotations

import math
from typing import Any

from asyncdiloco.ps.books import newest_eval
from asyncdiloco.wire._proto import parameter_server_pb2 as pb

#: A worker's states whose lease is over; the others are live.
GONE_STATES = ("left", "expired")


def staleness_summary(histogram: list[int]) -> dict[str, Any]:
    """Mean, median, 90th percentile and largest staleness τ (versions) of the applied
    pushes, from ``histogram[τ]`` (the last bucket counts every larger τ too). The
    percentiles are nearest-rank; every value is None before the first push."""
    total = sum(histogram)
    if total == 0:
        return {"pushes": 0, "mean": None, "p50": None, "p90": None, "max": None, "max_is_lower_bound": False}

    def percentile(q: float) -> int:
        rank, seen = math.ceil(q * total), 0
        for tau, count in enumerate(histogram):
            seen += count
            if seen >= rank:
                return tau
        return len(histogram) - 1

    largest = max(tau for tau, count in enumerate(histogram) if count)
    return {
        "pushes": total,
        "mean": sum(tau * count for tau, count in enumerate(histogram)) / total,
        "p50": percentile(0.5),
        "p90": percentile(0.9),
        "max": largest,
        "max_is_lower_bound": largest == len(histogram) - 1,
    }


#: The ``WorkerStatus`` fields a worker's entry repeats under their own names.
WORKER_FIELDS = (
    "state alive steps_per_s local_steps_per_round applied_pushes rejected_pushes tokens local_steps last_seen_s "
    "mean_staleness last_staleness"
).split()
#: The ``StatusReply`` counters the status repeats under their own names.
COUNTERS = (
    "pushes_per_s applied_pushes rejected_pushes duplicate_pushes pulls tokens bytes_pushed bytes_pulled "
    "divergence_warnings"
).split()


def worker_dict(w: pb.WorkerStatus) -> dict[str, Any]:
    named = {k: getattr(w, k) for k in WORKER_FIELDS}
    return {"name": w.worker_name, "id": w.worker_id, **named, "ranks": w.ranks or 1}


def _eval_dict(st: pb.StatusReply) -> dict[str, Any] | None:
    e = newest_eval(st.evals)
    if e is None:
        return None
    return {
        "version": e.version,
        "loss_nats_per_token": e.loss,
        "num_tokens": e.num_tokens,
        "evaluator": e.evaluator,
        "age_s": max(0.0, st.uptime_s - e.at_s),
    }


def status_dict(st: pb.StatusReply, *, address: str = "", all_workers: bool = False) -> dict[str, Any]:
    """The status as JSON-ready values: the run, its counters, the staleness summary, the
    newest held-out loss (of the highest version, ps/books.py ``newest_eval``; None
    without one) and one entry per live worker (``all_workers``:
    also those that left or expired)."""
    workers = [worker_dict(w) for w in st.workers if all_workers or (w.alive and w.state not in GONE_STATES)]
    out: dict[str, Any] = {
        "server": address,
        "server_version": st.server_version,
        "version": st.version,
        "mode": st.run_config.mode or "async",
        "initialized": st.initialized,
        "uptime_s": st.uptime_s,
        "outer_optimizer": st.outer_optimizer,
        "staleness_weighting": st.staleness_weighting,
        "run_config": {f.name: getattr(st.run_config, f.name) for f in st.run_config.DESCRIPTOR.fields},
        **{k: getattr(st, k) for k in COUNTERS},
        "staleness": staleness_summary(list(st.staleness_histogram)),
        "eval": _eval_dict(st),
        "live_workers": sum(1 for w in st.workers if w.alive and w.state not in GONE_STATES),
        "workers": workers,
    }
    if out["mode"] == "sync":
        out["rounds_committed"], out["rounds_failed"] = st.rounds_committed, st.rounds_failed
    return out


def _duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def _count(n: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:g}"


def _run_lines(d: dict[str, Any]) -> list[str]:
    """The version, throughput and outer settings; a sync run's in rounds and member
    contributions, with its local-steps rule (fixed H, or adaptive: each member's H_w in
    the H_W column) instead of the async-only settings (staleness, grouping, DyLU)."""
    rc = d["run_config"]
    counts = f"({d['rejected_pushes']} refused, {d['duplicate_pushes']} duplicate) | {_count(d['tokens'])} tokens"
    if d["mode"] == "sync":
        return [
            f"version {d['version']} | {d['rounds_committed']} rounds committed, {d['rounds_failed']} aborted "
            f"| {d['applied_pushes']} member contributions applied {counts}",
            f"outer {d['outer_optimizer']} | H {rc['local_steps']} "
            f"| local steps {rc.get('sync_local_steps') or 'fixed'} | codec {rc['wire_codec'] or 'raw'}",
        ]
    return [
        f"version {d['version']} | {d['pushes_per_s']:.2f} pushes/s | {d['applied_pushes']} pushes applied {counts}",
        f"outer {d['outer_optimizer']} | staleness weighting {d['staleness_weighting']} | H {rc['local_steps']} "
        f"| codec {rc['wire_codec'] or 'raw'} | grouping {rc['grouping'] or 'off'} "
        f"| dylu {'on' if rc['dylu'] else 'off'}",
    ]


def _header(d: dict[str, Any]) -> list[str]:
    where = f" at {d['server']}" if d["server"] else ""
    lines = [
        f"asyncdiloco server {d['server_version']}{where}: mode {d['mode']}, "
        f"up {_duration(d['uptime_s'])}" + ("" if d["initialized"] else ", no global model yet"),
        *_run_lines(d),
    ]
    tau = d["staleness"]
    if tau["pushes"] and d["mode"] != "sync":  # a sync round has no staleness: every τ is 0
        top = f">={tau['max']}" if tau["max_is_lower_bound"] else str(tau["max"])
        lines.append(f"staleness tau: mean {tau['mean']:.2f} | p50 {tau['p50']} | p90 {tau['p90']} | max {top}")
    ev = d["eval"]
    if ev is not None:
        by = f", by {ev['evaluator']}" if ev["evaluator"] else ""
        lines.append(
            f"held-out loss {ev['loss_nats_per_token']:.4f} nats/char at version {ev['version']} "
            f"({_duration(ev['age_s'])} ago{by})"
        )
    if d["divergence_warnings"]:
        lines.append(f"divergence warnings: {d['divergence_warnings']} (see the server's log)")
    return lines


_COLUMNS = ("NAME", "ID", "STEPS/S", "H_W", "PUSHES", "LAST SEEN", "MEAN TAU", "STATE")
#: Sync mode's: a worker's applied pushes are its contributions to committed rounds, τ is 0.
_SYNC_COLUMNS = ("NAME", "ID", "STEPS/S", "H_W", "CONTRIBUTIONS", "LAST SEEN", "STATE")


def _row(w: dict[str, Any], sync: bool) -> tuple[str, ...]:
    cells = (
        w["name"] + (f" ({w['ranks']} ranks)" if w["ranks"] > 1 else ""),  # a torchrun group
        str(w["id"]),
        f"{w['steps_per_s']:.2f}" if w["steps_per_s"] else "-",
        str(w["local_steps_per_round"]),
        str(w["applied_pushes"]),
        f"{w['last_seen_s']:.1f}s ago",
        f"{w['mean_staleness']:.2f}" if w["applied_pushes"] else "-",
        w["state"],
    )
    return cells[:6] + cells[7:] if sync else cells


def render(d: dict[str, Any]) -> str:
    """The status (a ``status_dict``) as text: a few lines on the run, then the workers' table."""
    lines = _header(d)
    shown = "" if len(d["workers"]) == d["live_workers"] else f", {len(d['workers']) - d['live_workers']} gone"
    lines += ["", f"workers: {d['live_workers']} live{shown}"]
    if d["workers"]:
        sync = d["mode"] == "sync"
        columns = _SYNC_COLUMNS if sync else _COLUMNS
        rows = [columns, *(_row(w, sync) for w in d["workers"])]
        widths = [max(len(r[i]) for r in rows) for i in range(len(columns))]
        numeric = {1, 2, 3, 4} if sync else {1, 2, 3, 4, 6}
        for r in rows:
            cells = [c.rjust(widths[i]) if i in numeric else c.ljust(widths[i]) for i, c in enumerate(r)]
            lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)
