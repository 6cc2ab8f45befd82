"""The sync-vs-async suite's numbers, from the records of either clock: per profile and
row the final loss, the loss at equal wall time, the time to a baseline's final loss and
the speed-up, the wall ratio at equal tokens, and the claims with the rule that shows them
(``CLAIM_RULE``: a claim holds with twice the seed spread counted against it).
suite_markdown.py writes report.md from them. docs/algorithms.md, "Reading the report"."""

from __future__ import annotations

import math
import statistics

from asyncdiloco.bench.sim import METHODS

#: The async default (what ``asyncdiloco server`` runs with no flags).
DEFAULT_METHOD = "async_dn_dylu"
#: Methods beyond the paper, each judged against the default (``beyond`` in claims.json).
BEYOND_METHODS = (
    "async_dn_dylu_lookahead",
    "async_dn_dylu_stream",
    "async_dn_dylu_overlap",
    "async_dn_dylu_blockcheck",
)
#: Standard synchronous DiLoCo with its paper's outer step (η 0.7, μ 0.9): claims (a), (b).
STANDARD = "sync_diloco"
#: The tuned copy of sync DiLoCo (suite.py names a tuned method that is also a reference row so).
TUNED_SUFFIX = "_tuned"
LOCALSGD = "sync_localsgd"
NAIVE_ASYNC = "async_nesterov"

#: The claims' thresholds: Liu et al. 2024 (arXiv 2401.09135), Table 1, for (a)-(c); issue 25 for the rest.
CLAIM_A_MIN_GAIN = 0.01  # (a) sync DiLoCo at least 1 % below sync LocalSGD
CLAIM_B_MIN_GAP = 0.05  # (b) naive async Nesterov at least 5 % above sync DiLoCo
CLAIM_C_MAX_GAP = 0.01  # (c) the default within 1 % of (tuned) sync DiLoCo, or lower ...
CLAIM_C_MIN_SPEEDUP = 2.7  # ... and at least 2.7x sooner to its final loss
CLAIM_C_PROFILES = ("uneven", "slow_link")  # where (c) is a target
STRONGEST_MAX_GAP = 0.01  # the default within 1 % of the best tuned sync method ...
STRONGEST_MIN_SPEEDUP = 1.3  # ... and at least 1.3x sooner to its final loss
STRONGEST_PROFILES = ("jittery", "slow_link")  # where "strongest" is a target
UTILISATION_TARGET = 0.93
#: How many seed spreads a gap must clear to be shown.
SPREAD_FACTOR = 2.0

CLAIM_RULE = (
    "A claim is **shown** only when it holds with twice the seed spread counted against it. "
    "Loss: g = (mean_m − mean_b) / mean_b, the relative gap of row m over baseline b, and "
    "s = max(std_m, std_b) / mean_b, the larger seed standard deviation of the two final losses; "
    "'m within X of b (or lower)' is shown when g + 2s ≤ X, 'm at least X above b' when g − 2s ≥ X, "
    "'m beats b' when g + 2s < 0. A run whose final loss is not finite or above its initial loss "
    "has diverged and counts as infinitely worse. Speed-up: the row must reach the baseline's final "
    "loss on every seed, and the pessimistic ratio (t_b − 2·std t_b) / (t_m + 2·std t_m) (times over "
    "seeds) must reach the target."
)


def _mean_std(xs: list[float | None]) -> tuple[float, float]:
    ys = [x for x in xs if x is not None and not math.isnan(x)]
    if not ys:
        return math.nan, math.nan
    return statistics.mean(ys), (statistics.stdev(ys) if len(ys) > 1 else 0.0)


def _first_time_at(curve: list[dict], loss: float) -> float | None:
    """The first evaluation's time with held-out loss <= ``loss`` (None: never)."""
    return next((p["time_s"] for p in curve if p["eval_loss"] <= loss), None)


def _loss_at(curve: list[dict], t: float) -> float:
    """The curve's value at time t: its last evaluation at or before t."""
    value = curve[0]["eval_loss"]
    for p in curve:
        if p["time_s"] > t * (1 + 1e-12):
            break
        value = p["eval_loss"]
    return value


def _diverged(r: dict) -> bool:
    loss = r["final_eval_loss"]
    return not math.isfinite(loss) or loss > r["curve"][0]["eval_loss"]


def row_mode(r: dict) -> str:
    """'sync' or 'async': the record's ``mode``, else that of the simulator method it ran."""
    if "mode" in r:
        return r["mode"]
    spec = METHODS.get(r.get("sim_method", r["method"]))
    return spec.mode if spec is not None else "async"


