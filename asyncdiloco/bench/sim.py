"""The virtual-clock simulator's shared parts: the methods (``METHODS``; Liu et al. 2024,
arXiv 2401.09135, Table 1, and beyond it), one run's configuration (``SimConfig``: a
profile plus method, budget and seed) and result (``SimResult``), the trained replica,
the virtual clock and the held replies of a grouping window. The loops are in
sim_async.py and sim_sync.py, what the clock charges in sim_costs.py, and ``simulate``
in simulate.py. docs/algorithms.md, "What the virtual clock charges"."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

from asyncdiloco.algo.config import ASYNC_OUTER, DEFAULT_LOCAL_STEPS, SYNC_OUTER, OuterConfig
from asyncdiloco.algo.schedule import GroupWindow
from asyncdiloco.bench.profiles import Profile
from asyncdiloco.bench.sim_costs import FREE_LINK, Link, StepTimer
from asyncdiloco.errors import ConfigError
from asyncdiloco.job.config import JobConfig
from asyncdiloco.job.dataset import BatchStream, CharCorpus
from asyncdiloco.job.models import evaluate, lm_loss
from asyncdiloco.ps.config import ServerConfig, SyncConfig
from asyncdiloco.wire.codec import WIRE_CODECS


@dataclasses.dataclass(frozen=True, kw_only=True)
class Method:
    """What a benchmark method sets on the server (the rest is the server's defaults)."""

    mode: str = "async"
    outer: OuterConfig = ASYNC_OUTER
    dylu: bool = False
    grouping: str = "off"
    #: Workers sync in the background and train on while their reply is held (the
    #: worker's ``--overlap``; merge rule in worker/push_pull.py).
    overlap: bool = False
    #: With ``overlap``: the next round's H_w counts from the push, the steps run while
    #: the group formed and the pull travelled included (instead of H_w more after the
    #: merge), so a worker pushes every H_w steps whatever the link costs: its
    #: communication hides behind its next round (Streaming DiLoCo's overlap, Douillard
    #: et al. 2025, arXiv 2501.18512; simulator only so far).
    rounds_from_push: bool = False
    #: Sync only: member w runs H_w = DyLU's ⌊v_w / max v · H⌋ (``dylu_local_steps``)
    #: over the members' estimated rates, so the members of a round finish together.
    adaptive: bool = False
    #: Momentum look-ahead λ (after "Momentum Look-Ahead for Asynchronous Distributed
    #: Low-Communication Training", ICLR 2025 workshop): workers start their rounds from
    #: θ − λ·η·μ·m instead of θ (algo/outer.py ``look_ahead_point``); 0 = off. Simulator
    #: only: the server's pulls do not serve it.
    look_ahead: float = 0.0
    #: One line for reports.
    doc: str = ""


#: The suite's methods (Liu et al. 2024, arXiv 2401.09135, Table 1, and one beyond it).
#: ``async_dn_dylu`` is exactly what ``asyncdiloco server`` runs with no flags.
#: The server's defaults, which the ``async_dn*`` methods run.
_SERVER_DEFAULT = ServerConfig()
assert _SERVER_DEFAULT.outer is not None  # resolved to the mode's default in __post_init__

METHODS: dict[str, Method] = {
    "sync_localsgd": Method(
        mode="sync", outer=OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0), doc="synchronous rounds, plain averaging"
    ),
    "sync_diloco": Method(mode="sync", outer=SYNC_OUTER, doc="synchronous rounds, Nesterov outer step"),
    "sync_diloco_adaptive": Method(
        mode="sync",
        outer=SYNC_OUTER,
        adaptive=True,
        doc="synchronous rounds, member w runs DyLU's H_w (proportional to its measured rate), Nesterov outer step",
    ),
    "async_nesterov": Method(outer=SYNC_OUTER, doc="every push applied on arrival with DiLoCo's outer step"),
    "async_nesterov_poly": Method(
        outer=dataclasses.replace(SYNC_OUTER, staleness="polynomial"), doc="the same, pushes weighted (1+tau)^-0.5"
    ),
    "async_dn": Method(outer=ASYNC_OUTER, grouping=_SERVER_DEFAULT.grouping, doc="Delayed Nesterov, grouping, no DyLU"),
    "async_dn_dylu": Method(
        outer=_SERVER_DEFAULT.outer,
        dylu=_SERVER_DEFAULT.dylu,
        grouping=_SERVER_DEFAULT.grouping,
        doc="the server's default: Delayed Nesterov + DyLU + grouping window",
    ),
    "async_dn_dylu_barrier": Method(
        outer=ASYNC_OUTER,
        dylu=True,
        grouping="barrier",
        doc="Delayed Nesterov + DyLU, replies held until the buffer is complete",
    ),
    "async_dn_dylu_overlap": Method(
        outer=ASYNC_OUTER,
        dylu=True,
        grouping="window",
        overlap=True,
        doc="beyond the paper: the default with workers that train on while their "
        "group forms (`asyncdiloco worker --overlap`), the steps merged into the next push",
    ),
    "async_dn_dylu_blockcheck": Method(
        outer=dataclasses.replace(ASYNC_OUTER, block_check=True),
        dylu=True,
        grouping="window",
        doc="beyond the paper: the default, each tensor of a "
        "pseudo-gradient that opposes the outer momentum damped by 1 + cos",
    ),
    "async_dn_dylu_stream": Method(
        outer=ASYNC_OUTER,
        dylu=True,
        grouping="window",
        overlap=True,
        rounds_from_push=True,
        doc="beyond the paper: the default with overlapping workers whose rounds count H_w from their "
        "push, so pushes, holds and pulls hide behind the next round",
    ),
    "async_dn_dylu_lookahead": Method(
        outer=ASYNC_OUTER,
        look_ahead=1.0,
        dylu=True,
        grouping="window",
        doc="beyond the paper: the default, workers start their rounds from the momentum "
        "look-ahead point θ − η·μ·m (simulator only; algo/outer.py ``look_ahead_point``)",
    ),
}
SYNC_METHODS = tuple(m for m, spec in METHODS.items() if spec.mode == "sync")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SimConfig(Profile):
    """One simulated run: a profile's workers (``Profile``'s fields) running ``method``."""

    method: str
    #: Budget: inner steps summed over workers, the same for every method. Steps are
    #: allotted when a round starts; a round that would exceed the budget is cut to what
    #: remains (sync: split evenly over the members, the first ones one step more).
    total_steps: int
    #: H, inner steps per round (the fastest worker's under DyLU).
    local_steps: int = DEFAULT_LOCAL_STEPS
    seed: int = 0
    job: JobConfig = dataclasses.field(
        default_factory=lambda: JobConfig(n_layer=1, n_embd=64, context_len=32, batch_size=16)
    )
    #: Outer learning rate and momentum (η, μ) replacing the method's (None: the method's).
    outer_lr: float | None = None
    outer_momentum: float | None = None
    #: Grouping window, virtual seconds (None: the server's auto window).
    grace_s: float | None = None
    #: Evaluate the global model every this many inner steps (summed over workers).
    eval_every_steps: int = 100
    #: Score the final model on the whole validation split (``JobConfig.split_set``)
    #: instead of the curve's ``eval_set``: ``final_eval_loss`` then has no sampling
    #: noise of its own (the curve keeps the cheaper set; its last point is the final
    #: model on that set).
    final_on_split: bool = False
    #: The async run's wire codec for pushes and pulls ("raw", "bf16", "int8"): the
    #: server's ``--wire-codec``; pseudo-gradients and pulled models go through it, and it
    #: sets the charged bytes. Sync rounds are always raw.
    wire_codec: str = "raw"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.method not in METHODS:
            raise ConfigError(f"method={self.method!r} is invalid: choose one of {tuple(METHODS)}")
        if self.total_steps < len(self.speeds_s_per_step):
            raise ConfigError(f"total_steps={self.total_steps} is invalid: must be >= the number of workers")
        if self.wire_codec not in WIRE_CODECS:
            raise ConfigError(f"wire_codec={self.wire_codec!r} is invalid: choose one of {WIRE_CODECS}")

    def link(self, worker: int) -> Link:
        """Worker ``worker``'s link (free when ``links`` is empty)."""
        return self.links[worker] if self.links else FREE_LINK

    def outer(self) -> OuterConfig:
        o = METHODS[self.method].outer
        if self.method == "sync_localsgd":
            return o
        return dataclasses.replace(
            o,
            lr=o.lr if self.outer_lr is None else self.outer_lr,
            momentum=o.momentum if self.outer_momentum is None else self.outer_momentum,
        )

    def server_config(self, clock: str = "virtual") -> ServerConfig:
        """The server this run uses: the method's mode, H, outer step, DyLU and grouping
        (``METHODS``), with the server's auto grouping window unless ``grace_s`` is set.

        Args:
            clock: "virtual": the in-process server of the simulator (the run's wire
                codec, leases that never expire on the virtual clock); "real": the
                server process of a real-clock run (suite_real.py), whose sync quorum
                needs every worker present (not the one away in ``leave_rejoin``) and
                waits up to 30 s, with the method's local-steps rule.
        """
        spec = METHODS[self.method]
        fields: dict = dict(
            mode=spec.mode, local_steps=self.local_steps, outer=self.outer(), dylu=spec.dylu, grouping=spec.grouping
        )
        if clock == "virtual":
            codec = self.wire_codec if spec.mode == "async" else "raw"
            return ServerConfig(
                port=0, **fields, grace_s=self.grace_s, wire_codec=codec, lease_s=86400, histogram_buckets=64
            )
        if spec.mode == "sync":
            present = len(self.speeds_s_per_step) - (
                1 if self.leave_rejoin is not None else 0
            )  # rounds go on without it
            local_steps = "adaptive" if spec.adaptive else "fixed"  # the method's rule, whatever the server's default
            fields["sync"] = SyncConfig(min_workers=present, join_timeout_s=30.0, local_steps=local_steps)
        return ServerConfig(**fields)


