"""Virtual-clock simulator: asynchronous and synchronous DiLoCo in one process.

Workers are scheduled on a virtual clock by their seconds per inner step, but every
inner step is real training (the default job's model and data), and every algorithm is
the server's own code: asynchronous pushes go through ``ParameterServerState`` (outer
optimizer, staleness weights, Delayed Nesterov, DyLU's step-rate meter, push
accounting) with the virtual clock injected; synchronous rounds apply the mean
pseudo-gradient with the same ``OuterOptimizer``; the grace window uses the server's
rule (``schedule.in_grace_window``). Runs are deterministic for a given seed, and
noise-free in time.

Methods (Liu et al. 2024, arXiv 2401.09135, Table 1): ``sync_localsgd``,
``sync_diloco``, ``async_nesterov``, ``async_nesterov_poly``, ``async_dn``,
``async_dn_dylu``.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable

import torch

from asyncdiloco._proto import parameter_server_pb2 as pb
from asyncdiloco.config import OuterConfig, ServerConfig
from asyncdiloco.dataset import BatchStream, CharCorpus
from asyncdiloco.errors import ConfigError
from asyncdiloco.job import JobConfig
from asyncdiloco.models import evaluate, lm_loss
from asyncdiloco.outer import make_outer_optimizer
from asyncdiloco.ps.state import ParameterServerState
from asyncdiloco.schedule import in_grace_window
from asyncdiloco.tensors import Manifest

SYNC_METHODS = ("sync_localsgd", "sync_diloco")
ASYNC_METHODS = ("async_nesterov", "async_nesterov_poly", "async_dn", "async_dn_dylu")
METHODS = SYNC_METHODS + ASYNC_METHODS


@dataclasses.dataclass(frozen=True, kw_only=True)
class SimConfig:
    """One simulated run."""

    method: str
    #: Seconds per inner step of each worker (virtual clock); its length is the worker count.
    speeds_s_per_step: tuple[float, ...]
    #: Budget: inner steps summed over workers (equal tokens across methods).
    total_steps: int
    #: H, inner steps per round (the fastest worker's under DyLU).
    local_steps: int = 20
    seed: int = 0
    job: JobConfig = dataclasses.field(default_factory=lambda: JobConfig(n_layer=1, n_embd=64, context_len=32, batch_size=16))
    #: Outer learning rate and momentum (η, μ) of the Nesterov-based methods.
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    #: Polynomial staleness exponent a for ``async_nesterov_poly``.
    staleness_a: float = 0.5
    #: Grace window of the DN methods, virtual seconds (0 = off).
    grace_s: float = 0.0
    #: Evaluate the global model every this many inner steps (summed over workers).
    eval_every_steps: int = 100
    #: Speed changes: (virtual time s, worker index, new seconds per step).
    speed_changes: tuple[tuple[float, int, float], ...] = ()
    #: A worker that leaves and rejoins: (worker index, leave at s, rejoin at s).
    leave_rejoin: tuple[int, float, float] | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"method={self.method!r} is invalid: choose one of {METHODS}")
        if not self.speeds_s_per_step or any(not s > 0 for s in self.speeds_s_per_step):
            raise ConfigError(f"speeds_s_per_step={self.speeds_s_per_step} is invalid: one positive value per worker")
        if self.total_steps < len(self.speeds_s_per_step):
            raise ConfigError(f"total_steps={self.total_steps} is invalid: must be >= the number of workers")

    def outer(self) -> OuterConfig:
        m = self.method
        if m == "sync_localsgd":
            return OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0)
        if m in ("async_dn", "async_dn_dylu"):
            return OuterConfig(optimizer="delayed_nesterov", lr=self.outer_lr, momentum=self.outer_momentum,
                               dn_buffer=len(self.speeds_s_per_step))  # fmt: skip
        staleness = "polynomial" if m == "async_nesterov_poly" else "constant"
        return OuterConfig(optimizer="nesterov", lr=self.outer_lr, momentum=self.outer_momentum,
                           staleness=staleness, staleness_a=self.staleness_a)  # fmt: skip


@dataclasses.dataclass
class SimResult:
    """Curves and counters of one run (times on the virtual clock, seconds)."""

    config: SimConfig
    curve: list[dict]  # {steps, tokens, time_s, version, eval_loss}
    final_eval_loss: float
    wall_s: float
    busy_s: list[float]
    updates: int
    staleness_histogram: list[int]
    bytes_up: int
    bytes_down: int

    @property
    def utilisation(self) -> float:
        """Busy ÷ wall, averaged over workers."""
        return sum(self.busy_s) / (len(self.busy_s) * self.wall_s) if self.wall_s > 0 else 0.0

    def time_to(self, target: float) -> float | None:
        """Virtual seconds until the held-out loss first reached ``target`` (None: never)."""
        return next((p["time_s"] for p in self.curve if p["eval_loss"] <= target), None)


class _Replica:
    """One worker's model, inner optimizer and data stream."""

    def __init__(self, cfg: SimConfig, corpus: CharCorpus, index: int) -> None:
        self.index = index
        self.model = cfg.job.build(corpus)
        self.params = list(self.model.parameters())
        self.inner, self.inner_lr = cfg.job.build_inner(self.params)  # the CLI worker's, keyed by this replica's step
        self.batches = BatchStream(corpus, cfg.job.batch_size, cfg.job.context_len, cfg.seed, index)
        self.base = torch.zeros(sum(p.numel() for p in self.params))
        self.base_version = 0
        self.busy_s = 0.0

    def flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def load(self, flat: torch.Tensor, version: int = 0) -> None:
        pos = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(flat[pos : pos + p.numel()].view_as(p))
                pos += p.numel()
        self.base.copy_(flat)
        self.base_version = version

    def train(self, steps: int) -> None:
        for _ in range(steps):
            x, y = next(self.batches)
            lm_loss(self.model(x), y).backward()
            self.inner.step()
            self.inner_lr.step()
            self.inner.zero_grad(set_to_none=True)