def _row_stats(rs: list[dict]) -> dict:
    opt = lambda key: _mean_std([r.get(key) for r in rs])  # noqa: E731 (keys only some clocks record)
    first = rs[0]
    return {
        "seeds": len(rs),
        "loss": _mean_std([r["final_eval_loss"] for r in rs]),
        "losses": [r["final_eval_loss"] for r in rs],
        "diverged": sum(_diverged(r) for r in rs),
        "curve_final": _mean_std([r["curve"][-1]["eval_loss"] for r in rs]),
        "wall": _mean_std([r["virtual_wall_s"] for r in rs]),
        "end_s": max(r["curve"][-1]["time_s"] for r in rs),
        "own_time": _mean_std([_first_time_at(r["curve"], r["curve"][-1]["eval_loss"]) for r in rs]),
        "util": _mean_std([r["utilisation"] for r in rs]),
        "outer_steps": _mean_std([r.get("outer_steps", r["updates"]) for r in rs]),
        "true_staleness": opt("mean_true_staleness"),
        "staleness": _mean_std([r["mean_staleness"] for r in rs]),
        "bytes": _mean_std([r["bytes_up"] + r["bytes_down"] for r in rs]),
        "comm_s": opt("comm_s"),
        "staleness_hist": _sum_histograms([r["staleness_histogram"] for r in rs]),
        "true_staleness_hist": _sum_histograms([r.get("true_staleness_histogram") or [] for r in rs]),
        "group_hist": _sum_histograms([r.get("group_size_histogram") or [] for r in rs]),
        "mode": row_mode(first),
        "tuned": bool(first.get("tuned", False)),
        "sim_method": first.get("sim_method", first["method"]),
        "outer": (first["outer_lr"], first["outer_momentum"]) if "outer_lr" in first else None,
    }


def _sum_histograms(hists: list[list[int]]) -> list[int]:
    """Element-wise sum, trailing zeros dropped."""
    out = [0] * max((len(h) for h in hists), default=0)
    for h in hists:
        for i, n in enumerate(h):
            out[i] += n
    while out and out[-1] == 0:
        out.pop()
    return out


def baseline_c(rows: dict[str, dict]) -> str | None:
    """Claim (c)'s baseline: the tuned copy of sync DiLoCo, else standard sync DiLoCo."""
    for name in (STANDARD + TUNED_SUFFIX, STANDARD):
        if name in rows:
            return name
    return None


def strongest_sync(rows: dict[str, dict]) -> tuple[str | None, bool]:
    """The best-tuned synchronous row (lowest mean final loss among the tuned sync rows;
    among all sync rows when none was tuned) and whether it was tuned."""
    for tuned in (True, False):
        pool = [n for n, s in rows.items() if s["mode"] == "sync" and (s["tuned"] or not tuned)]
        pool = [n for n in pool if not math.isnan(rows[n]["loss"][0])]
        if pool:
            return min(pool, key=lambda n: rows[n]["loss"][0]), tuned
    return None, False


def _speed(row: dict, rs: list[dict], base: dict) -> dict:
    """Time of ``rs`` (a row's runs) to ``base``'s mean final curve loss, and the speed-up."""
    target = base["curve_final"][0]
    times = [_first_time_at(r["curve"], target) for r in rs]
    reached = sum(t is not None for t in times)
    out: dict = {"target": target, "reached": f"{reached}/{len(rs)}", "time": (math.nan, math.nan)}
    out.update(speedup=None, speedup_low=None, wall_ratio=None)
    wb, wm = base["wall"][0], row["wall"][0]
    if wm > 0 and not math.isnan(wb + wm):
        out["wall_ratio"] = wb / wm
    if reached < len(rs):
        return out
    tm, sm = _mean_std(times)
    tb, sb = base["own_time"]
    out["time"] = (tm, sm)
    if tm > 0 and not math.isnan(tb):
        out["speedup"] = tb / tm
        out["speedup_low"] = (tb - SPREAD_FACTOR * sb) / (tm + SPREAD_FACTOR * sm)
    return out


def _own_speed(row: dict) -> dict:
    """A baseline against itself: its own time to its final loss, speed-up and wall ratio 1."""
    return {
        "target": row["curve_final"][0],
        "reached": f"{row['seeds']}/{row['seeds']}",
        "time": row["own_time"],
        "speedup": 1.0,
        "speedup_low": None,
        "wall_ratio": 1.0,
    }


