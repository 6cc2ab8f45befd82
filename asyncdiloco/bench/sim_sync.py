"""The simulator's synchronous loop: DiLoCo / LocalSGD rounds on a virtual clock. Each
round the members present train their local steps from θ (``sync_diloco_adaptive``: H_w
by DyLU's rule over their measured rates), then pay a quorum round trip and a ring
allreduce; the mean Δ takes one step of the server's ``OuterOptimizer``. A round that
would exceed the budget is cut to what remains. docs/algorithms.md, "What the virtual
clock charges"."""

from __future__ import annotations

import torch

from asyncdiloco.algo.outer import make_outer_optimizer
from asyncdiloco.algo.schedule import StepRateMeter, dylu_local_steps
from asyncdiloco.bench.sim import METHODS, SimConfig, SimResult, eval_point, present, step_timers, wire_numel
from asyncdiloco.bench.sim_costs import RATE_PROBE, WorkerRate, ring_allreduce_bytes, sync_round_comm_s, wire_bytes


def _probe(timer, rate: WorkerRate, t: float) -> tuple[list[float], float]:
    """A member's first steps of its first round, timed as the real worker times them:
    (their durations, the rate it reports)."""
    durations: list[float] = []
    reported = None
    while reported is None:
        d = timer.step_s(t)
        durations.append(d)
        t += d
        reported = rate.step(d)
    return durations, reported


def _cut(h: dict[int, int], remaining: int, proportional: bool) -> dict[int, int]:
    """Steps per member when the round would exceed the ``remaining`` budget."""
    total = sum(h.values())
    if total <= remaining:
        return h
    members = sorted(h)
    if proportional:
        out = {w: remaining * h[w] // total for w in members}
    else:
        out = {w: remaining // len(members) for w in members}
    for w in members[: remaining - sum(out.values())]:
        out[w] += 1
    return out


def _adaptive_steps(cfg: SimConfig, members, meter, timers, estimators, probed: dict, t: float) -> dict[int, int]:
    """H_w of each member by DyLU's rule over the rates the server has; a member without
    one probes first (its durations go into ``probed``) and runs at least those steps."""
    for r in members:
        if r.index not in meter.rates:  # no rate yet: it times its first steps
            probed[r.index], rate = _probe(timers[r.index], estimators[r.index], t)
            meter.report(r.index, rate)
    rates = {r.index: meter.rates[r.index] for r in members}
    h = dylu_local_steps(rates, cfg.local_steps)
    return {w: max(n, len(probed.get(w, ()))) for w, n in h.items()}


def _member_round(r, n: int, theta: torch.Tensor, timer, estimator: WorkerRate, probed: list, t: float) -> float:
    """Member ``r`` trains ``n`` steps from θ; returns their summed durations (seconds)."""
    durations = probed[:n]
    fresh = timer.steps_s(t + sum(durations), n - len(durations))
    for d in fresh:  # the probe's steps were seen already
        estimator.step(d)
    durations += fresh
    r.load(theta)
    r.train(n)
    compute = sum(durations)
    r.busy_s += compute
    estimator.reporting = False  # from its first vote on, each carries compute_s
    return compute


def run_sync(cfg: SimConfig, replicas, evaluator, eval_set, progress) -> SimResult:
    """Synchronous rounds (module docstring) until ``total_steps`` inner steps are done."""
    adaptive = METHODS[cfg.method].adaptive
    theta = replicas[0].flat().clone()
    outer = make_outer_optimizer(theta, cfg.outer())
    timers = step_timers(cfg)
    meter = StepRateMeter()
    estimators = [RATE_PROBE() for _ in replicas]  # each member's own (worker/base.py step_rate)
    tps = cfg.job.tokens_per_step
    curve = [eval_point(evaluator, eval_set, theta, 0, tps, 0.0, 0)]
    t, steps, rounds, pushes, next_eval = 0.0, 0, 0, 0, cfg.eval_every_steps
    n_bytes = wire_bytes("raw", wire_numel(cfg, theta.numel()))  # sync rounds travel raw
    bytes_up = bytes_down = 0.0
    comm_s = 0.0
    groups: list[int] = []
    log: list[list[int]] = []
    while steps < cfg.total_steps:
        members = [r for r in replicas if present(cfg, r.index, t)]
        if not members:  # everyone away: the round starts when the worker is back
            assert cfg.leave_rejoin is not None  # only a leave empties a round
            t = cfg.leave_rejoin[2]
            continue
        probed: dict[int, list[float]] = {}  # a new member's probe: its first steps' durations
        if adaptive:
            h = _adaptive_steps(cfg, members, meter, timers, estimators, probed, t)
        else:
            h = {r.index: cfg.local_steps for r in members}
        h = _cut(h, cfg.total_steps - steps, proportional=adaptive)
        deltas = torch.zeros_like(theta)
        compute_end = t
        ran = 0
        for r in members:
            n = h[r.index]
            if n == 0:
                continue
            compute = _member_round(r, n, theta, timers[r.index], estimators[r.index], probed.get(r.index, []), t)
            compute_end = max(compute_end, t + compute)
            deltas.add_(r.base - r.flat())
            meter.record(r.index, n, t + compute, estimators[r.index].compute_s(n, compute))  # steps / v_w
            ran += 1
        outer.step(deltas.div_(ran), version=rounds)  # mean pseudo-gradient, the server's outer code
        links = [cfg.link(r.index) for r in members if h[r.index] > 0]
        comm = sync_round_comm_s(links, n_bytes)
        t = compute_end + comm
        comm_s += comm * ran
        steps += sum(h.values())
        rounds += 1
        pushes += ran
        groups += [0] * (ran - len(groups))
        groups[ran - 1] += 1
        per_member = ring_allreduce_bytes(ran, n_bytes)
        bytes_up += per_member * ran
        bytes_down += per_member * ran
        log.append([h.get(i, 0) for i in range(len(replicas))])
        progress(steps)
        if steps >= next_eval or steps >= cfg.total_steps:
            curve.append(eval_point(evaluator, eval_set, theta, steps, tps, t, rounds))
            next_eval = (steps // cfg.eval_every_steps + 1) * cfg.eval_every_steps
    return SimResult(
        cfg,
        curve,
        curve[-1]["eval_loss"],
        t,
        [r.busy_s for r in replicas],
        rounds,
        [pushes],
        round(bytes_up),
        round(bytes_down),
        steps,
        groups,
        true_staleness_histogram=[pushes],
        outer_steps=rounds,
        comm_s=comm_s,
        local_steps_log=log,
        estimated_rates=[meter.rates.get(i) for i in range(len(replicas))] if adaptive else [],
    )
