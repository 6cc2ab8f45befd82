"""A run's end on the virtual clock: what the workers' closing pushes do to the global
model. ``simulate_run_end`` runs the server's default with workers stopped as the demo
stops them (at ``stop_s`` each finishes its step, pushes its partial round as its closing
push and leaves), and evaluates the model just before the first closing push and after
the last; ``mark_closing=False`` sends them as ordinary pushes, for the comparison in
docs/algorithms.md, "The run's end"."""

from __future__ import annotations

import dataclasses
import heapq
import math

import torch

from asyncdiloco.bench.sim import HeldReplies, Replica, SimConfig, VirtualClock, eval_point
from asyncdiloco.errors import ConfigError
from asyncdiloco.job.config import JobConfig
from asyncdiloco.job.dataset import CharCorpus
from asyncdiloco.ps.state import ParameterServerState
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.tensors import Manifest


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunEndConfig:
    """One run stopped at ``stop_s`` virtual seconds."""

    #: Seconds per inner step of each worker (the demo's slowdowns 1, 1.5, 2, 3).
    speeds_s_per_step: tuple[float, ...] = (1.0, 1.5, 2.0, 3.0)
    #: When every worker is told to stop, virtual seconds (the demo's budget or cap).
    stop_s: float = 391.0
    #: H, the fastest worker's inner steps per round.
    local_steps: int = 20
    seed: int = 0
    job: JobConfig = dataclasses.field(
        default_factory=lambda: JobConfig(n_layer=1, n_embd=64, context_len=32, batch_size=16)
    )
    #: Closing pushes carry ``PushHeader.last`` (as the library's worker sends them);
    #: False: sent as ordinary pushes (the comparison).
    mark_closing: bool = True

    def __post_init__(self) -> None:
        if not self.stop_s > 0:
            raise ConfigError(f"stop_s={self.stop_s} is invalid: give a positive number of virtual seconds")


@dataclasses.dataclass
class RunEndResult:
    """Held-out loss (nats/char) and version before the first closing push and after the last."""

    before_loss: float
    before_version: int
    final_loss: float
    final_version: int
    #: One row per closing push: (worker index, inner steps in it, the worker's H_w, N it was applied with).
    closing: list[tuple[int, int, int, int]]
    #: Inner steps and tokens the server applied, summed over the workers.
    steps: int
    tokens: int


def simulate_run_end(cfg: RunEndConfig) -> RunEndResult:
    """Run until ``cfg.stop_s`` and through the closing pushes (one torch thread, restored after)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(cfg)
    finally:
        torch.set_num_threads(threads)


def _run(cfg: RunEndConfig) -> RunEndResult:
    return _RunEnd(cfg).run()


class _RunEnd:
    """The server's default on a virtual clock, with workers pushing every H_w steps at their
    speeds until ``stop_s``, then closing."""

    def __init__(self, cfg: RunEndConfig) -> None:
        self.cfg, self.speeds = cfg, cfg.speeds_s_per_step
        self.sim = sim = SimConfig(
            method="async_dn_dylu",
            speeds_s_per_step=self.speeds,
            total_steps=len(self.speeds),
            seed=cfg.seed,
            local_steps=cfg.local_steps,
            job=dataclasses.replace(cfg.job, seed=cfg.seed),
        )
        torch.manual_seed(cfg.seed)
        corpus = CharCorpus.default()
        self.evaluator, self.eval_set = sim.job.build(corpus), sim.job.eval_set(corpus)
        self.replicas = [Replica(sim, corpus, i) for i in range(len(self.speeds))]
        self.clock = VirtualClock()
        self.state = state = ParameterServerState(sim.server_config(), clock=self.clock)
        self.held: HeldReplies[int] = HeldReplies(state.groups.window, self.clock)
        self.manifest = Manifest.from_module(self.replicas[0].model)
        self.ids = [state.join(self.manifest, f"worker-{i}", 1.0 / s)[0] for i, s in enumerate(self.speeds)]
        state.push(
            self.manifest.pack_flat(self.replicas[0].flat()),
            worker_id=self.ids[0],
            push_id=1,
            kind=pb.PUSH_KIND_INITIAL_PARAMETERS,
        )
        self.push_ids = [2] * len(self.speeds)
        self.events: list[tuple[float, int, int, int]] = []  # (push time, worker, steps in the push, its H_w)
        self.closing: list[tuple[int, int, int, int]] = []
        self.before: dict | None = None
        self.steps = 0

    def start(self, i: int, t: float) -> None:
        """Worker i's reply arrived at ``t``: it pulls; past ``stop_s`` it leaves, else trains a round."""
        state, stop_s, speed = self.state, self.cfg.stop_s, self.speeds[i]
        assert state.params is not None  # initialized before any worker starts
        self.replicas[i].load(state.params, state.version)
        if t >= stop_s:  # stopped before an inner step: nothing to push
            state.leave(self.ids[i])
            return
        h_w = state.local_steps_for(self.ids[i])
        k = min(h_w, math.ceil((stop_s - t) / speed - 1e-9))  # it stops after the step that passes stop_s
        heapq.heappush(self.events, (t + k * speed, i, k, h_w))

    def run(self) -> RunEndResult:
        clock, held, events, state = self.clock, self.held, self.events, self.state
        for i in range(len(self.speeds)):
            self.start(i, 0.0)
        while events or held:
            deadline = held.next_deadline()
            if not events or deadline < events[0][0]:
                clock.t = max(clock.t, deadline)
                held.release_due(deadline, self.start)
                continue
            t, i, k, h_w = heapq.heappop(events)
            clock.t = max(clock.t, t)
            self.push(i, t, k, h_w)
            held.release_due(t, self.start)
        final = eval_point(self.evaluator, self.eval_set, state.params, 0, 0, clock.t, state.version)
        before = self.before or final  # every worker held at the stop: no closing push
        status = state.status()
        assert status.tokens == self.steps * self.sim.job.tokens_per_step, "every applied step's tokens are counted"
        return RunEndResult(
            before_loss=before["eval_loss"],
            before_version=before["version"],
            final_loss=final["eval_loss"],
            final_version=final["version"],
            closing=self.closing,
            steps=self.steps,
            tokens=status.tokens,
        )

    def push(self, i: int, t: float, k: int, h_w: int) -> None:
        """Worker i trains its ``k`` steps and pushes at ``t``: a closing push from ``stop_s`` on."""
        state = self.state
        last = t >= self.cfg.stop_s  # its closing push: partial unless the round ended exactly at the stop
        if last and self.before is None:
            self.before = eval_point(self.evaluator, self.eval_set, state.params, 0, 0, t, state.version)
        r = self.replicas[i]
        r.train(k)
        outcome = state.push(
            self.manifest.pack_flat(r.base - r.flat()),  # Δ = θ_base − θ_local
            worker_id=self.ids[i],
            push_id=self.push_ids[i],
            base_version=r.base_version,
            num_local_steps=k,
            num_tokens=k * self.sim.job.tokens_per_step,
            compute_s=k * self.speeds[i],
            last=last and self.cfg.mark_closing,
        )
        self.push_ids[i] += 1
        self.steps += k
        if last:
            self.closing.append((i, k, h_w, outcome.num_workers))
            state.leave(self.ids[i])
        else:
            self.held.hold(outcome.group_id, i)