def summarize(records: list[dict]) -> dict[str, dict]:
    """Per profile: ``rows`` (row name -> its statistics over seeds, in the records'
    order, each with ``vs``: its speed against the baselines), ``equal_wall_s`` (T),
    ``baseline_c`` (claim (c)'s baseline), ``strongest`` (the best tuned sync row) and
    ``strongest_tuned``."""
    out: dict[str, dict] = {}
    for profile in dict.fromkeys(r["profile"] for r in records):
        runs: dict[str, list[dict]] = {}
        for r in records:
            if r["profile"] == profile:
                runs.setdefault(r["method"], []).append(r)
        rows = {name: _row_stats(rs) for name, rs in runs.items()}
        equal_wall = min(s["end_s"] for s in rows.values())
        c_base = baseline_c(rows)
        strongest, strongest_tuned = strongest_sync(rows)
        baselines = [b for b in dict.fromkeys((c_base, strongest, DEFAULT_METHOD)) if b is not None and b in rows]
        for name, s in rows.items():
            s["loss_at_equal_wall"] = _mean_std([_loss_at(r["curve"], equal_wall) for r in runs[name]])
            s["vs"] = {b: _speed(s, runs[name], rows[b]) if b != name else _own_speed(s) for b in baselines}
        out[profile] = {
            "rows": rows,
            "equal_wall_s": equal_wall,
            "baseline_c": c_base,
            "strongest": strongest,
            "strongest_tuned": strongest_tuned,
        }
    return out


def loss_gap(m: dict, b: dict) -> tuple[float, float]:
    """(g, s): the relative gap of row m's mean final loss over b's, and the larger seed
    std of the two relative to b's mean; g = ±inf when one of them diverged (m: +inf)."""
    if m["diverged"] and not b["diverged"]:
        return math.inf, 0.0
    if b["diverged"] and not m["diverged"]:
        return -math.inf, 0.0
    (mm, sm), (mb, sb) = m["loss"], b["loss"]
    if math.isnan(mm + mb) or mb == 0:
        return math.nan, math.nan
    return (mm - mb) / mb, max(sm, sb) / mb


def within(g: float, s: float, x: float) -> bool:
    """'m within x of b, or lower': g + 2s <= x."""
    return bool(g + SPREAD_FACTOR * s <= x) if not math.isnan(g) else False


def at_least(g: float, s: float, x: float) -> bool:
    """'m at least x above b': g - 2s >= x."""
    return bool(g - SPREAD_FACTOR * s >= x) if not math.isnan(g) else False


def beats(g: float, s: float) -> bool:
    """'m beats b': g + 2s < 0."""
    return bool(g + SPREAD_FACTOR * s < 0) if not math.isnan(g) else False


def speed_shown(v: dict, target: float) -> bool:
    return v["speedup_low"] is not None and v["speedup_low"] >= target


def _num(x: float | None) -> float | None:
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else x


def _gap_fields(g: float, s: float) -> dict:
    """``value`` (None when a side diverged: ``diverged`` is then True) and ``spread``."""
    return {"value": _num(g), "spread": _num(s), "diverged": math.isinf(g)}


def _against(p: dict, m: str, b: str | None, max_gap: float, min_speedup: float) -> dict | None:
    """Row m against baseline b: within ``max_gap`` at equal tokens and ``min_speedup`` sooner."""
    rows = p["rows"]
    if b is None or m not in rows or b not in rows:
        return None
    g, s = loss_gap(rows[m], rows[b])
    v = rows[m]["vs"][b]
    loss_ok, speed_ok = within(g, s, max_gap), speed_shown(v, min_speedup)
    return {
        "baseline": b,
        "shown": loss_ok and speed_ok,
        "loss_shown": loss_ok,
        "speed_shown": speed_ok,
        "loss_gap": _num(g),
        "spread": _num(s),
        "diverged": math.isinf(g),
        "speedup": _num(v["speedup"]),
        "speedup_low": _num(v["speedup_low"]),
        "reached": v["reached"],
        "wall_ratio": _num(v["wall_ratio"]),
        "target": f"gap + 2·spread <= {max_gap:.0%} and pessimistic speed-up >= {min_speedup}x",
        m: _num(rows[m]["loss"][0]),
        b: _num(rows[b]["loss"][0]),
    }


