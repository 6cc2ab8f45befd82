"""A run's end on the virtual clock: what the workers' closing pushes do to the global model.

``simulate_run_end`` runs the server's default (Delayed Nesterov + DyLU + grouping window,
through ``ParameterServerState`` with the virtual clock injected, as sim.py does) with
workers that are stopped the way the demo stops them: at ``stop_s`` each worker finishes
the inner step it is in, pushes its partial round as its closing push (``PushHeader.last``:
not held for a group) and leaves; a worker whose reply is still held at ``stop_s`` leaves
without pushing once it is released (it has no step to push). The global model is
evaluated on the held-out set just before the first closing push and after the last, so
the two numbers compare the same model before and after the run's end.

``mark_closing=False`` sends the closing pushes as ordinary pushes (what the server did
before ``step_closing``, algo/outer.py), for the comparison in docs/algorithms.md,
"The run's end".
"""

from __future__ import annotations

import dataclasses
import heapq
import math

import torch

from asyncdiloco.bench.sim import HeldReplies, SimConfig, VirtualClock, _eval_point, _Replica
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
    speeds = cfg.speeds_s_per_step
    sim = SimConfig(
        method="async_dn_dylu",
        speeds_s_per_step=speeds,
        total_steps=len(speeds),
        seed=cfg.seed,
        local_steps=cfg.local_steps,
        job=dataclasses.replace(cfg.job, seed=cfg.seed),
    )
    torch.manual_seed(cfg.seed)
    corpus = CharCorpus.default()
    evaluator, eval_set = sim.job.build(corpus), sim.job.eval_set(corpus)
    replicas = [_Replica(sim, corpus, i) for i in range(len(speeds))]
    clock = VirtualClock()
    state = ParameterServerState(sim.server_config(), clock=clock)
    held: HeldReplies[int] = HeldReplies(state.groups.window, clock)
    manifest = Manifest.from_module(replicas[0].model)
    ids = [state.join(manifest, f"worker-{i}", 1.0 / s)[0] for i, s in enumerate(speeds)]
    state.intake.push(
        manifest.pack_flat(replicas[0].flat()), worker_id=ids[0], push_id=1, kind=pb.PUSH_KIND_INITIAL_PARAMETERS
    )
    push_ids = [2] * len(speeds)
    events: list[tuple[float, int, int, int]] = []  # (push time, worker, steps in the push, its H_w)
    closing: list[tuple[int, int, int, int]] = []
    before: dict | None = None
    steps = 0

    def start(i: int, t: float) -> None:
        """Worker i's reply arrived at ``t``: it pulls; past ``stop_s`` it leaves, else trains a round."""
        assert state.params is not None  # initialized before any worker starts
        replicas[i].load(state.params, state.version)
        if t >= cfg.stop_s:  # stopped before an inner step: nothing to push
            state.leave(ids[i])
            return
        h_w = state.local_steps_for(ids[i])
        k = min(h_w, math.ceil((cfg.stop_s - t) / speeds[i] - 1e-9))  # it stops after the step that passes stop_s
        heapq.heappush(events, (t + k * speeds[i], i, k, h_w))

    for i in range(len(speeds)):
        start(i, 0.0)
    while events or held:
        deadline = held.next_deadline()
        if not events or deadline < events[0][0]:
            clock.t = max(clock.t, deadline)
            held.release_due(deadline, start)
            continue
        t, i, k, h_w = heapq.heappop(events)
        clock.t = max(clock.t, t)
        last = t >= cfg.stop_s  # its closing push: partial unless the round ended exactly at the stop
        if last and before is None:
            before = _eval_point(evaluator, eval_set, state.params, 0, 0, t, state.version)
        r = replicas[i]
        r.train(k)
        outcome = state.intake.push(
            manifest.pack_flat(r.base - r.flat()),  # Δ = θ_base − θ_local
            worker_id=ids[i],
            push_id=push_ids[i],
            base_version=r.base_version,
            num_local_steps=k,
            num_tokens=k * sim.job.tokens_per_step,
            compute_s=k * speeds[i],
            last=last and cfg.mark_closing,
        )
        push_ids[i] += 1
        steps += k
        if last:
            closing.append((i, k, h_w, outcome.num_workers))
            state.leave(ids[i])
        else:
            held.hold(outcome.group_id, i)
        held.release_due(t, start)
    final = _eval_point(evaluator, eval_set, state.params, 0, 0, clock.t, state.version)
    if before is None:  # every worker was held at the stop: no closing push
        before = final
    status = state.status()
    assert status.tokens == steps * sim.job.tokens_per_step, "every applied step's tokens are counted"
    return RunEndResult(
        before_loss=before["eval_loss"],
        before_version=before["version"],
        final_loss=final["eval_loss"],
        final_version=final["version"],
        closing=closing,
        steps=steps,
        tokens=status.tokens,
    )