def _speed(cfg: SimConfig, worker: int, t: float) -> float:
    s = cfg.speeds_s_per_step[worker]
    for when, w, new in sorted(cfg.speed_changes):
        if w == worker and when <= t:
            s = new
    return s


def simulate(cfg: SimConfig, progress: Callable[[int], None] | None = None) -> SimResult:
    """Run one method on the virtual clock until ``total_steps`` inner steps are done.

    Runs with one intra-op thread (restored afterwards): the small models are fastest
    that way, and a fixed thread count keeps float reductions, hence results, identical
    from machine to machine.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _simulate(cfg, progress)
    finally:
        torch.set_num_threads(threads)


def _simulate(cfg: SimConfig, progress: Callable[[int], None] | None) -> SimResult:
    torch.manual_seed(cfg.seed)
    cfg = dataclasses.replace(cfg, job=dataclasses.replace(cfg.job, seed=cfg.seed))  # init and data order
    corpus = CharCorpus.default()
    evaluator = cfg.job.build(corpus)
    eval_set = cfg.job.eval_set(corpus)
    replicas = [_Replica(cfg, corpus, i) for i in range(len(cfg.speeds_s_per_step))]
    run = _sync if cfg.method in SYNC_METHODS else _async
    return run(cfg, replicas, evaluator, eval_set, progress or (lambda _: None))


def _eval_point(evaluator, eval_set, flat, steps, tokens_per_step, time_s, version) -> dict:
    pos = 0
    with torch.no_grad():
        for p in evaluator.parameters():
            p.copy_(flat[pos : pos + p.numel()].view_as(p))
            pos += p.numel()
    return {"steps": steps, "tokens": steps * tokens_per_step, "time_s": time_s, "version": version,
            "eval_loss": evaluate(evaluator, eval_set)}  # fmt: skip


def _sync(cfg, replicas, evaluator, eval_set, progress) -> SimResult:
    """Synchronous rounds: every member runs H steps from θ, the mean Δ takes one outer step."""
    theta = replicas[0].flat().clone()
    outer = make_outer_optimizer(theta, cfg.outer())
    tps = cfg.job.tokens_per_step
    curve = [_eval_point(evaluator, eval_set, theta, 0, tps, 0.0, 0)]
    t, steps, rounds, pushes, next_eval = 0.0, 0, 0, 0, cfg.eval_every_steps
    n_bytes = theta.numel() * 4
    bytes_up = bytes_down = 0
    while steps < cfg.total_steps:
        members = [r for r in replicas if _present(cfg, r.index, t)]
        deltas = torch.zeros_like(theta)
        round_s = 0.0
        for r in members:
            r.load(theta)
            r.train(cfg.local_steps)
            compute = cfg.local_steps * _speed(cfg, r.index, t)
            r.busy_s += compute
            round_s = max(round_s, compute)
            deltas.add_(r.base - r.flat())
        outer.step(deltas.div_(len(members)), version=rounds)  # mean pseudo-gradient, the server's outer code
        t += round_s
        steps += cfg.local_steps * len(members)
        rounds += 1
        pushes += len(members)
        bytes_up += n_bytes * len(members)
        bytes_down += n_bytes * len(members)
        progress(steps)
        if steps >= next_eval or steps >= cfg.total_steps:
            curve.append(_eval_point(evaluator, eval_set, theta, steps, tps, t, rounds))
            next_eval += cfg.eval_every_steps
    return SimResult(cfg, curve, curve[-1]["eval_loss"], t, [r.busy_s for r in replicas], rounds, [pushes],
                     bytes_up, bytes_down)  # fmt: skip


def _present(cfg: SimConfig, worker: int, t: float) -> bool:
    if cfg.leave_rejoin is None or cfg.leave_rejoin[0] != worker:
        return True
    _, leave, rejoin = cfg.leave_rejoin
    return not leave <= t < rejoin


class _VirtualClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _async(cfg, replicas, evaluator, eval_set, progress) -> SimResult:
    """Asynchronous DiLoCo through the parameter server's own state, on a virtual clock."""
    clock = _VirtualClock()
    state = ParameterServerState(
        ServerConfig(port=0, local_steps=cfg.local_steps, outer=cfg.outer(), dylu=cfg.method == "async_dn_dylu",
                     lease_s=86400, histogram_buckets=64),
        clock=clock,
    )  # fmt: skip
    manifest = Manifest.from_module(replicas[0].model)
    ids = [state.join(manifest, f"worker-{r.index}")[0] for r in replicas]
    state.push(manifest.pack_flat(replicas[0].flat()), worker_id=ids[0], push_id=1, kind=pb.PUSH_KIND_INITIAL_PARAMETERS)
    push_ids = [2] * len(replicas)
    tps = cfg.job.tokens_per_step
    curve = [_eval_point(evaluator, eval_set, state.params, 0, tps, 0.0, 0)]
    events: list[tuple[float, int, int, float]] = []  # (finish time, worker, H_w, compute s)

    def start(i: int, t: float) -> None:
        if not _present(cfg, i, t):  # away: come back at the rejoin time
            heapq.heappush(events, (cfg.leave_rejoin[2], i, 0, 0.0))
            return
        replicas[i].load(state.params, state.version)
        h = state.run_config(ids[i]).local_steps
        compute = h * _speed(cfg, i, t)
        heapq.heappush(events, (t + compute, i, h, compute))

    for i in range(len(replicas)):
        start(i, 0.0)
    steps, next_eval, t = 0, cfg.eval_every_steps, 0.0
    while steps < cfg.total_steps and events:
        group = [heapq.heappop(events)]
        while cfg.grace_s > 0 and events and in_grace_window(group[-1][0], events[0][0], cfg.grace_s):
            group.append(heapq.heappop(events))  # arrivals inside the window: applied back to back
        for finish, i, h, compute in group:
            if h == 0:  # a rejoin, not a push
                continue
            r = replicas[i]
            r.train(h)
            r.busy_s += compute
            clock.t = finish
            delta = r.base - r.flat()  # Δ = θ_base − θ_local, (N,)
            state.push(manifest.pack_flat(delta), worker_id=ids[i], push_id=push_ids[i], base_version=r.base_version,
                       num_local_steps=h)
            push_ids[i] += 1
            steps += h
        # The server holds replies until the window closes; then every worker in it pulls.
        t = group[-1][0] + cfg.grace_s
        for _, i, _, _ in group:
            start(i, t)
        progress(steps)
        if steps >= next_eval or steps >= cfg.total_steps:
            curve.append(_eval_point(evaluator, eval_set, state.params, steps, tps, t, state.version))
            next_eval += cfg.eval_every_steps
    st = state.status()
    n_bytes = manifest.total_bytes
    return SimResult(cfg, curve, curve[-1]["eval_loss"], t, [r.busy_s for r in replicas], st.version,
                     list(st.staleness_histogram), st.bytes_pushed, (st.applied_pushes + len(replicas)) * n_bytes)  # fmt: skip


def staleness_mean(hist: list[int]) -> float:
    total = sum(hist)
    return sum(i * c for i, c in enumerate(hist)) / total if total else math.nan
