"""The run at a glance: one server-rendered HTML page with inline SVG charts at ``/`` of the
metrics port (no script, no external asset; reloads every ``REFRESH_S`` seconds). Every
string from outside the server is HTML-escaped.
"""

from __future__ import annotations

import html
import math
import threading
from collections.abc import Sequence

from asyncdiloco.wire._proto import parameter_server_pb2 as pb

#: Seconds between two reloads of the page.
REFRESH_S = 5
_W, _H, _PAD = 560, 200, 40  # chart size and the room for the axes' labels, pixels


class RunHistory:
    """(uptime in seconds, version) samples, bounded and downsampled: at most
    ``max_points``; when full, every other sample is dropped and the spacing between
    samples doubles, so the whole run stays covered at a coarser step. Thread-safe.

    Args:
        max_points: most samples kept (>= 4).
        spacing_s: smallest seconds between two kept samples, at first.
    """

    def __init__(self, max_points: int = 512, spacing_s: float = 1.0) -> None:
        assert max_points >= 4
        self.max_points = max_points
        self.spacing_s = spacing_s
        self._points: list[tuple[float, int]] = []
        self._lock = threading.Lock()

    def sample(self, t_s: float, version: int) -> None:
        """The version at uptime ``t_s`` (seconds); kept unless the last sample is too recent."""
        with self._lock:
            if self._points and t_s - self._points[-1][0] < self.spacing_s:
                return
            self._points.append((t_s, version))
            if len(self._points) > self.max_points:
                self._points = self._points[::2]
                self.spacing_s *= 2

    def points(self) -> list[tuple[float, int]]:
        """The samples, oldest first."""
        with self._lock:
            return list(self._points)


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _scale(lo: float, hi: float, size: float, flip: bool = False):
    span = hi - lo if hi > lo else 1.0
    return lambda v: (size - (v - lo) / span * size) if flip else (v - lo) / span * size


def line_chart(points: Sequence[tuple[float, float]], x_label: str, y_label: str) -> str:
    """An inline SVG line chart of ``points`` (x, y), with its range on each axis."""
    if not points:
        return '<p class="empty">no data yet</p>'
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    sx, sy = _scale(x0, x1, _W - 2 * _PAD), _scale(y0, y1, _H - 2 * _PAD, flip=True)
    path = " ".join(f"{_PAD + sx(x):.1f},{_PAD + sy(y):.1f}" for x, y in points)
    dots = "".join(f'<circle cx="{_PAD + sx(x):.1f}" cy="{_PAD + sy(y):.1f}" r="2"/>' for x, y in points[-200:])
    return (
        f'<svg class="chart" width="{_W}" height="{_H}" viewBox="0 0 {_W} {_H}" role="img">'
        f'<rect x="{_PAD}" y="{_PAD}" width="{_W - 2 * _PAD}" height="{_H - 2 * _PAD}" class="frame"/>'
        f'<polyline points="{path}" class="line"/><g class="dots">{dots}</g>'
        f'<text x="{_PAD}" y="{_H - 12}">{_e(_num(x0))}</text>'
        f'<text x="{_W - _PAD}" y="{_H - 12}" text-anchor="end">{_e(_num(x1))} {_e(x_label)}</text>'
        f'<text x="{_PAD - 4}" y="{_PAD + 4}" text-anchor="end">{_e(_num(y1))}</text>'
        f'<text x="{_PAD - 4}" y="{_H - _PAD}" text-anchor="end">{_e(_num(y0))}</text>'
        f'<text x="{_PAD}" y="{_PAD - 10}">{_e(y_label)}</text></svg>'
    )