@dataclasses.dataclass
class SimResult:
    """Curves and counters of one run (times on the virtual clock, seconds).

    Byte counts are the charged ones: payloads of ``config.wire_params`` parameters
    under the run's wire codec (async pushes and pulls; sync: what each member sends and
    receives in the ring allreduce, raw).
    """

    config: SimConfig
    curve: list[dict]  # {steps, tokens, time_s, version, eval_loss}
    final_eval_loss: float
    wall_s: float
    busy_s: list[float]
    updates: int
    staleness_histogram: list[int]
    bytes_up: int
    bytes_down: int
    #: Inner steps trained, summed over workers (= config.total_steps).
    steps: int = 0
    #: group_size_histogram[k]: outer steps (sync rounds) / released push groups of k + 1 pushes.
    group_size_histogram: list[int] = dataclasses.field(default_factory=list)
    #: true_staleness_histogram[k]: pushes whose pseudo-gradient was applied k outer
    #: (momentum) steps after the model it started from was pulled. Outer steps, not
    #: versions: the pushes of one Delayed Nesterov group (c = 0) each bump the version,
    #: but they all start from one model and apply as one synchronous step (0 here),
    #: while a push that missed its group counts the groups it missed. Sync: all 0.
    true_staleness_histogram: list[int] = dataclasses.field(default_factory=list)
    #: Outer steps that updated the momentum: sync rounds; async: the outer optimizer's
    #: (Delayed Nesterov: completed buffers; other optimizers: every push).
    outer_steps: int = 0
    #: Seconds the workers spent in transfers (pushes, pulls; sync: quorum and
    #: allreduce), summed over workers.
    comm_s: float = 0.0
    #: H_w as run: sync, one list per round (the members' steps, by worker index, 0 for
    #: absent ones); async, one [worker, steps] per push.
    local_steps_log: list[list[int]] = dataclasses.field(default_factory=list)
    #: The rates DyLU used at the end, inner steps/s by worker index (None: unknown).
    estimated_rates: list[float | None] = dataclasses.field(default_factory=list)

    @property
    def mean_true_staleness(self) -> float:
        return staleness_mean(self.true_staleness_histogram)

    @property
    def utilisation(self) -> float:
        """Busy ÷ wall, averaged over workers."""
        return sum(self.busy_s) / (len(self.busy_s) * self.wall_s) if self.wall_s > 0 else 0.0


