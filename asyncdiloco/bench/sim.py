"""Virtual-clock simulator: asynchronous and synchronous DiLoCo in one process.

Workers are scheduled on a virtual clock by their seconds per inner step, but every
inner step is real training (the default job's model and data), and every algorithm is
the server's own code: asynchronous pushes go through ``ParameterServerState`` (outer
optimizer, staleness weights, Delayed Nesterov, DyLU's rates, the grouping of replies by
``schedule.GroupWindow``, push accounting) with the virtual clock injected; synchronous
rounds apply the mean pseudo-gradient with the same ``OuterOptimizer``. Runs are
deterministic for a given seed, and noise-free in time.

Methods (``METHODS``; Liu et al. 2024, arXiv 2401.09135, Table 1, and two beyond it):
``sync_localsgd``, ``sync_diloco``, ``async_nesterov``, ``async_nesterov_poly``,
``async_dn``, ``async_dn_dylu`` (the server's default), ``async_dn_dylu_barrier``,
``async_dn_dylu_overlap``, ``async_dn_dylu_blockcheck``.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

from asyncdiloco.algo.config import ASYNC_OUTER, DEFAULT_LOCAL_STEPS, SYNC_OUTER, OuterConfig
from asyncdiloco.algo.outer import make_outer_optimizer
from asyncdiloco.algo.schedule import GroupWindow
from asyncdiloco.errors import ConfigError
from asyncdiloco.job.config import JobConfig
from asyncdiloco.job.dataset import BatchStream, CharCorpus
from asyncdiloco.job.models import evaluate, lm_loss
from asyncdiloco.ps.config import ServerConfig
from asyncdiloco.ps.state import ParameterServerState
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.tensors import Manifest


@dataclasses.dataclass(frozen=True, kw_only=True)
class Method:
    """What a benchmark method sets on the server (the rest is the server's defaults)."""

    mode: str = "async"
    outer: OuterConfig = ASYNC_OUTER
    dylu: bool = False
    grouping: str = "off"
    #: Workers sync in the background and train on while their reply is held (the
    #: worker's ``--overlap``; merge rule in overlap.py).
    overlap: bool = False
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
}
SYNC_METHODS = tuple(m for m, spec in METHODS.items() if spec.mode == "sync")
ASYNC_METHODS = tuple(m for m, spec in METHODS.items() if spec.mode == "async")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SimConfig:
    """One simulated run."""

    method: str
    #: Seconds per inner step of each worker (virtual clock); its length is the worker count.
    speeds_s_per_step: tuple[float, ...]
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
    #: Speed changes: (virtual time s, worker index, new seconds per step).
    speed_changes: tuple[tuple[float, int, float], ...] = ()
    #: A worker that leaves and rejoins: (worker index, leave at s, rejoin at s).
    leave_rejoin: tuple[int, float, float] | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"method={self.method!r} is invalid: choose one of {tuple(METHODS)}")
        if not self.speeds_s_per_step or any(not s > 0 for s in self.speeds_s_per_step):
            raise ConfigError(f"speeds_s_per_step={self.speeds_s_per_step} is invalid: one positive value per worker")
        if self.total_steps < len(self.speeds_s_per_step):
            raise ConfigError(f"total_steps={self.total_steps} is invalid: must be >= the number of workers")

    def outer(self) -> OuterConfig:
        o = METHODS[self.method].outer
        if self.method == "sync_localsgd":
            return o
        return dataclasses.replace(
            o,
            lr=o.lr if self.outer_lr is None else self.outer_lr,
            momentum=o.momentum if self.outer_momentum is None else self.outer_momentum,
        )

    def server_config(self) -> ServerConfig:
        """The server configuration this run uses (in-process, virtual clock)."""
        spec = METHODS[self.method]
        return ServerConfig(
            port=0,
            mode=spec.mode,
            local_steps=self.local_steps,
            outer=self.outer(),
            dylu=spec.dylu,
            grouping=spec.grouping,
            grace_s=self.grace_s,
            lease_s=86400,
            histogram_buckets=64,
        )


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
    #: Inner steps trained, summed over workers (= config.total_steps).
    steps: int = 0
    #: group_size_histogram[k]: outer steps (sync rounds) / released push groups of k + 1 pushes.
    group_size_histogram: list[int] = dataclasses.field(default_factory=list)

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

    def merge(self, theta_g: torch.Tensor, version: int, snapshot: torch.Tensor) -> None:
        """Overlap's merge (overlap.py): θ ← θ_g' + (θ_now − θ_snapshot), θ_base ← θ_g'."""
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
    result = run(cfg, replicas, evaluator, eval_set, progress or (lambda _: None))
    if not cfg.final_on_split:
        return result
    assert result.curve[-1]["steps"] == result.steps  # the last curve point loaded the final model into evaluator
    return dataclasses.replace(result, final_eval_loss=evaluate(evaluator, cfg.job.split_set(corpus)))


