"""1,000 workers on the virtual clock: the parameter server's own state code at fleet
scale. Each simulated worker does what ``asyncdiloco worker`` does through the methods the
gRPC servicer calls (join, pull, push, the held reply, heartbeats, leave), with
heavy-tailed speeds and churn, and trains a noisy quadratic in closed form, so the cost
measured is the server's. docs/algorithms.md, "1,000 workers on the virtual clock".

    asyncdiloco bench --suite scale --workers 1000 --seed 0 --out DIR
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import logging
import math
import statistics
import time
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import torch

from asyncdiloco.algo.config import DEFAULT_LOCAL_STEPS
from asyncdiloco.algo.outer import DelayedNesterov
from asyncdiloco.algo.schedule import dylu_local_steps
from asyncdiloco.bench.sim import HeldReplies, VirtualClock
from asyncdiloco.errors import AsyncDiLoCoError, UnknownWorkerError, require
from asyncdiloco.ps.books import PushOutcome
from asyncdiloco.ps.config import ServerConfig
from asyncdiloco.ps.state import ParameterServerState
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.tensors import Manifest

R = TypeVar("R")

SPEED_DISTRIBUTIONS = ("pareto", "lognormal")
#: Model sizes (parameters, fp32) ``scale_report.measure_apply`` times besides the simulated one.
APPLY_SIZES = (1 << 20, 1 << 24)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScaleConfig:
    """One scale simulation (virtual seconds; see the module docstring)."""

    #: Workers at start, and the mean population under churn.
    workers: int = 1000
    #: Virtual seconds simulated.
    duration_s: float = 1200.0
    seed: int = 0
    #: "pareto": s_w = x_m · U^(−1/α); "lognormal": s_w = median · exp(σ Z). Seconds per inner step.
    speed_distribution: str = "pareto"
    pareto_alpha: float = 2.0
    #: x_m, the fastest worker's seconds per inner step under "pareto".
    pareto_min_s_per_step: float = 0.5
    lognormal_median_s_per_step: float = 1.0
    lognormal_sigma: float = 0.75
    #: Mean of the exponential lifetimes, virtual seconds (inf: no churn).
    mean_lifetime_s: float = 3600.0
    #: Share of departures that never call Leave (killed workers).
    crash_fraction: float = 0.5
    #: H, the fastest worker's inner steps per round (the server's default).
    local_steps: int = DEFAULT_LOCAL_STEPS
    #: Parameters of the simulated model (fp32), the size every push carries.
    numel: int = 4096
    #: The quadratic: inner learning rate γ and gradient noise σ per element per step.
    inner_lr: float = 0.1
    noise_std: float = 1.0
    #: Width of the time series' bins (pushes/s, H_w, live workers, loss), virtual seconds.
    sample_every_s: float = 10.0
    #: Model sizes ``scale_report.measure_apply`` times besides ``numel`` (parameters).
    apply_sizes: tuple[int, ...] = APPLY_SIZES

    def __post_init__(self) -> None:
        require(self.workers >= 2, "workers", self.workers, "must be >= 2")
        require(0 < self.duration_s <= 1e6, "duration_s", self.duration_s, "must be in (0, 1e6] virtual seconds")
        require(
            self.speed_distribution in SPEED_DISTRIBUTIONS,
            "speed_distribution",
            self.speed_distribution,
            f"choose one of {SPEED_DISTRIBUTIONS}",
        )
        require(self.pareto_alpha > 0, "pareto_alpha", self.pareto_alpha, "must be > 0")
        require(self.pareto_min_s_per_step > 0, "pareto_min_s_per_step", self.pareto_min_s_per_step, "must be > 0 s")
        require(
            self.lognormal_median_s_per_step > 0,
            "lognormal_median_s_per_step",
            self.lognormal_median_s_per_step,
            "must be > 0 s",
        )
        require(self.lognormal_sigma >= 0, "lognormal_sigma", self.lognormal_sigma, "must be >= 0")
        require(self.mean_lifetime_s > 0, "mean_lifetime_s", self.mean_lifetime_s, "must be > 0 (inf: no churn)")
        require(0 <= self.crash_fraction <= 1, "crash_fraction", self.crash_fraction, "must lie in [0, 1]")
        require(self.local_steps >= 1, "local_steps", self.local_steps, "H must be >= 1 inner step")
        require(self.numel >= 1, "numel", self.numel, "must be >= 1 parameter")
        require(0 < self.inner_lr < 1, "inner_lr", self.inner_lr, "must lie in (0, 1) (the curvatures are <= 1)")
        require(self.sample_every_s > 0, "sample_every_s", self.sample_every_s, "must be > 0 virtual seconds")

    def server_config(self) -> ServerConfig:
        """The server's defaults, with H and a staleness histogram that counts every τ it accepts."""
        defaults = ServerConfig(port=0)
        return ServerConfig(port=0, local_steps=self.local_steps, histogram_buckets=defaults.outer.max_staleness + 2)

    def speeds(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` seconds per inner step drawn from the configured distribution, (n,) float64."""
        if self.speed_distribution == "pareto":
            return self.pareto_min_s_per_step * (1.0 - rng.random(n)) ** (-1.0 / self.pareto_alpha)
        return self.lognormal_median_s_per_step * np.exp(self.lognormal_sigma * rng.standard_normal(n))

    def describe_speeds(self) -> str:
        if self.speed_distribution == "pareto":
            return f"Pareto(α={self.pareto_alpha:g}, x_m={self.pareto_min_s_per_step:g} s/step)"
        return f"log-normal(median {self.lognormal_median_s_per_step:g} s/step, σ={self.lognormal_sigma:g})"


class _Quadratic:
    """f(θ) = ½ Σ a_i (θ_i − θ*_i)², a_i log-uniform in [0.1, 1]; h SGD steps of rate γ with
    gradient noise N(0, σ²) per element per step give, in closed form,
    Δ = θ_0 − θ_h = (1 − (1 − γa)^h)(θ_0 − θ*) − γ Σ_j (1 − γa)^(h−1−j) ξ_j."""

    def __init__(self, cfg: ScaleConfig, gen: torch.Generator) -> None:
        self.gen = gen
        self.curv = torch.exp(torch.empty(cfg.numel).uniform_(math.log(0.1), 0.0, generator=gen))  # a, (P,)
        self.optimum = torch.randn(cfg.numel, generator=gen)  # θ*, (P,)
        self.lr, self.noise = cfg.inner_lr, cfg.noise_std
        self._by_h: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _factors(self, h: int) -> tuple[torch.Tensor, torch.Tensor]:
        if h not in self._by_h:
            r = 1.0 - self.lr * self.curv  # (P,)
            noise_std = self.lr * self.noise * torch.sqrt((1.0 - r ** (2 * h)) / (1.0 - r**2))
            self._by_h[h] = (1.0 - r**h, noise_std)
        return self._by_h[h]

    def pseudo_gradient(self, base: torch.Tensor, h: int) -> torch.Tensor:
        """Δ after ``h`` inner steps from ``base`` (θ_base, fp32 (P,)); fp32 (P,)."""
        shrink, noise_std = self._factors(h)
        return shrink * (base - self.optimum) - noise_std * torch.randn(base.numel(), generator=self.gen)

    def loss(self, theta: torch.Tensor) -> float:
        return 0.5 * float(torch.mean(self.curv * (theta - self.optimum) ** 2))


@dataclasses.dataclass
class _Worker:
    index: int
    s_per_step: float
    joins_at: float
    dies_at: float
    crashes: bool
    worker_id: int = 0
    alive: bool = False
    push_id: int = 1
    base_version: int = 0
    base: torch.Tensor | None = None
    h: int = 0
    round: int = 0  # rounds started; a push event of an older round is void
    round_start: float = 0.0
    round_end: float = math.inf  # math.inf: not training (held, or gone)
    busy_s: float = 0.0


class _CpuMeter:
    """Thread CPU seconds of the server's calls, by kind (one torch thread: all of its work)."""

    def __init__(self) -> None:
        self.cpu_s: dict[str, float] = {}
        self.wall_s: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def timed(self, kind: str, fn: Callable[[], R]) -> R:
        c0, w0 = time.thread_time(), time.perf_counter()
        try:
            return fn()
        finally:
            self.cpu_s[kind] = self.cpu_s.get(kind, 0.0) + time.thread_time() - c0
            self.wall_s[kind] = self.wall_s.get(kind, 0.0) + time.perf_counter() - w0
            self.calls[kind] = self.calls.get(kind, 0) + 1


def _bin_counts(hist: list[int]) -> list[int]:
    """A histogram with its trailing zeros dropped."""
    out = list(hist)
    while out and out[-1] == 0:
        out.pop()
    return out


def _quantile(hist: list[int], q: float, offset: int = 0) -> int:
    """The ``q`` quantile of a histogram whose bucket i counts value i + ``offset``."""
    total = sum(hist)
    if total == 0:
        return 0
    cum = list(np.cumsum(hist))
    return bisect.bisect_left(cum, q * total) + offset


def simulate(cfg: ScaleConfig, progress: Callable[[float], None] | None = None) -> dict:
    """Run ``cfg`` on the virtual clock; returns the run's record (the report's JSON line).

    Runs with one intra-op torch thread (restored afterwards), so thread CPU time is all of
    the server's work, and with the server's loggers at ERROR: killed workers' leases lapse
    by design, and the report counts them.
    """
    threads = torch.get_num_threads()
    ps_log = logging.getLogger("asyncdiloco.ps")
    level = ps_log.level
    torch.set_num_threads(1)
    ps_log.setLevel(logging.ERROR)
    try:
        return _Run(cfg).run(progress or (lambda _: None))
    finally:
        torch.set_num_threads(threads)
        ps_log.setLevel(level)


class _Run:
    """One simulation's workers, events and tallies."""

    JOIN, PUSH, HEARTBEAT, DEPART, SAMPLE = range(5)

    def __init__(self, cfg: ScaleConfig) -> None:
        self.cfg = cfg
        self.rng = np.random.default_rng(cfg.seed)
        gen = torch.Generator().manual_seed(cfg.seed)
        self.quad = _Quadratic(cfg, gen)
        self.clock = VirtualClock()
        self.state = ParameterServerState(cfg.server_config(), clock=self.clock)
        self.held: HeldReplies[tuple[int, int, PushOutcome, float]] = HeldReplies(self.state.groups.window, self.clock)
        self.manifest = Manifest.from_named_tensors([("theta", torch.zeros(cfg.numel))])
        self.heartbeat_s = self.state.config.lease_s / 3  # the worker's default period
        self.cpu = _CpuMeter()
        self.events: list[tuple[float, int, int, int, int]] = []  # (t, seq, kind, worker index, round)
        self.seq = 0
        self.workers: list[_Worker] = []
        bins = math.ceil(cfg.duration_s / cfg.sample_every_s)
        self.pushes_per_bin = [0] * bins
        self.samples: list[dict] = []
        self.h_assigned = [0] * cfg.local_steps  # H_w handed out at pulls: [n(H_w = 1), …]
        self.dn_buffers: list[int] = []  # [n(momentum updates over 1 arrival), n(2), …]
        self.refused: dict[str, int] = {}
        self.counts = {"sent": 0, "applied": 0, "joins": 0, "leaves": 0, "crashes": 0, "rejoins": 0}
        self.held_s: list[float] = []
        self.groups_seen: set[int] = set()
        self.groups_at_deadline = 0

    # ---------------------------------------------------------------- workers
    def _new_worker(self, joins_at: float) -> _Worker:
        """A worker drawn from the distributions (its Join is the caller's to schedule)."""
        cfg = self.cfg
        life = self.rng.exponential(cfg.mean_lifetime_s) if math.isfinite(cfg.mean_lifetime_s) else math.inf
        w = _Worker(
            len(self.workers),
            float(cfg.speeds(self.rng, 1)[0]),
            joins_at,
            joins_at + life,
            bool(self.rng.random() < cfg.crash_fraction),
        )
        self.workers.append(w)
        return w

    def _event(self, t: float, kind: int, index: int, round_: int = 0) -> None:
        if t <= self.cfg.duration_s:
            heapq.heappush(self.events, (t, self.seq, kind, index, round_))
            self.seq += 1

    def _join(self, w: _Worker, t: float) -> None:
        state = self.state
        joined = self.cpu.timed("join", lambda: state.join_worker(self.manifest, f"w{w.index}", 1.0 / w.s_per_step))
        w.worker_id, w.alive = joined.worker_id, True
        w.push_id = max(w.push_id, joined.last_push_id + 1)
        if joined.initialize:
            payload = self.manifest.pack_flat(torch.zeros(self.cfg.numel))
            state.intake.push(payload, worker_id=w.worker_id, push_id=w.push_id, kind=pb.PUSH_KIND_INITIAL_PARAMETERS)
            w.push_id += 1

    def _start(self, w: _Worker, t: float) -> None:
        """Pull (H_w comes in the header) and start a round of H_w inner steps."""
        state = self.state

        def pull() -> pb.PullHeader:
            source = state.open_pull(pb.PullRequest(worker_id=w.worker_id))
            state.snapshots.close_pull(source)
            state.record_pull(w.worker_id, source.header.total_bytes)
            return source.header

        header = self.cpu.timed("pull", pull)
        h, version = header.run_config.local_steps, header.version
        assert state.params is not None
        w.base, w.base_version, w.h = state.params.clone(), version, h
        self.h_assigned[min(h, self.cfg.local_steps) - 1] += 1
        w.round += 1
        w.round_start, w.round_end = t, t + h * w.s_per_step
        self._event(w.round_end, self.PUSH, w.index, w.round)

    def _push(self, w: _Worker, t: float) -> None:
        state, counts = self.state, self.counts
        w.busy_s += w.round_end - w.round_start
        w.round_end = math.inf
        assert w.base is not None
        payload = self.manifest.pack_flat(self.quad.pseudo_gradient(w.base, w.h))
        outer = state.model.outer
        arrivals = outer.arrivals if isinstance(outer, DelayedNesterov) else 0
        counts["sent"] += 1
        self.pushes_per_bin[min(len(self.pushes_per_bin) - 1, int(t / self.cfg.sample_every_s))] += 1
        push_id = w.push_id
        w.push_id += 1
        try:
            outcome = self.cpu.timed(
                "push",
                lambda: state.intake.push(
                    payload,
                    worker_id=w.worker_id,
                    push_id=push_id,
                    base_version=w.base_version,
                    num_local_steps=w.h,
                    compute_s=w.h * w.s_per_step,
                ),
            )
        except AsyncDiLoCoError as exc:  # as the servicer: counted, the worker restarts from a pull
            state.intake.count_rejected(w.worker_id, exc.reason)
            self.refused[exc.reason] = self.refused.get(exc.reason, 0) + 1
            if isinstance(exc, UnknownWorkerError):  # its lease lapsed: the worker joins again
                counts["rejoins"] += 1
                self._join(w, t)
            self._start(w, t)
            return
        counts["applied"] += 1
        if isinstance(outer, DelayedNesterov) and outer.arrivals == 0:  # a momentum update over the buffer
            while len(self.dn_buffers) <= arrivals:
                self.dn_buffers.append(0)
            self.dn_buffers[arrivals] += 1
        self.held.hold(outcome.group_id, (w.index, w.round, outcome, t))

    def _resume(self, reply: tuple[int, int, PushOutcome, float], released_at: float) -> None:
        """A group was released: its workers get their replies, pull and train on."""
        index, round_, outcome, pushed_at = reply
        if outcome.group_id not in self.groups_seen:
            self.groups_seen.add(outcome.group_id)
            self.groups_at_deadline += released_at >= self.state.groups.window.deadline(outcome.group_id)
        w = self.workers[index]
        if not w.alive or w.round != round_:
            return
        self.cpu.timed("reply", lambda: self.state.intake.reply(outcome, w.worker_id, hold=False))
        self.held_s.append(released_at - pushed_at)
        self._start(w, released_at)

    def _depart(self, w: _Worker, t: float) -> None:
        if w.round_end < math.inf:  # it dies mid-round: what it trained meanwhile is lost
            w.busy_s += t - w.round_start
        w.alive, w.round_end = False, math.inf
        if w.crashes:
            self.counts["crashes"] += 1
        else:
            self.counts["leaves"] += 1
            self.cpu.timed("leave", lambda: self.state.leave(w.worker_id))

    def _heartbeat(self, w: _Worker, t: float) -> None:
        if not w.alive:
            return
        try:
            self.cpu.timed("heartbeat", lambda: self.state.heartbeat(w.worker_id))
        except AsyncDiLoCoError as exc:
            self.refused[f"heartbeat_{exc.reason}"] = self.refused.get(f"heartbeat_{exc.reason}", 0) + 1
        self._event(t + self.heartbeat_s, self.HEARTBEAT, w.index)

    def _sample(self, t: float) -> None:
        state, reg = self.state, self.state.registry
        with state.locks.books:
            rates = reg.live_rates()
            h_w = dylu_local_steps(rates, self.cfg.local_steps)
            expected = len(reg.expected(t))
            window_s = reg.group_window_s()
        live = [w for w in self.workers if w.alive]
        hs = sorted(h_w.values())
        unthrottled = sum(1.0 / (h_w.get(w.worker_id, self.cfg.local_steps) * w.s_per_step) for w in live)
        assert state.params is not None
        self.samples.append(
            {
                "t_s": t,
                "alive": len(live),
                "registered_live": len(rates),
                "expected": expected,
                "window_s": window_s,
                "h_w": [hs[0], hs[len(hs) // 10], hs[len(hs) // 2], hs[(9 * len(hs)) // 10], hs[-1]] if hs else [],
                "unthrottled_pushes_per_s": unthrottled,
                "loss": self.quad.loss(state.params),
                "version": state.version,
            }
        )

    # ---------------------------------------------------------------- the run
    def run(self, progress: Callable[[float], None]) -> dict:
        cfg = self.cfg
        started = time.perf_counter()
        first = [self._new_worker(0.0) for _ in range(cfg.workers)]
        rate = cfg.workers / cfg.mean_lifetime_s
        t = self.rng.exponential(1.0 / rate) if rate > 0 else math.inf
        while t <= cfg.duration_s:  # Poisson joins
            self._event(t, self.JOIN, self._new_worker(t).index)
            t += self.rng.exponential(1.0 / rate)
        for w in first:  # the fleet starts together: every Join, then the first pulls
            self._join(w, 0.0)
        for w in first:
            self._after_join(w, 0.0)
        for k in range(len(self.pushes_per_bin)):
            self._event(k * cfg.sample_every_s, self.SAMPLE, -1)
        last_progress = 0.0
        while True:
            t_next = self.events[0][0] if self.events else math.inf
            deadline = self.held.next_deadline()
            if deadline < t_next and deadline <= cfg.duration_s:
                self.clock.t = max(self.clock.t, deadline)
                self.held.release_due(deadline, self._resume)
                continue
            if not self.events:
                break
            t, _, kind, index, round_ = heapq.heappop(self.events)
            self.clock.t = max(self.clock.t, t)
            self._handle(t, kind, index, round_)
            self.held.release_due(t, self._resume)
            if t - last_progress >= 1.0:
                progress(t)
                last_progress = t
        self.clock.t = cfg.duration_s
        progress(cfg.duration_s)
        return self._record(time.perf_counter() - started)

    def _handle(self, t: float, kind: int, index: int, round_: int) -> None:
        if kind == self.SAMPLE:
            self._sample(t)
            return
        w = self.workers[index]
        if kind == self.JOIN:
            self._join(w, t)
            self._after_join(w, t)
        elif kind == self.PUSH and w.alive and w.round == round_:  # else void: it died, or restarted
            self._push(w, t)
        elif kind == self.HEARTBEAT:
            self._heartbeat(w, t)
        elif kind == self.DEPART and w.alive:
            self._depart(w, t)

    def _after_join(self, w: _Worker, t: float) -> None:
        self.counts["joins"] += 1
        self._event(w.dies_at, self.DEPART, w.index)
        self._event(t + self.heartbeat_s, self.HEARTBEAT, w.index)
        self._start(w, t)

    def _record(self, wall_s: float) -> dict:
        cfg, state = self.cfg, self.state
        end = cfg.duration_s
        for w in self.workers:  # rounds still running at the end count up to it
            if w.alive and w.round_end < math.inf:
                w.busy_s += end - w.round_start
        state.groups.close()  # the open group counts as released now
        st = state.status()
        live_s = sum(max(0.0, min(w.dies_at, end) - w.joins_at) for w in self.workers if w.joins_at <= end)
        counts = dict(self.counts)
        counts["refused"] = sum(v for k, v in self.refused.items() if not k.startswith("heartbeat_"))
        counts["expired"] = sum(1 for s in st.workers if s.state == "expired")
        return {
            "kind": "simulation",
            "config": {**dataclasses.asdict(cfg), "speeds": cfg.describe_speeds()},
            "server": {
                "outer": st.outer_optimizer,
                "staleness": st.staleness_weighting,
                "lease_s": state.config.lease_s,
            },
            "real_s": wall_s,
            "pushes": counts,
            "refused_by_reason": self.refused,
            "applied_by_server": st.applied_pushes,
            **self._staleness_and_groups(st),
            "dn_buffer_histogram": self.dn_buffers,
            "dn_open_arrivals": state.model.outer.arrivals if isinstance(state.model.outer, DelayedNesterov) else 0,
            "h_w_histogram": self.h_assigned,
            "held_s": {
                "mean": statistics.fmean(self.held_s) if self.held_s else 0.0,
                "p50": statistics.median(self.held_s) if self.held_s else 0.0,
                "max": max(self.held_s, default=0.0),
            },
            "utilisation": sum(w.busy_s for w in self.workers) / live_s if live_s > 0 else 0.0,
            **self._demand_and_cpu(counts["sent"]),
            "pushes_per_bin": self.pushes_per_bin,
            "samples": self.samples,
            "divergence_warnings": st.divergence_warnings,
            "version": st.version,
        }

    def _staleness_and_groups(self, st) -> dict:
        """The record's staleness and group fields, from the server's status."""
        hist, groups = list(st.staleness_histogram), list(st.group_size_histogram)
        return {
            "staleness_histogram": _bin_counts(hist),
            "staleness": {
                "mean": sum(i * n for i, n in enumerate(hist)) / max(1, sum(hist)),
                "p50": _quantile(hist, 0.5),
                "p99": _quantile(hist, 0.99),
                "max": len(_bin_counts(hist)) - 1,
                "max_staleness": self.state.config.outer.max_staleness,
            },
            "group_size_histogram": groups,
            "groups": {
                "released": sum(groups),
                "at_deadline": self.groups_at_deadline,
                "seen": len(self.groups_seen),
                "mean_size": sum((i + 1) * n for i, n in enumerate(groups)) / max(1, sum(groups)),
                "p50": _quantile(groups, 0.5, 1),
                "max": len(groups),
            },
        }

    def _demand_and_cpu(self, sent: int) -> dict:
        """Pushes/s the workers demanded, and what one shard sustains at the CPU time measured."""
        cfg, cpu, end = self.cfg, self.cpu, self.cfg.duration_s
        per_push_cpu_s = sum(cpu.cpu_s.get(k, 0.0) for k in ("push", "reply", "pull")) / max(1, sent)
        demand = sent / end
        second_half = self.pushes_per_bin[len(self.pushes_per_bin) // 2 :]
        demand_late = sum(second_half) / (len(second_half) * cfg.sample_every_s) if second_half else 0.0
        peak = max(self.pushes_per_bin) / cfg.sample_every_s
        sustained = 1.0 / per_push_cpu_s if per_push_cpu_s > 0 else math.inf
        return {
            "demand": {
                "pushes_per_s": demand,
                "pushes_per_s_second_half": demand_late,
                "peak_pushes_per_s": peak,
                "unthrottled_pushes_per_s": statistics.fmean(s["unthrottled_pushes_per_s"] for s in self.samples),
                "heartbeats_per_s": cpu.calls.get("heartbeat", 0) / end,
            },
            "server_cpu": {
                "cpu_s": cpu.cpu_s,
                "wall_s": cpu.wall_s,
                "calls": cpu.calls,
                "per_push_cpu_s": per_push_cpu_s,
                "sustained_pushes_per_s": sustained,
                "s_needed": math.ceil(demand / sustained),
                "s_needed_peak": math.ceil(peak / sustained),
            },
        }