class Replica:
    """One worker's model, inner optimizer and data stream."""

    def __init__(self, cfg: SimConfig, corpus: CharCorpus, index: int) -> None:
        self.index = index
        self.model = cfg.job.build(corpus)
        self.params = list(self.model.parameters())
        self.inner, self.inner_lr = cfg.job.build_inner(self.params)  # the CLI worker's, keyed by this replica's step
        shards = len(cfg.speeds_s_per_step) if cfg.non_iid else 1
        self.batches = BatchStream(
            corpus, cfg.job.batch_size, cfg.job.context_len, cfg.seed, index, shard=index % shards, num_shards=shards
        )
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

    def merge(self, theta_g: torch.Tensor, version: int, snapshot: torch.Tensor) -> None:
        """Overlap's merge (worker/push_pull.py): θ ← θ_g' + (θ_now − θ_snapshot), θ_base ← θ_g'."""
        self.load(theta_g + (self.flat() - snapshot), version)
        self.base.copy_(theta_g)

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


def step_timers(cfg: SimConfig) -> list[StepTimer]:
    """Each worker's step timer: its seconds per step (with ``speed_changes``) and the
    run's noise, drawn from the worker's own RNG seeded by (seed, worker)."""
    return [
        StepTimer(cfg.noise, cfg.seed, i, functools.partial(_speed, cfg, i)) for i in range(len(cfg.speeds_s_per_step))
    ]