def _eval_point(evaluator, eval_set, flat, steps, tokens_per_step, time_s, version) -> dict:
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


def _sync(cfg, replicas, evaluator, eval_set, progress) -> SimResult:
    """Synchronous rounds: every member runs H steps from θ, the mean Δ takes one outer step."""
    theta = replicas[0].flat().clone()
    outer = make_outer_optimizer(theta, cfg.outer())
    tps = cfg.job.tokens_per_step
    curve = [_eval_point(evaluator, eval_set, theta, 0, tps, 0.0, 0)]
    t, steps, rounds, pushes, next_eval = 0.0, 0, 0, 0, cfg.eval_every_steps
    n_bytes = theta.numel() * 4
    bytes_up = bytes_down = 0
    groups: list[int] = []
    while steps < cfg.total_steps:
        members = [r for r in replicas if _present(cfg, r.index, t)]
        if not members:  # everyone away: the round starts when the worker is back
            t = cfg.leave_rejoin[2]
            continue
        allotted = min(cfg.local_steps * len(members), cfg.total_steps - steps)
        deltas = torch.zeros_like(theta)
        round_s = 0.0
        for k, r in enumerate(members):
            h = allotted // len(members) + (1 if k < allotted % len(members) else 0)
            r.load(theta)
            r.train(h)
            compute = h * _speed(cfg, r.index, t)
            r.busy_s += compute
            round_s = max(round_s, compute)
            deltas.add_(r.base - r.flat())
        outer.step(deltas.div_(len(members)), version=rounds)  # mean pseudo-gradient, the server's outer code
        t += round_s
        steps += allotted
        rounds += 1
        pushes += len(members)
        groups += [0] * (len(members) - len(groups))
        groups[len(members) - 1] += 1
        bytes_up += n_bytes * len(members)
        bytes_down += n_bytes * len(members)
        progress(steps)
        if steps >= next_eval or steps >= cfg.total_steps:
            curve.append(_eval_point(evaluator, eval_set, theta, steps, tps, t, rounds))
            next_eval = (steps // cfg.eval_every_steps + 1) * cfg.eval_every_steps
    return SimResult(
        cfg,
        curve,
        curve[-1]["eval_loss"],
        t,
        [r.busy_s for r in replicas],
        rounds,
        [pushes],
        bytes_up,
        bytes_down,
        steps,
        groups,
    )


def _present(cfg: SimConfig, worker: int, t: float) -> bool:
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


def _async(cfg, replicas, evaluator, eval_set, progress) -> SimResult:
    """Asynchronous DiLoCo through the parameter server's own state, on a virtual clock.

    Every push goes through ``ParameterServerState.push`` (outer step, staleness, DyLU,
    grouping) with the virtual clock injected. A worker reports its inner-step rate when
    it joins (what a real worker measures over its first steps) and each push carries
    its compute time; its reply is held until the push's group is released
    (``schedule.GroupWindow``, the server's own), then the worker pulls and starts its
    next round with the H_w the server gives it.
    """
    clock = VirtualClock()
    state = ParameterServerState(cfg.server_config(), clock=clock)
    held: HeldReplies[int] = HeldReplies(state.groups.window, clock)  # replies (workers) waiting for a release
    manifest = Manifest.from_module(replicas[0].model)
    ids = [state.join(manifest, f"worker-{r.index}", 1.0 / _speed(cfg, r.index, 0.0))[0] for r in replicas]
    state.push(
        manifest.pack_flat(replicas[0].flat()), worker_id=ids[0], push_id=1, kind=pb.PUSH_KIND_INITIAL_PARAMETERS
    )
    push_ids = [2] * len(replicas)
    tps = cfg.job.tokens_per_step
    curve = [_eval_point(evaluator, eval_set, state.params, 0, tps, 0.0, 0)]
    # (push time, worker, steps still to train, their compute s, steps in the push; 0 = a rejoin)
    events: list[tuple[float, int, int, float, int]] = []
    pushed_at: dict[int, float] = {}  # overlap: when a held worker pushed
    snapshots: dict[int, torch.Tensor] = {}  # overlap: θ_local when it pushed
    unallotted = [cfg.total_steps]
    overlap = METHODS[cfg.method].overlap

    def allot(h: int) -> int:
        h = min(h, unallotted[0])
        unallotted[0] -= h
        return h

    def start(i: int, t: float) -> None:
        """Worker i's reply (or join) arrives at ``t``: it pulls and starts a round."""
        r, s = replicas[i], _speed(cfg, i, t)
        if not _present(cfg, i, t):  # away: leave now (what it trained meanwhile is lost), come back later
            state.leave(ids[i])
            pushed_at.pop(i, None)
            snapshots.pop(i, None)
            heapq.heappush(events, (cfg.leave_rejoin[2], i, 0, 0.0, 0))
            return
        h_w = state.local_steps_for(ids[i])
        ahead, began = 0, t
        if overlap and i in pushed_at:  # it trained on while its group formed, then merges
            began = pushed_at.pop(i)  # its round began at its push: the wait's steps (and the
            ahead = allot(min(h_w, math.floor((t - began) / s + 1e-9)))  # one in progress) count
            r.train(ahead)
            r.merge(state.params, state.version, snapshots.pop(i))
        else:
            r.load(state.params, state.version)
        rest = allot(h_w)  # H_w more after the merge: the round ends with the group's next one
        if ahead + rest == 0:  # the budget is spent: this worker is done (it stays registered, so
            return  # the last pushes keep Delayed Nesterov's N, as a run that is stopped would)
        finish = max(t, began + (ahead + rest) * s)  # it trains on from its push: no step is idle
        r.busy_s += (ahead + rest) * s
        heapq.heappush(events, (finish, i, rest, 0.0, ahead + rest))

    for i in range(len(replicas)):
        start(i, 0.0)
    steps, next_eval, last_push_s = 0, cfg.eval_every_steps, 0.0
    while events or held:
        deadline = held.next_deadline()
        if not events or deadline < events[0][0]:
            clock.t = max(clock.t, deadline)
            held.release_due(deadline, start)
            continue
        finish, i, h, compute, h_push = heapq.heappop(events)
        clock.t = max(clock.t, finish)
        if h_push == 0:  # a rejoin: a new registration that reports its rate, then a pull
            joined = state.join_worker(manifest, f"worker-{i}", 1.0 / _speed(cfg, i, finish))
            ids[i] = joined.worker_id  # resumed under its name: its id, numbering pushes on
            push_ids[i] = max(2, joined.last_push_id + 1)
            start(i, finish)
            continue
        r = replicas[i]
        r.train(h)
        local = r.flat()
        delta = r.base - local  # Δ = θ_base − θ_local, (N,)
        outcome = state.push(
            manifest.pack_flat(delta),
            worker_id=ids[i],
            push_id=push_ids[i],
            base_version=r.base_version,
            num_local_steps=h_push,
            compute_s=h_push * _speed(cfg, i, finish),
        )
        push_ids[i] += 1
        held.hold(outcome.group_id, i)
        h = h_push
        if overlap:
            pushed_at[i], snapshots[i] = finish, local
        steps += h
        last_push_s = finish
        held.release_due(finish, start)
        progress(steps)
        if steps >= next_eval or steps >= cfg.total_steps:
            curve.append(_eval_point(evaluator, eval_set, state.params, steps, tps, clock.t, state.version))
            next_eval = (steps // cfg.eval_every_steps + 1) * cfg.eval_every_steps
    st = state.status()
    n_bytes = manifest.total_bytes
    # The run's wall time ends with its last push: the budget is then applied.
    return SimResult(
        cfg,
        curve,
        curve[-1]["eval_loss"],
        last_push_s,
        [r.busy_s for r in replicas],
        st.version,
        list(st.staleness_histogram),
        st.bytes_pushed,
        (st.applied_pushes + len(replicas)) * n_bytes,
        steps,
        list(st.group_size_histogram),
    )


def staleness_mean(hist: list[int]) -> float:
    total = sum(hist)
    return sum(i * c for i, c in enumerate(hist)) / total if total else math.nan