def bar_chart(counts: Sequence[int], x_label: str) -> str:
    """An inline SVG bar chart, one bar per index (its label below it)."""
    n, top = max(len(counts), 1), max(counts, default=0) or 1
    step = (_W - 2 * _PAD) / n
    bars = []
    for i, c in enumerate(counts):
        h = c / top * (_H - 2 * _PAD)
        x = _PAD + i * step
        bars.append(
            f'<rect x="{x + 1:.1f}" y="{_H - _PAD - h:.1f}" width="{max(step - 2, 1):.1f}" height="{h:.1f}" '
            f'class="bar"><title>{i}: {c}</title></rect>'
            f'<text x="{x + step / 2:.1f}" y="{_H - _PAD + 14}" text-anchor="middle">{i}</text>'
        )
    return (
        f'<svg class="chart" width="{_W}" height="{_H}" viewBox="0 0 {_W} {_H}" role="img">{"".join(bars)}'
        f'<text x="{_PAD - 4}" y="{_PAD + 4}" text-anchor="end">{top}</text>'
        f'<text x="{_W - _PAD}" y="{_H - 6}" text-anchor="end">{_e(x_label)}</text></svg>'
    )


def _num(v: float) -> str:
    if isinstance(v, int) or (math.isfinite(v) and v == int(v) and abs(v) < 1e12):
        return str(int(v))
    return "0" if abs(v) < 5e-3 else f"{v:.3g}"