def wire_numel(cfg: SimConfig, numel: int) -> int:
    """Parameters the links are charged for: ``cfg.wire_params``, else the model's ``numel``."""
    return numel if cfg.wire_params is None else cfg.wire_params


def eval_point(evaluator, eval_set, flat, steps, tokens_per_step, time_s, version) -> dict:
    pos = 0
    with torch.no_grad():
        for p in evaluator.parameters():
            p.copy_(flat[pos : pos + p.numel()].view_as(p))
            pos += p.numel()
    return {
        "steps": steps,
        "tokens": steps * tokens_per_step,
        "time_s": time_s,
        "version": version,
        "eval_loss": evaluate(evaluator, eval_set),
    }


def present(cfg: SimConfig, worker: int, t: float) -> bool:
    if cfg.leave_rejoin is None or cfg.leave_rejoin[0] != worker:
        return True
    _, leave, rejoin = cfg.leave_rejoin
    return not leave <= t < rejoin


class VirtualClock:
    """The clock injected into the server's state: virtual seconds, set by the simulator."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


T = TypeVar("T")


class HeldReplies(Generic[T]):
    """Push replies the server holds until their group is released (``schedule.GroupWindow``,
    the server's own), released on the virtual clock in release order.

    Args:
        window: the state's ``groups.window``.
        clock: the state's virtual clock; a release moves it forward to the release time.
    """

    def __init__(self, window: GroupWindow, clock: VirtualClock) -> None:
        self.window = window
        self.clock = clock
        self._held: dict[int, list[T]] = {}  # group id -> replies waiting for its release

    def __bool__(self) -> bool:
        return bool(self._held)

    def hold(self, group_id: int, reply: T) -> None:
        """Hold ``reply`` (whatever the caller resumes with) until group ``group_id`` is released."""
        self._held.setdefault(group_id, []).append(reply)

    def next_deadline(self) -> float:
        """The earliest deadline of a held group, virtual seconds (inf: none held)."""
        return min((self.window.deadline(g) for g in self._held), default=math.inf)

    def release_due(self, until: float, resume: Callable[[T, float], None]) -> None:
        """Resume the replies of every group released by ``until`` (in release order):
        ``resume(reply, released_at)``."""
        while True:
            due = []
            for g in self._held:
                released_at = self.window.release_time(g) if self.window.released(g, until) else None
                due.append((math.inf if released_at is None else released_at, g))
            when, g = min(due, default=(math.inf, 0))
            if when > until:
                return
            self.clock.t = max(self.clock.t, when)
            for reply in self._held.pop(g):
                resume(reply, when)


def staleness_mean(hist: list[int]) -> float:
    total = sum(hist)
    return sum(i * c for i, c in enumerate(hist)) / total if total else math.nan
