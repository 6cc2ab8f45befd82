"""The scale suite: the 1,000-worker simulation (sim_scale.py), the server's apply cost
measured at several model sizes in the same run (``measure_apply``), the shards they call
for (S = ceil(demanded ÷ sustained pushes/s); the "bookkeeping not divided" column solves
demand · (bookkeeping + rest / S) ≤ 1), and ``scale.jsonl``, ``report.md`` and
``scale.png``. docs/algorithms.md, "1,000 workers on the virtual clock".

    asyncdiloco bench --suite scale --workers 1000 --seed 0 --out DIR
"""

from __future__ import annotations

import json
import math
import pathlib
import statistics
import time

import numpy as np
import torch

from asyncdiloco.bench.plots import plot_scale
from asyncdiloco.bench.sim import VirtualClock
from asyncdiloco.bench.sim_scale import ScaleConfig, simulate
from asyncdiloco.ps.state import ParameterServerState
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.tensors import Manifest

#: Model sizes (parameters) the report extrapolates to, linearly in the parameters from
#: the largest one measured: GPT-2 small and a 1.3B model.
EXTRAPOLATE_TO = (124_000_000, 1_300_000_000)


def measure_apply(cfg: ScaleConfig, numel: int, registered: int, pushes: int | None = None) -> dict:
    """Server CPU seconds of one push + its reply + its pull at ``numel`` parameters with
    ``registered`` workers registered (rates from ``cfg``'s distribution), the state code
    and config the simulation runs; one torch thread.

    Returns:
        ``{"numel", "registered", "pushes", "per_push_cpu_s", "per_push_wall_s",
        "sustained_pushes_per_s"}``: the medians over ``pushes`` pushes (a shared
        machine's other load inflates some), sustained = 1 / per-push CPU seconds.
    """
    pushes = pushes or max(8, min(200, (1 << 27) // (4 * numel)))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rng = np.random.default_rng(cfg.seed)
        clock = VirtualClock()
        state = ParameterServerState(cfg.server_config(), clock=clock)
        manifest = Manifest.from_named_tensors([("theta", torch.zeros(numel))])
        speeds = cfg.speeds(rng, registered)
        ids = [state.join(manifest, f"w{k}", 1.0 / float(speeds[k]))[0] for k in range(registered)]
        state.intake.push(
            manifest.pack_flat(torch.zeros(numel)), worker_id=ids[0], push_id=1, kind=pb.PUSH_KIND_INITIAL_PARAMETERS
        )
        payload = manifest.pack_flat(torch.full((numel,), 1e-4))
        push_ids = [2] * registered
        cpu_s: list[float] = []
        wall_s: list[float] = []
        for k in range(pushes + 1):  # the first one warms up (buffers, momentum, snapshots)
            i = k % registered
            clock.t += 1e-3
            c0, w0 = time.thread_time(), time.perf_counter()
            outcome = state.intake.push(
                payload, worker_id=ids[i], push_id=push_ids[i], base_version=state.version, num_local_steps=1
            )
            state.intake.reply(outcome, ids[i], hold=False)
            source = state.open_pull(pb.PullRequest(worker_id=ids[i]))
            state.snapshots.close_pull(source)
            state.record_pull(ids[i], source.header.total_bytes)
            if k:
                cpu_s.append(time.thread_time() - c0)
                wall_s.append(time.perf_counter() - w0)
            push_ids[i] += 1
        return {
            "kind": "apply_cost",
            "numel": numel,
            "registered": registered,
            "pushes": pushes,
            "per_push_cpu_s": statistics.median(cpu_s),
            "per_push_wall_s": statistics.median(wall_s),
            "sustained_pushes_per_s": 1 / max(1e-9, statistics.median(cpu_s)),
        }
    finally:
        torch.set_num_threads(threads)


def shards_needed(demand: float, per_push_s: float, bookkeeping_s: float = 0.0) -> int | None:
    """Shards S such that ``demand`` pushes/s fit in one second of one core per shard.

    Args:
        demand: pushes per second the workers send.
        per_push_s: seconds of server work per push on one shard (S = 1).
        bookkeeping_s: the part of ``per_push_s`` that every shard repeats (does not divide).
    Returns:
        ceil(demand · (per_push_s − b) / (1 − demand · b)) with b = ``bookkeeping_s``
        (ceil(demand · per_push_s) when b = 0); None when demand · b ≥ 1 (no S is enough).
    """
    b = min(max(0.0, bookkeeping_s), per_push_s)
    if demand * b >= 1.0:
        return None
    return max(1, math.ceil(demand * (per_push_s - b) / (1.0 - demand * b) - 1e-9))


def run_scale(cfg: ScaleConfig, out_dir: str, progress: bool = True) -> dict:
    """Measure the apply cost, run the simulation, write scale.jsonl, report.md and scale.png.

    ``asyncdiloco bench --suite scale`` first applies the server process's allocator
    settings (_malloc.py ``keep_large_blocks``), so the large sizes are timed as a server
    runs them.

    Returns:
        ``{"simulation": <simulate's record>, "apply": [<measure_apply records>], "real_s": float}``.
    """
    from tqdm import tqdm

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    sizes = (cfg.numel, *(s for s in cfg.apply_sizes if s != cfg.numel))
    applies = []
    for numel in sizes:
        for registered in (1, cfg.workers):
            applies.append(measure_apply(cfg, numel, registered))
            if progress:
                a = applies[-1]
                print(f"apply cost: {numel} params, {registered} workers: {a['per_push_cpu_s'] * 1e3:.2f} ms/push")
    with tqdm(total=round(cfg.duration_s), disable=not progress, unit="virtual s", dynamic_ncols=True) as bar:

        def advance(t: float) -> None:
            bar.update(round(t) - bar.n)

        sim = simulate(cfg, advance)
    result = {"simulation": sim, "apply": applies, "real_s": time.monotonic() - started}
    _add_shards(result)
    with open(out / "scale.jsonl", "w") as f:
        for rec in [*applies, sim]:
            f.write(json.dumps(rec) + "\n")
    (out / "report.md").write_text(report_markdown(result))
    plot_scale(sim, applies, out / "scale.png")
    return result


def _add_shards(result: dict) -> None:
    """S needed per measured size (and extrapolated ones), into each apply record."""
    sim, applies = result["simulation"], result["apply"]
    demand, peak = sim["demand"]["pushes_per_s"], sim["demand"]["peak_pushes_per_s"]
    workers = sim["config"]["workers"]
    cost = {(a["numel"], a["registered"]): a["per_push_cpu_s"] for a in applies}
    numel = sim["config"]["numel"]
    bookkeeping = max(0.0, cost[(numel, workers)] - cost[(numel, 1)])
    sim["server_cpu"]["bookkeeping_per_push_cpu_s"] = bookkeeping
    sim["server_cpu"]["one_worker_per_push_cpu_s"] = cost[(numel, 1)]
    for a in applies:
        a["s_needed"] = shards_needed(demand, a["per_push_cpu_s"])
        a["s_needed_peak"] = shards_needed(peak, a["per_push_cpu_s"])
        a["s_needed_bookkeeping_kept"] = (
            shards_needed(demand, a["per_push_cpu_s"], bookkeeping) if a["registered"] == workers else None
        )
    largest = max(a["numel"] for a in applies)
    per_param = (cost[(largest, workers)] - cost[(numel, workers)]) / max(1, largest - numel)
    result["extrapolated"] = [
        {
            "numel": n,
            "per_push_cpu_s": cost[(numel, workers)] + per_param * (n - numel),
            "s_needed": shards_needed(demand, cost[(numel, workers)] + per_param * (n - numel)),
            "s_needed_bookkeeping_kept": shards_needed(
                demand, cost[(numel, workers)] + per_param * (n - numel), bookkeeping
            ),
        }
        for n in EXTRAPOLATE_TO
    ]


def _binned(hist: list[int], edges: tuple[int, ...]) -> list[tuple[str, int]]:
    """Counts of a histogram (bucket i = value i) between consecutive ``edges``."""
    rows = []
    for lo, hi in zip(edges, (*edges[1:], math.inf)):
        n = sum(c for i, c in enumerate(hist) if lo <= i < hi)
        label = f"{lo}" if hi == lo + 1 else (f"≥ {lo}" if hi == math.inf else f"{lo}–{int(hi) - 1}")
        rows.append((label, n))
    return rows


def _reasons(by_reason: dict[str, int]) -> str:
    return f" ({', '.join(f'{k}: {n:,}' for k, n in sorted(by_reason.items()))})" if by_reason else ""


def _s(n: int | None) -> str:
    return "never" if n is None else str(n)


def report_markdown(result: dict) -> str:
    """report.md of a scale run: the demand and what one shard sustains, staleness, groups
    and Delayed Nesterov, DyLU's H_w, churn, and the findings."""
    lines = _shards_section(result) + _staleness_section(result["simulation"]) + _groups_section(result["simulation"])
    lines += [*_findings(result), "", "Plot: scale.png. Raw: scale.jsonl.", ""]
    return "\n".join(lines)


def _shards_section(result: dict) -> list[str]:
    sim, applies = result["simulation"], result["apply"]
    c, d, cpu = sim["config"], sim["demand"], sim["server_cpu"]
    workers = c["workers"]
    lines = [
        f"# {workers:,} workers on the virtual clock",
        "",
        f"`asyncdiloco bench --suite scale --workers {workers} --seed {c['seed']}`: {c['duration_s']:g} virtual s; "
        f"speeds {c['speeds']}; H = {c['local_steps']}; joins Poisson at {workers}/{c['mean_lifetime_s']:g} s, "
        "exponential "
        f"lifetimes of mean {c['mean_lifetime_s']:g} s, {c['crash_fraction']:.0%} of departures killed (no Leave); "
        f"a {c['numel']}-parameter noisy quadratic per worker. The server: its defaults ({sim['server']['outer']}, "
        f"DyLU, grouping window, lease {sim['server']['lease_s']:g} s). Real time {result['real_s']:.0f} s "
        f"(simulation {sim['real_s']:.0f} s).",
        "",
        "## Pushes per second: demanded, and what one shard applies",
        "",
        f"Demanded: **{d['pushes_per_s']:.1f} pushes/s** over the run ({d['pushes_per_s_second_half']:.1f} in its "
        f"second half, peak {d['peak_pushes_per_s']:.1f} over {c['sample_every_s']:g} s); without held replies the "
        f"live workers would send {d['unthrottled_pushes_per_s']:.1f}/s. Heartbeats: {d['heartbeats_per_s']:.1f}/s.",
        "",
        f"In the run ({c['numel']} parameters, ~{workers} workers registered) the server spent "
        f"{cpu['per_push_cpu_s'] * 1e3:.2f} ms of CPU per push (push + reply + pull): one shard sustains "
        f"**{cpu['sustained_pushes_per_s']:.0f} pushes/s**, so S = {cpu['s_needed']} (peak: "
        f"{cpu['s_needed_peak']}). Most of it is bookkeeping that grows with the workers registered: the same "
        f"push + reply + pull costs {cpu['one_worker_per_push_cpu_s'] * 1e3:.2f} ms with 1 worker registered and "
        f"{(cpu['one_worker_per_push_cpu_s'] + cpu['bookkeeping_per_push_cpu_s']) * 1e3:.2f} ms with {workers} "
        f"(the table below): {cpu['bookkeeping_per_push_cpu_s'] / max(1, workers - 1) * 1e6:.1f} µs per push per "
        f"registered worker (passes over the workers' table: the live rates, DyLU's H_w, the expected workers, "
        f"the lease check).",
        "",
        "Measured in the same run (thread CPU time, one torch thread; push + reply + pull, the same state code):",
        "",
        "| parameters | workers registered | ms CPU / push | pushes/s one shard | S needed (mean) | S (peak) "
        "| S, bookkeeping not divided |",
        "|---|---|---|---|---|---|---|",
    ]
    for a in applies:
        lines.append(
            f"| {a['numel']:,} | {a['registered']} | {a['per_push_cpu_s'] * 1e3:.2f} | "
            f"{a['sustained_pushes_per_s']:.0f} | {_s(a['s_needed'])} | {_s(a['s_needed_peak'])} | "
            f"{'—' if a['registered'] != workers else _s(a['s_needed_bookkeeping_kept'])} |"
        )
    for e in result.get("extrapolated", []):
        lines.append(
            f"| {e['numel']:,} (extrapolated) | {workers} | {e['per_push_cpu_s'] * 1e3:.0f} | "
            f"{1 / e['per_push_cpu_s']:.1f} | {_s(e['s_needed'])} | — | {_s(e['s_needed_bookkeeping_kept'])} |"
        )
    lines += [
        "",
        "S needed = ceil(demanded ÷ sustained), assuming every push's work divides by S; the last column keeps "
        "the per-push bookkeeping whole on every shard. With 1 worker registered Delayed Nesterov's N is 1, so "
        "every push also updates the momentum (three more passes over θ): at large sizes that row can cost more "
        "than the fleet's, whose momentum moves once per ~N pushes. Extrapolated rows scale the largest measured "
        "size linearly in the parameters.",
        "",
    ]
    return lines


def _staleness_section(sim: dict) -> list[str]:
    p, stal = sim["pushes"], sim["staleness"]
    return [
        "## Staleness",
        "",
        f"{p['sent']:,} pushes sent: {p['applied']:,} applied (the server counts {sim['applied_by_server']:,}), "
        f"{p['refused']:,} refused{_reasons(sim['refused_by_reason'])}. τ: mean {stal['mean']:.1f}, median "
        f"{stal['p50']}, p99 {stal['p99']}, max {stal['max']} (max_staleness {stal['max_staleness']}).",
        "",
        "| τ | "
        + " | ".join(lbl for lbl, _ in _binned(sim["staleness_histogram"], (0, 1, 10, 100, 500, 900, 1000)))
        + " |",
        "|---" * 8 + "|",
        "| pushes | "
        + " | ".join(str(n) for _, n in _binned(sim["staleness_histogram"], (0, 1, 10, 100, 500, 900, 1000)))
        + " |",
        "",
    ]


def _groups_section(sim: dict) -> list[str]:
    """Groups and Delayed Nesterov, DyLU's H_w, churn and the model."""
    c, p, groups = sim["config"], sim["pushes"], sim["groups"]
    workers, H = c["workers"], c["local_steps"]
    alive = [s["alive"] for s in sim["samples"]]
    h_med = [s["h_w"][2] for s in sim["samples"] if s["h_w"]]
    hist_h = sim["h_w_histogram"]
    dn = sim["dn_buffer_histogram"]
    dn_updates = sum(dn)
    dn_mean = sum((i + 1) * n for i, n in enumerate(dn)) / max(1, dn_updates)
    losses = [s["loss"] for s in sim["samples"]]
    return [
        "## Groups and Delayed Nesterov",
        "",
        f"{groups['released']:,} push groups released (the server's `group_size_histogram`), mean "
        f"{groups['mean_size']:.1f} pushes, median {groups['p50']}, largest {groups['max']}; "
        f"{groups['at_deadline']} of {groups['seen']} released at their window's deadline rather than complete. "
        f"Replies held: mean {sim['held_s']['mean']:.1f} s, median {sim['held_s']['p50']:.1f} s, max "
        f"{sim['held_s']['max']:.1f} s. Utilisation (compute ÷ live time): {sim['utilisation']:.2f}.",
        "",
        "| group size | "
        + " | ".join(lbl for lbl, _ in _binned([0, *sim["group_size_histogram"]], _size_edges(workers)))
        + " |",
        "|---" * (len(_size_edges(workers)) + 1) + "|",
        "| groups | "
        + " | ".join(str(n) for _, n in _binned([0, *sim["group_size_histogram"]], _size_edges(workers)))
        + " |",
        "",
        f"Delayed Nesterov's momentum updates: {dn_updates}, each over a buffer of mean {dn_mean:.0f} arrivals "
        f"(N = the expected workers at each arrival); {sim['dn_open_arrivals']} arrivals in the open buffer "
        "at the end.",
        "",
        "## DyLU's H_w",
        "",
        f"H_w handed out at pulls: {_share(hist_h, 0)} H_w = 1, {_share(hist_h, H - 1)} H_w = H = {H}; "
        f"median {_median_of(hist_h)}. Median H_w over the live workers over time: {min(h_med, default=0)}–"
        f"{max(h_med, default=0)}; grouping window {min(s['window_s'] for s in sim['samples']):.1f}–"
        f"{max(s['window_s'] for s in sim['samples']):.1f} s.",
        "",
        "## Churn and the model",
        "",
        f"Joins {p['joins']:,} ({workers} at start), Leaves {p['leaves']}, killed {p['crashes']}, leases expired "
        f"{p['expired']}, rejoins after a lapsed lease {p['rejoins']}; workers alive {min(alive)}–{max(alive)}. "
        f"Quadratic loss of the global model: {losses[0]:.4f} at start, {losses[-1]:.4f} at the end "
        f"(version {sim['version']:,}); divergence warnings {sim['divergence_warnings']}.",
        "",
        "## What it says",
        "",
    ]


def _findings(result: dict) -> list[str]:
    """Sentences the numbers support, each with its numbers."""
    sim = result["simulation"]
    g, st, p, cpu = sim["groups"], sim["staleness"], sim["pushes"], sim["server_cpu"]
    workers = sim["config"]["workers"]
    window = max(s["window_s"] for s in sim["samples"])
    out = []
    if g["seen"] and g["at_deadline"] / g["seen"] >= 0.5:
        out.append(
            f"- Groups form but rarely complete: {g['at_deadline']} of {g['seen']} waited out the whole window "
            f"({window:.1f} s, 1.5 inner steps of the slowest live worker) because some expected worker never "
            f"pushed into them (a killed worker stays expected for two of its rounds plus the window; a slow one "
            f"misses the group); replies wait {sim['held_s']['p50']:.1f} s (median) and utilisation is "
            f"{sim['utilisation']:.2f}, so the workers send {sim['demand']['pushes_per_s']:.1f} pushes/s of the "
            f"{sim['demand']['unthrottled_pushes_per_s']:.1f} they could."
        )
    elif g["seen"]:
        out.append(f"- Groups complete: {g['seen'] - g['at_deadline']} of {g['seen']} before their deadline.")
    stale = sim["refused_by_reason"].get("stale_push", 0)
    out.append(
        f"- Staleness grows with the group, as grouping makes it: the k-th arrival of a group has τ ≈ k, so τ "
        f"spans 0 to the group's size (mean {st['mean']:.0f}, max {st['max']}). With constant weights and Delayed "
        f"Nesterov over the group this is by design, but the default max_staleness = {st['max_staleness']} "
        f"{'refused ' + str(stale) + ' pushes' if stale else 'was not reached'} at {workers} workers"
        + (": raise --max-staleness above the fleet size." if stale or st["max"] >= 0.9 * st["max_staleness"] else ".")
    )
    out.append(
        f"- Delayed Nesterov's buffer tracks the fleet: {sum(sim['dn_buffer_histogram'])} momentum updates for "
        f"{p['applied']:,} pushes (N = the expected workers, about {workers})."
    )
    out.append(
        f"- The server's per-push bookkeeping is O(workers): {cpu['bookkeeping_per_push_cpu_s'] * 1e3:.2f} ms of "
        f"CPU per push at {workers} registered, against {cpu['one_worker_per_push_cpu_s'] * 1e3:.2f} ms for the "
        f"tensor work of a {sim['config']['numel']}-parameter push; it caps one shard at "
        f"{1 / max(1e-9, cpu['bookkeeping_per_push_cpu_s']):.0f} pushes/s whatever the model size, and sharding "
        f"does not divide it."
    )
    return out


def _size_edges(workers: int) -> tuple[int, ...]:
    edges = [1, 2, 10, 100, workers // 2, (9 * workers) // 10, workers]
    return tuple(sorted(set(e for e in edges if e >= 1)))


def _share(hist: list[int], i: int) -> str:
    total = sum(hist)
    return f"{hist[i] / total:.0%}" if total and i < len(hist) else "0%"


def _median_of(hist: list[int]) -> int:
    total, cum = sum(hist), 0
    for i, n in enumerate(hist):
        cum += n
        if cum * 2 >= total:
            return i + 1
    return 0