def _duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _table(head: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    th = "".join(f"<th>{_e(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def _shown_name(w: pb.WorkerStatus) -> str:
    """The worker's name, with its rank count when it is a torchrun group."""
    return w.worker_name + (f" ({w.ranks} ranks)" if w.ranks > 1 else "")


def workers_table(workers: Sequence[pb.WorkerStatus], sync: bool = False) -> str:
    """One row per registered worker: name, id, state, H_w, v_w, pushes, last seen, τ;
    ``sync``: name, id, state, H, round contributions, refused, last seen (no rates, no τ)."""
    if not workers:
        return '<p class="empty">no worker has joined yet</p>'
    order = sorted(workers, key=lambda w: (w.state not in ("training", "silent"), w.worker_id))
    if sync:
        head: tuple[str, ...] = ("name", "id", "state", "H", "contributions", "refused", "last seen")
        return _table(
            head,
            [
                (
                    _shown_name(w),
                    w.worker_id,
                    w.state,
                    w.local_steps_per_round,
                    w.applied_pushes,
                    w.rejected_pushes,
                    f"{w.last_seen_s:.1f} s ago",
                )
                for w in order
            ],
        )
    head = ("name", "id", "state", "H_w", "v_w (steps/s)", "pushes", "refused", "last seen", "mean τ", "last τ")
    rows = [
        (
            _shown_name(w),
            w.worker_id,
            w.state,
            w.local_steps_per_round,
            f"{w.steps_per_s:.3g}",
            w.applied_pushes,
            w.rejected_pushes,
            f"{w.last_seen_s:.1f} s ago",
            f"{w.mean_staleness:.2f}",
            w.last_staleness,
        )
        for w in order
    ]
    return _table(head, rows)


#: RunConfig fields that mean nothing to an async run, and to a sync run (not shown for one).
_SYNC_ONLY = frozenset({"min_workers", "join_timeout_s", "round_timeout_s", "sync_weighting", "sync_local_steps"})
_ASYNC_ONLY = frozenset(
    {"max_staleness", "dylu", "grouping", "group_window_s", "group_max_wait_s", "wire_codec", "codec_block_size"}
)


def _run_config_rows(st: pb.StatusReply) -> list[tuple[str, object]]:
    sync = st.run_config.mode == "sync"
    rows: list[tuple[str, object]] = [("outer optimizer", st.outer_optimizer)]
    if not sync:  # every round is applied at staleness 0
        rows.append(("staleness weighting", st.staleness_weighting))
    rows += [
        (field.name, f"{value:.4g}" if isinstance(value, float) else value)
        for field, value in st.run_config.ListFields()
        if field.name not in (_ASYNC_ONLY if sync else _SYNC_ONLY)
    ]
    if st.HasField("manifest"):
        numel = sum(math.prod(t.shape) for t in st.manifest.tensors)
        rows.append(("model", f"{len(st.manifest.tensors)} tensors, {numel:,} parameters"))
    return rows


_STYLE = (
    "body{font:14px system-ui,sans-serif;margin:1.5em;color:#222;background:#fafafa}"
    "h1{font-size:1.4em;margin:0 0 .3em}h2{font-size:1.1em;margin:1.4em 0 .4em}"
    ".cards{display:flex;flex-wrap:wrap;gap:.6em}.card{background:#fff;border:1px solid #ddd;border-radius:6px;"
    "padding:.5em .9em}.card b{display:block;font-size:1.3em}.grid{display:flex;flex-wrap:wrap;gap:1.5em}"
    "table{border-collapse:collapse;background:#fff}td,th{border:1px solid #ddd;padding:.25em .6em;text-align:left}"
    "th{background:#f0f0f0}.chart{background:#fff;border:1px solid #ddd}.chart text{font-size:11px;fill:#555}"
    ".frame{fill:none;stroke:#eee}.line{fill:none;stroke:#1f6feb;stroke-width:2}.dots circle{fill:#1f6feb}"
    ".bar{fill:#2da44e}.empty{color:#888}"
)


def render(st: pb.StatusReply, history: Sequence[tuple[float, int]]) -> str:
    """The dashboard page for ``st`` (a ``StatusReply``) and the version's ``history``
    ((uptime s, version) samples, oldest first; the current version is added)."""
    alive = sum(w.alive for w in st.workers)
    sync = st.run_config.mode == "sync"  # a sync run applies rounds; its "pushes" are member contributions
    cards = [
        ("version", st.version),
        ("mode", st.run_config.mode or "?"),
        ("contributions/s (last min)" if sync else "pushes/s (last min)", f"{st.pushes_per_s:.2f}"),
        ("contributions" if sync else "applied", st.applied_pushes),
        ("refused", st.rejected_pushes),
        ("retried", st.duplicate_pushes),
        ("live workers", alive),
        ("uptime", _duration(st.uptime_s)),
    ]
    if sync:
        cards.append(("rounds committed / aborted", f"{st.rounds_committed} / {st.rounds_failed}"))
    points = [(t / 60, v) for t, v in history] + [(st.uptime_s / 60, st.version)]
    hist = list(st.staleness_histogram)
    shown = max([i + 1 for i, c in enumerate(hist) if c] + [min(len(hist), 8)])
    losses = sorted(((e.version, e.loss) for e in st.evals), key=lambda p: p[0])  # reports may arrive out of order
    state = "" if st.initialized else " · waiting for the first worker's initial parameters"
    parts = [
        f'<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="refresh" content="{REFRESH_S}">'
        f"<title>asyncdiloco · version {st.version}</title><style>{_STYLE}</style></head><body>",
        f"<h1>asyncdiloco parameter server</h1><p>server {_e(st.server_version)}{state}</p>",
        '<div class="cards">' + "".join(f'<div class="card">{_e(k)}<b>{_e(v)}</b></div>' for k, v in cards) + "</div>",
        '<div class="grid"><div><h2>Version over time</h2>',
        line_chart(points, "min", "version"),
        "</div><div><h2>Held-out loss by version</h2>",
        line_chart(losses, "version", "loss (nats/token)")
        if losses
        else '<p class="empty">no evaluator has reported yet (asyncdiloco eval)</p>',
        ""
        if sync  # every round applies at τ = 0
        else "</div><div><h2>Staleness τ of applied pushes</h2>" + bar_chart(hist[:shown], "τ (versions)"),
        "</div></div><h2>Workers</h2>",
        workers_table(st.workers, sync),
        "<h2>Run</h2>",
        _table(("setting", "value"), _run_config_rows(st)),
        f'<p class="empty">reloads every {REFRESH_S} s · <a href="/metrics">/metrics</a> · '
        f'<a href="/status.json">/status.json</a></p></body></html>',
    ]
    return "".join(parts)
