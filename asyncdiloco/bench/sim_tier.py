"""Two regions on the virtual clock: one flat parameter server (``flat``) against a
hierarchical tier (``tier``: a regional server per region, pushing every K regional pushes
to a global server that averages the regions in), with the same workers, speeds, seeds, H
and budget; region B's transfers cross a slow link. Training and every apply are real, as
in sim_async.py. docs/algorithms.md, "Hierarchical tier"."""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections.abc import Callable

import torch

from asyncdiloco.algo.config import ASYNC_OUTER, DEFAULT_LOCAL_STEPS, OuterConfig
from asyncdiloco.bench.sim import Replica, SimConfig, VirtualClock, eval_point
from asyncdiloco.bench.sim_costs import Link
from asyncdiloco.errors import ConfigError
from asyncdiloco.job.config import JobConfig
from asyncdiloco.job.dataset import CharCorpus
from asyncdiloco.ps.config import ServerConfig
from asyncdiloco.ps.state import ParameterServerState
from asyncdiloco.ps.tier.rebase import DEFAULT_PARENT_EVERY, rebase_onto, take_snapshot
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.tensors import Manifest

TIER_METHODS = ("flat", "tier")


#: name -> worker speeds (s/step), each worker's region (0 = A, next to the server; 1 = B),
#: the links inside a region and between the regions. The default job's model is 60480
#: fp32 parameters (241,920 bytes): the slow link moves it in 0.5 + 4.8 s, a quarter of
#: a 20-step round at 1 s/step; the fast link in 0.012 s.
REGION_PROFILES: dict[str, dict] = {
    "two_region": {
        "speeds": (1.0, 1.0, 1.0, 1.0),
        "regions": (0, 0, 1, 1),
        "fast": Link(latency_s=0.01, bandwidth_Bps=100e6),
        "slow": Link(latency_s=0.5, bandwidth_Bps=50e3),
    },
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class TierSimConfig:
    """One two-region run: ``method`` "flat" or "tier" on ``profile``."""

    method: str
    profile: str = "two_region"
    #: Inner steps summed over workers (the same budget for both methods).
    total_steps: int = 4000
    local_steps: int = DEFAULT_LOCAL_STEPS
    #: K: regional pushes between two pushes upward (tier only).
    every: int = DEFAULT_PARENT_EVERY
    seed: int = 0
    eval_every_steps: int = 40
    job: JobConfig = dataclasses.field(
        default_factory=lambda: JobConfig(n_layer=1, n_embd=64, context_len=32, batch_size=16)
    )
    #: The flat and regional servers' outer optimizer (the server's default).
    outer: OuterConfig = ASYNC_OUTER
    #: The tier's global server's outer optimizer (the server's default: it averages the
    #: regions' pushes in whatever it is; it would step a direct worker's).
    global_outer: OuterConfig = ASYNC_OUTER

    def __post_init__(self) -> None:
        if self.method not in TIER_METHODS:
            raise ConfigError(f"method={self.method!r} is invalid: choose one of {TIER_METHODS}")
        if self.profile not in REGION_PROFILES:
            raise ConfigError(f"profile={self.profile!r} is unknown: choose one of {sorted(REGION_PROFILES)}")
        if self.every < 1:
            raise ConfigError(f"every={self.every} is invalid: K must be >= 1 regional push")
        if self.total_steps < len(REGION_PROFILES[self.profile]["speeds"]):
            raise ConfigError(f"total_steps={self.total_steps} is invalid: must be >= the number of workers")

    def server_config(self) -> ServerConfig:
        """The flat server's and each regional server's configuration."""
        return ServerConfig(
            port=0, local_steps=self.local_steps, outer=self.outer, dylu=True, grouping="off", lease_s=86400
        )


@dataclasses.dataclass
class TierSimResult:
    """Curve and counters of one run (virtual seconds; bytes are payload bytes)."""

    config: TierSimConfig
    curve: list[dict]  # {steps, tokens, time_s, version, eval_loss}
    final_eval_loss: float
    wall_s: float
    steps: int
    #: Bytes that crossed the slow link (both directions), and all links together.
    slow_link_bytes: int
    total_bytes: int
    #: Pushes the workers made; pushes upward (tier; 0 for flat).
    worker_pushes: int
    upward_pushes: int


class _Region:
    """A regional server of the tier and its link state (upstream.py's, on the virtual clock)."""

    def __init__(self, state: ParameterServerState, theta0: torch.Tensor, worker_id: int) -> None:
        self.state = state
        self.base = theta0.clone()
        self.worker_id = worker_id  # at the global server
        self.push_id = 1
        self.parent_version = 0
        self.mark = 0  # regional applied pushes at the last cut
        self.steps_applied = 0  # inner steps of the regional pushes since the last cut
        self.in_flight = False


def simulate_tier(cfg: TierSimConfig, progress: Callable[[int], None] | None = None) -> TierSimResult:
    """Run ``cfg`` to its budget (one torch thread, restored afterwards, as simulate.py does)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _Run(cfg, progress or (lambda _: None)).run()
    finally:
        torch.set_num_threads(threads)


class _Run:
    def __init__(self, cfg: TierSimConfig, progress: Callable[[int], None]) -> None:
        torch.manual_seed(cfg.seed)
        self.cfg = cfg = dataclasses.replace(cfg, job=dataclasses.replace(cfg.job, seed=cfg.seed))
        self.progress = progress
        prof = REGION_PROFILES[cfg.profile]
        self.speeds, self.where = prof["speeds"], prof["regions"]
        self.fast, self.slow = prof["fast"], prof["slow"]
        corpus = CharCorpus.default()
        self.evaluator, self.eval_set = cfg.job.build(corpus), cfg.job.eval_set(corpus)
        shim = SimConfig(
            method="async_dn_dylu", speeds_s_per_step=self.speeds, total_steps=cfg.total_steps, job=cfg.job,
            seed=cfg.seed,
        )  # fmt: skip
        self.replicas = [Replica(shim, corpus, i) for i in range(len(self.speeds))]  # the sim's workers
        self.manifest = Manifest.from_module(self.replicas[0].model)
        self.n_bytes = self.manifest.total_bytes
        self.clock = VirtualClock()
        self.events: list[tuple[float, int, str, tuple]] = []
        self.seq = itertools.count()
        self.unallotted = cfg.total_steps
        self.slow_bytes = self.total_bytes = 0
        self.worker_pushes = self.upward = 0
        self.steps_pushed = self.steps_global = 0
        self.next_eval = cfg.eval_every_steps
        self.last_apply_s = 0.0
        theta0 = self.replicas[0].flat()
        self.theta0 = theta0
        if cfg.method == "flat":
            self.top = self._server(cfg.server_config(), theta0)
            self.server_of = [self.top] * len(self.speeds)
            self.regions: list[_Region] = []
        else:
            top = ServerConfig(port=0, outer=cfg.global_outer, grouping="off", dylu=False, lease_s=86400)
            self.top = self._server(top, theta0)
            self.regions = []
            for r in range(2):
                wid = self.top.join_worker(self.manifest, f"region-{r}", region=True).worker_id
                self.regions.append(_Region(self._server(cfg.server_config(), theta0), theta0, wid))
            self.server_of = [self.regions[self.where[i]].state for i in range(len(self.speeds))]
        self.ids = [
            self.server_of[i].join(self.manifest, f"worker-{i}", 1.0 / self.speeds[i])[0]
            for i in range(len(self.speeds))
        ]
        self.push_ids = [1] * len(self.speeds)
        self.curve = [eval_point(self.evaluator, self.eval_set, self.top.params, 0, cfg.job.tokens_per_step, 0.0, 0)]

    def _server(self, config: ServerConfig, theta0: torch.Tensor) -> ParameterServerState:
        """A state on the virtual clock, initialized with θ_0 (by a worker that then leaves)."""
        state = ParameterServerState(config, clock=self.clock)
        init = state.join(self.manifest, "initializer")[0]
        state.intake.push(
            self.manifest.pack_flat(theta0), worker_id=init, push_id=1, kind=pb.PUSH_KIND_INITIAL_PARAMETERS
        )
        state.leave(init)
        return state

    def _link(self, worker: int) -> Link:
        """The worker's path to its server (flat: B is far; tier: every worker is near)."""
        return self.slow if self.cfg.method == "flat" and self.where[worker] == 1 else self.fast

    def _region_link(self, region: int) -> Link:
        return self.slow if region == 1 else self.fast

    def _carry(self, link: Link, num_bytes: int) -> float:
        self.total_bytes += num_bytes
        if link is self.slow:
            self.slow_bytes += num_bytes
        return link.transfer_s(num_bytes)

    def _at(self, t: float, kind: str, *args) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, args))

    # ------------------------------------------------------------------ run
    def run(self) -> TierSimResult:
        for i in range(len(self.speeds)):
            self._start(i, 0.0, self.server_of[i].model.theta.clone(), 0)
        while self.events:
            t, _, kind, args = heapq.heappop(self.events)
            self.clock.t = max(self.clock.t, t)
            getattr(self, f"_on_{kind}")(t, *args)
            if not self.events and self.regions:
                self._flush(t)
        cfg = self.cfg
        return TierSimResult(
            cfg, self.curve, self.curve[-1]["eval_loss"], self.last_apply_s, self.steps_global,
            self.slow_bytes, self.total_bytes, self.worker_pushes, self.upward,
        )  # fmt: skip

    def _start(self, i: int, t: float, theta: torch.Tensor, version: int) -> None:
        """Worker i has the model it pulled: it trains its next round (or is done)."""
        r = self.replicas[i]
        r.load(theta, version)
        h = min(self.server_of[i].local_steps_for(self.ids[i]), self.unallotted)
        self.unallotted -= h
        if h > 0:
            self._at(t + h * self.speeds[i], "round", i, h)

    def _on_round(self, t: float, i: int, h: int) -> None:
        r = self.replicas[i]
        r.train(h)
        delta = r.base - r.flat()
        self._at(t + self._carry(self._link(i), self.n_bytes), "push", i, delta, r.base_version, h)

    def _on_push(self, t: float, i: int, delta: torch.Tensor, base_version: int, h: int) -> None:
        state = self.server_of[i]
        state.intake.push(
            self.manifest.pack_flat(delta), worker_id=self.ids[i], push_id=self.push_ids[i],
            base_version=base_version, num_local_steps=h, compute_s=h * self.speeds[i],
        )  # fmt: skip
        self.push_ids[i] += 1
        self.worker_pushes += 1
        self.steps_pushed += h
        self.progress(self.steps_pushed)
        pulled = (state.model.theta.clone(), state.version)
        self._at(t + self._carry(self._link(i), self.n_bytes), "pull", i, *pulled)
        if self.regions:
            region = self.regions[self.where[i]]
            region.steps_applied += h
            if state.counters.applied_pushes - region.mark >= self.cfg.every:
                self._cut(t, self.where[i])
        else:
            self._applied(t, h)

    def _on_pull(self, t: float, i: int, theta: torch.Tensor, version: int) -> None:
        self._start(i, t, theta, version)

    # ------------------------------------------------------------------ the tier
    def _cut(self, t: float, r: int) -> None:
        """Region r cuts a push upward (unless one is under way)."""
        region = self.regions[r]
        if region.in_flight:
            return
        snapshot, (applied, _) = take_snapshot(region.state)
        steps, region.steps_applied, region.mark = region.steps_applied, 0, applied
        region.in_flight = True
        delta = region.base - snapshot
        self._at(t + self._carry(self._region_link(r), self.n_bytes), "up", r, delta, snapshot, steps)

    def _on_up(self, t: float, r: int, delta: torch.Tensor, snapshot: torch.Tensor, steps: int) -> None:
        region = self.regions[r]
        self.top.intake.push(
            self.manifest.pack_flat(delta), worker_id=region.worker_id, push_id=region.push_id,
            base_version=region.parent_version, num_local_steps=steps,
        )  # fmt: skip
        region.push_id += 1
        self.upward += 1
        self._applied(t, steps)
        pulled = (self.top.model.theta.clone(), self.top.version)
        self._at(t + self._carry(self._region_link(r), self.n_bytes), "down", r, *pulled, snapshot)

    def _on_down(self, t: float, r: int, theta_g: torch.Tensor, version: int, snapshot: torch.Tensor) -> None:
        region = self.regions[r]
        rebase_onto(region.state, theta_g, snapshot)
        region.base, region.parent_version, region.in_flight = theta_g, version, False
        if region.state.counters.applied_pushes - region.mark >= self.cfg.every:
            self._cut(t, r)

    def _flush(self, t: float) -> None:
        """Every worker is done: each region pushes what it has not pushed yet."""
        for r, region in enumerate(self.regions):
            if region.state.counters.applied_pushes > region.mark and not region.in_flight:
                self._cut(t, r)

    def _applied(self, t: float, steps: int) -> None:
        """``steps`` more inner steps reached the evaluated model at ``t``."""
        self.steps_global += steps
        self.last_apply_s = t
        cfg = self.cfg
        if self.steps_global >= self.next_eval or self.steps_global >= cfg.total_steps:
            point = eval_point(
                self.evaluator, self.eval_set, self.top.params, self.steps_global, cfg.job.tokens_per_step, t,
                self.top.version,
            )  # fmt: skip
            self.curve.append(point)
            self.next_eval = (self.steps_global // cfg.eval_every_steps + 1) * cfg.eval_every_steps