def claims_json(summary: dict[str, dict]) -> dict:
    """Per profile: claims (a), (b), (c), ``strongest``, ``utilisation`` and ``beyond``
    (one entry per method beyond the paper that ran), each with ``shown`` by the rule
    ``CLAIM_RULE``; a claim whose rows did not run is left out. (c) and ``strongest``
    say whether the profile is one of the issue's targets for them (``applies``)."""
    out: dict = {}
    for profile, p in summary.items():
        rows, claim = p["rows"], {}
        if STANDARD in rows and LOCALSGD in rows:
            g, s = loss_gap(rows[STANDARD], rows[LOCALSGD])
            claim["a"] = {
                "shown": within(g, s, -CLAIM_A_MIN_GAIN),
                **_gap_fields(-g, s),
                "what": "relative loss gain of sync DiLoCo (η 0.7, μ 0.9) over sync LocalSGD",
                "target": f"gain - 2·spread >= {CLAIM_A_MIN_GAIN:.0%}",
                STANDARD: _num(rows[STANDARD]["loss"][0]),
                LOCALSGD: _num(rows[LOCALSGD]["loss"][0]),
            }
        if NAIVE_ASYNC in rows and STANDARD in rows:
            g, s = loss_gap(rows[NAIVE_ASYNC], rows[STANDARD])
            claim["b"] = {
                "shown": at_least(g, s, CLAIM_B_MIN_GAP),
                **_gap_fields(g, s),
                "what": "relative loss gap of naive async Nesterov over sync DiLoCo (η 0.7, μ 0.9)",
                "target": f"gap - 2·spread >= {CLAIM_B_MIN_GAP:.0%}",
                NAIVE_ASYNC: _num(rows[NAIVE_ASYNC]["loss"][0]),
            }
        c = _against(p, DEFAULT_METHOD, p["baseline_c"], CLAIM_C_MAX_GAP, CLAIM_C_MIN_SPEEDUP)
        if c is not None:
            c.update(value=c["loss_gap"], applies=profile in CLAIM_C_PROFILES)
            c["what"] = (
                f"{DEFAULT_METHOD} against {p['baseline_c']}: loss gap at equal tokens, speed-up to its final loss"
            )
            claim["c"] = c
        st = _against(p, DEFAULT_METHOD, p["strongest"], STRONGEST_MAX_GAP, STRONGEST_MIN_SPEEDUP)
        if st is not None:
            st.update(tuned=p["strongest_tuned"], applies=profile in STRONGEST_PROFILES)
            st["what"] = f"{DEFAULT_METHOD} against the best-tuned synchronous method"
            claim["strongest"] = st
        if DEFAULT_METHOD in rows:
            u = rows[DEFAULT_METHOD]["util"][0]
            claim["utilisation"] = {
                "shown": bool(u >= UTILISATION_TARGET),
                "value": _num(u),
                "target": f">= {UTILISATION_TARGET}",
            }
            beyond = {}
            for m in BEYOND_METHODS:
                if m in rows:
                    g, s = loss_gap(rows[m], rows[DEFAULT_METHOD])
                    beyond[m] = {
                        "shown": beats(g, s),
                        **_gap_fields(g, s),
                        "speedup": _num(rows[m]["vs"][DEFAULT_METHOD]["speedup"]),
                        "wall_ratio": _num(rows[m]["vs"][DEFAULT_METHOD]["wall_ratio"]),
                        "loss_at_equal_wall": _num(rows[m]["loss_at_equal_wall"][0]),
                        f"{DEFAULT_METHOD}_at_equal_wall": _num(rows[DEFAULT_METHOD]["loss_at_equal_wall"][0]),
                        "what": f"relative loss of {m} against {DEFAULT_METHOD} (negative: it wins)",
                        "target": "gap + 2·spread < 0",
                        m: _num(rows[m]["loss"][0]),
                    }
            if beyond:
                claim["beyond"] = beyond
        out[profile] = claim
    return out


def add_targets(records: list[dict], margin: float = 0.0) -> None:
    """Per profile, ``target_loss`` = claim (c)'s baseline's mean final curve loss
    × (1 + margin) on every record, and ``time_to_target_s`` (None: never reached)."""
    for profile, p in summarize(records).items():
        base = p["baseline_c"]
        target = p["rows"][base]["curve_final"][0] * (1 + margin) if base else math.nan
        for r in records:
            if r["profile"] == profile:
                r["target_loss"] = target
                r["time_to_target_s"] = _first_time_at(r["curve"], target)
