"""The simulator's asynchronous loop: workers push to the parameter server's own state
(``ParameterServerState`` with the virtual clock injected), paying their links, their
noisy step times and the grouping's holds; rates are measured by each worker's own
estimator, never handed over. A round: pull, H_w inner steps (rate reports until the first
push), push, the reply held until its group is released; overlap workers train on while
held. docs/algorithms.md, "What the virtual clock charges".

``simulate_run_end`` runs the same server on the same clock with workers stopped as the
demo stops them (at ``stop_s`` each finishes its step, pushes its partial round as its
closing push and leaves; ``mark_closing=False``: as ordinary pushes), for
docs/algorithms.md, "The run's end"."""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math

import torch

from asyncdiloco.algo.outer import look_ahead_point
from asyncdiloco.bench.sim import (
    METHODS,
    HeldReplies,
    Replica,
    SimConfig,
    SimResult,
    VirtualClock,
    eval_point,
    present,
    step_timers,
    wire_numel,
)
from asyncdiloco.bench.sim_costs import RATE_PROBE, StepTimer, WorkerRate, wire_bytes
from asyncdiloco.errors import ConfigError
from asyncdiloco.job.config import JobConfig
from asyncdiloco.job.dataset import CharCorpus
from asyncdiloco.ps.state import ParameterServerState
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.codec import make_codec
from asyncdiloco.wire.tensors import Manifest

# Event kinds, in the order ties at one instant are handled.
_ARRIVE, _PULLED, _PROBE, _FINISH, _REJOIN = range(5)


@dataclasses.dataclass
class _Push:
    """A push on its way to the server."""

    delta: torch.Tensor  # Δ = θ_base − θ_local, (N,)
    steps: int
    compute_s: float
    base_version: int
    base_outer_steps: int


@dataclasses.dataclass
class _Pull:
    """A pull on its way back to the worker: the model it read at the server."""

    params: torch.Tensor
    version: int
    outer_steps: int


@dataclasses.dataclass
class _Tally:
    """The run's counters."""

    comm_s: float = 0.0
    bytes_up: int = 0
    bytes_down: int = 0
    steps: int = 0
    last_s: float = 0.0


@dataclasses.dataclass
class _Worker:
    """One simulated worker's round in progress."""

    replica: Replica
    timer: StepTimer
    began: float = 0.0
    ends: list[float] = dataclasses.field(default_factory=list)  # end time of each step of the round
    target: int = 0  # steps this round (allotted)
    fed: int = 0  # steps whose duration the rate estimator has seen
    trained: int = 0  # steps already trained (overlap: those of the wait)
    rate: WorkerRate = dataclasses.field(default_factory=RATE_PROBE)  # per registration
    base_outer_steps: int = 0
    pushed_at: float | None = None  # overlap: when a held worker pushed
    snapshot: torch.Tensor | None = None  # overlap: θ_local when it pushed

    def new_round(self, began: float) -> None:
        self.began, self.ends, self.target, self.fed, self.trained = began, [], 0, 0, 0

    def end_of(self, k: int) -> float:
        """End time of step k (1-based) of the round, sampling steps as needed."""
        while len(self.ends) < k:
            t = self.ends[-1] if self.ends else self.began
            self.ends.append(t + self.timer.step_s(t))
        return self.ends[k - 1] if k else self.began

    def feed(self) -> float | None:
        """The estimator sees the round's next step's duration; returns a rate to report, or None."""
        self.fed += 1
        return self.rate.step(self.end_of(self.fed) - self.end_of(self.fed - 1))


class _ServerOnClock:
    """The parameter server's own state on a virtual clock with the workers registered (with
    the rates they hand over, or none: each then measures its own) and the initial model
    pushed; ``loop`` hands the run's events (``events``, a heap) to ``on_event`` in time
    order, and each released reply to ``on_release``."""

    def __init__(self, cfg: SimConfig, replicas, rates: list[float] | None = None) -> None:
        self.cfg, self.replicas = cfg, replicas
        self.clock = VirtualClock()
        self.state = state = ParameterServerState(cfg.server_config(), clock=self.clock)
        self.held: HeldReplies[int] = HeldReplies(state.groups.window, self.clock)  # replies waiting for a release
        self.manifest = manifest = Manifest.from_module(replicas[0].model)
        self.ids = [
            state.join(manifest, f"worker-{r.index}", *(() if rates is None else (rates[r.index],)))[0]
            for r in replicas
        ]
        state.intake.push(
            manifest.pack_flat(replicas[0].flat()),
            worker_id=self.ids[0],
            push_id=1,
            kind=pb.PUSH_KIND_INITIAL_PARAMETERS,
        )
        self.push_ids = [2] * len(replicas)
        self.events: list[tuple] = []

    def loop(self) -> None:
        clock, held, events = self.clock, self.held, self.events
        while events or held:
            deadline = held.next_deadline()
            if not events or deadline < events[0][0]:
                clock.t = max(clock.t, deadline)
                held.release_due(deadline, self.on_release)
                continue
            event = heapq.heappop(events)
            clock.t = max(clock.t, event[0])
            self.on_event(*event)

    def on_event(self, t: float, *event) -> None:
        raise NotImplementedError

    def on_release(self, i: int, t: float) -> None:
        raise NotImplementedError


def run_async(cfg: SimConfig, replicas, evaluator, eval_set, progress) -> SimResult:
    """Asynchronous DiLoCo through the parameter server's own state, on a virtual clock
    (the round as in the module docstring)."""
    return _AsyncRun(cfg, replicas, evaluator, eval_set, progress).run()


class _AsyncRun(_ServerOnClock):
    """One asynchronous run: the workers' rounds as events (``at``), and the run's counters."""

    def __init__(self, cfg: SimConfig, replicas, evaluator, eval_set, progress) -> None:
        super().__init__(cfg, replicas)  # no rates: each worker measures its own
        self.progress, self.evaluator, self.eval_set = progress, evaluator, eval_set
        state, manifest = self.state, self.manifest
        numel = wire_numel(cfg, manifest.numel)
        self.push_bytes, self.pull_bytes = wire_bytes(cfg.wire_codec, numel), wire_bytes(cfg.wire_codec, numel)
        self.spec = METHODS[cfg.method]
        self.codec = make_codec(cfg.wire_codec, manifest)  # the server's: pushes and pulls travel through it
        self.wire = torch.empty(self.codec.wire_bytes, dtype=torch.uint8)
        self.workers = [_Worker(r, timer) for r, timer in zip(replicas, step_timers(cfg))]
        assert state.model.outer is not None  # initialised by the initial push
        self.outer = state.model.outer
        self.curve = [eval_point(evaluator, eval_set, state.params, 0, cfg.job.tokens_per_step, 0.0, 0)]
        self.seq = itertools.count()
        self.unallotted = cfg.total_steps
        self.next_eval = cfg.eval_every_steps
        self.true_hist: list[int] = []
        self.log: list[list[int]] = []
        self.acct = _Tally()

    def at(self, t: float, kind: int, i: int, data: object = None) -> None:
        heapq.heappush(self.events, (t, kind, next(self.seq), i, data))

    def allot(self, h: int) -> int:
        h = max(0, min(h, self.unallotted))
        self.unallotted -= h
        return h

    def run(self) -> SimResult:
        """Every worker pulls at 0; events and group releases in time order until none is left."""
        for i in range(len(self.workers)):
            self.pull(i, 0.0)
        self.loop()
        return self.result()

    def on_event(self, t: float, *event) -> None:  # (time, kind, seq, worker, data)
        kind, _, i, data = event
        if kind == _ARRIVE:
            assert isinstance(data, _Push)
            self.arrive(i, t, data)
            self.held.release_due(t, self.pull)
        elif kind == _PULLED:
            assert isinstance(data, _Pull)
            self.start(i, t, data)
        elif kind == _PROBE:
            assert isinstance(data, float)
            self.on_probe(i, t, data)
        elif kind == _FINISH:
            self.finish(i, t)
        else:
            self.rejoin(i, t)

    def on_release(self, i: int, t: float) -> None:
        self.pull(i, t)

    def pull(self, i: int, t: float) -> None:
        """Worker i reads the model at the server at ``t``; it has it a transfer later."""
        theta = self.state.params
        assert theta is not None
        if self.spec.look_ahead > 0:
            params = look_ahead_point(self.outer, self.state.version, torch.empty_like(theta), self.spec.look_ahead)
        else:
            params = theta.clone()
        if self.cfg.wire_codec != "raw":
            self.codec.decode(self.codec.encode(params, self.wire), params)
        cost = self.cfg.link(i).transfer_s(self.pull_bytes)
        self.acct.comm_s += cost
        self.acct.bytes_down += self.pull_bytes
        self.at(t + cost, _PULLED, i, _Pull(params, self.state.version, self.outer.momentum_steps))

    def plan(self, i: int, now: float) -> None:
        """Schedule worker i's next event (not before ``now``): a rate report, or the end of its round."""
        w = self.workers[i]
        while w.rate.reporting and w.fed < w.target:
            rate = w.feed()
            if rate is not None:
                self.at(w.end_of(w.fed), _PROBE, i, rate)
                return
        self.at(max(now, w.end_of(w.target)), _FINISH, i)

    def start(self, i: int, t: float, got: _Pull) -> None:
        """Worker i's pull completed at ``t``: it starts a round (or leaves, if away)."""
        cfg, w, r = self.cfg, self.workers[i], self.replicas[i]
        if not present(cfg, i, t):  # away: leave now (what it trained meanwhile is lost), come back later
            self.state.leave(self.ids[i])
            w.pushed_at = w.snapshot = None
            assert cfg.leave_rejoin is not None  # only a leave makes a worker absent
            self.at(cfg.leave_rejoin[2], _REJOIN, i)
            return
        h_w = self.state.local_steps_for(self.ids[i])
        ahead = 0
        if self.spec.overlap and w.pushed_at is not None:  # it trained on while its group formed, then merges
            w.new_round(w.pushed_at)  # its round began at its push: the wait's steps count
            while ahead < h_w and w.end_of(ahead + 1) <= t:
                ahead += 1
            ahead = self.allot(ahead)
            while w.fed < ahead:
                w.feed()
            r.train(ahead)
            assert w.snapshot is not None
            r.merge(got.params, got.version, w.snapshot)
            w.pushed_at = w.snapshot = None
        else:
            w.new_round(t)
            r.load(got.params, got.version)
        w.base_outer_steps = got.outer_steps
        w.trained = ahead
        w.fed = ahead
        # H_w more after the merge (the round ends with the group's next one), or H_w in all
        # from the push (``rounds_from_push``: the wait's steps count toward it)
        w.target = ahead + self.allot(h_w - ahead if self.spec.rounds_from_push else h_w)
        if w.target == 0:  # the budget is spent: this worker is done (it stays registered, so
            return  # the last pushes keep Delayed Nesterov's N, as a run that is stopped would)
        self.plan(i, t)

    def on_probe(self, i: int, t: float, rate: float) -> None:
        """Worker i reports a measured rate (heartbeat) and takes its H_w from the reply."""
        w = self.workers[i]
        self.state.heartbeat(self.ids[i], steps_per_s=rate)
        want = max(w.fed, self.state.local_steps_for(self.ids[i]))  # it cannot un-run the steps it ran
        if want < w.target:
            self.unallotted += w.target - want
            w.target = want
        elif want > w.target:
            w.target += self.allot(want - w.target)
        self.plan(i, t)

    def finish(self, i: int, t: float) -> None:
        """Worker i ran its round's last step at ``t``: its push leaves."""
        w, r = self.workers[i], self.replicas[i]
        r.train(w.target - w.trained)
        local = r.flat()
        while w.fed < w.target:
            w.feed()
        measured_s = w.end_of(w.target) - w.began  # the summed durations of its steps
        r.busy_s += measured_s
        w.rate.reporting = False  # from now on each push's compute_s carries the rate
        compute_s = w.rate.compute_s(w.target, measured_s)  # as the real worker: steps / v_w
        push = _Push(r.base - local, w.target, compute_s, r.base_version, w.base_outer_steps)
        if self.spec.overlap:
            w.pushed_at, w.snapshot = t, local
        cost = self.cfg.link(i).transfer_s(self.push_bytes)
        self.acct.comm_s += cost
        self.acct.bytes_up += self.push_bytes
        self.at(t + cost, _ARRIVE, i, push)

    def arrive(self, i: int, t: float, push: _Push) -> None:
        """Worker i's push reaches the server at ``t`` and is applied; its reply is held."""
        cfg, state, acct = self.cfg, self.state, self.acct
        gap = self.outer.momentum_steps - push.base_outer_steps
        self.true_hist.extend([0] * (gap + 1 - len(self.true_hist)))
        self.true_hist[gap] += 1
        outcome = state.intake.push(
            self.codec.encode(push.delta, self.wire),
            worker_id=self.ids[i],
            push_id=self.push_ids[i],
            base_version=push.base_version,
            num_local_steps=push.steps,
            compute_s=push.compute_s,
        )
        self.push_ids[i] += 1
        self.log.append([i, push.steps])
        self.held.hold(outcome.group_id, i)
        acct.steps += push.steps
        acct.last_s = t
        self.progress(acct.steps)
        if acct.steps >= self.next_eval or acct.steps >= cfg.total_steps:
            tps = cfg.job.tokens_per_step
            self.curve.append(
                eval_point(self.evaluator, self.eval_set, state.params, acct.steps, tps, t, state.version)
            )
            self.next_eval = (acct.steps // cfg.eval_every_steps + 1) * cfg.eval_every_steps

    def rejoin(self, i: int, t: float) -> None:
        """Worker i is back: a new registration (no rate: it probes again), then a pull."""
        joined = self.state.join_worker(self.manifest, f"worker-{i}")
        self.ids[i] = joined.worker_id  # resumed under its name: its id, numbering pushes on
        self.push_ids[i] = max(2, joined.last_push_id + 1)
        self.workers[i].rate = RATE_PROBE()  # a new registration (a restarted worker): it measures anew
        self.pull(i, t)

    def result(self) -> SimResult:
        st = self.state.status()
        rates = self.state.registry.live_rates()
        return SimResult(
            self.cfg,
            self.curve,
            self.curve[-1]["eval_loss"],
            self.acct.last_s,
            [r.busy_s for r in self.replicas],
            st.version,
            list(st.staleness_histogram),
            self.acct.bytes_up,
            self.acct.bytes_down,
            self.acct.steps,
            list(st.group_size_histogram),
            true_staleness_histogram=self.true_hist,
            outer_steps=self.outer.momentum_steps,
            comm_s=self.acct.comm_s,
            local_steps_log=self.log,
            estimated_rates=[rates.get(w) for w in self.ids],
        )


# ------------------------------------------------------------ a run's end
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
        return _RunEnd(cfg).run()
    finally:
        torch.set_num_threads(threads)


class _RunEnd(_ServerOnClock):
    """The server's default with workers (their rates handed over) pushing every H_w steps
    at their speeds until ``stop_s``, then closing."""

    def __init__(self, cfg: RunEndConfig) -> None:
        self.end, self.speeds = cfg, cfg.speeds_s_per_step
        sim = SimConfig(
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
        replicas = [Replica(sim, corpus, i) for i in range(len(self.speeds))]
        super().__init__(sim, replicas, rates=[1.0 / s for s in self.speeds])
        self.closing: list[tuple[int, int, int, int]] = []
        self.before: dict | None = None
        self.steps = 0

    def on_release(self, i: int, t: float) -> None:
        """Worker i's reply arrived at ``t``: it pulls; past ``stop_s`` it leaves, else trains a round."""
        state, stop_s, speed = self.state, self.end.stop_s, self.speeds[i]
        assert state.params is not None  # initialized before any worker starts
        self.replicas[i].load(state.params, state.version)
        if t >= stop_s:  # stopped before an inner step: nothing to push
            state.leave(self.ids[i])
            return
        h_w = state.local_steps_for(self.ids[i])
        k = min(h_w, math.ceil((stop_s - t) / speed - 1e-9))  # it stops after the step that passes stop_s
        heapq.heappush(self.events, (t + k * speed, i, k, h_w))

    def run(self) -> RunEndResult:
        for i in range(len(self.speeds)):
            self.on_release(i, 0.0)
        self.loop()
        state = self.state
        final = eval_point(self.evaluator, self.eval_set, state.params, 0, 0, self.clock.t, state.version)
        before = self.before or final  # every worker held at the stop: no closing push
        status = state.status()
        assert status.tokens == self.steps * self.cfg.job.tokens_per_step, "every applied step's tokens are counted"
        return RunEndResult(
            before_loss=before["eval_loss"],
            before_version=before["version"],
            final_loss=final["eval_loss"],
            final_version=final["version"],
            closing=self.closing,
            steps=self.steps,
            tokens=status.tokens,
        )

    def on_event(self, t: float, *event) -> None:  # (push time, worker, steps in the push, its H_w)
        """Worker i trains its ``k`` steps and pushes at ``t``: a closing push from ``stop_s`` on."""
        i, k, h_w = event
        state = self.state
        last = t >= self.end.stop_s  # its closing push: partial unless the round ended exactly at the stop
        if last and self.before is None:
            self.before = eval_point(self.evaluator, self.eval_set, state.params, 0, 0, t, state.version)
        r = self.replicas[i]
        r.train(k)
        outcome = state.intake.push(
            self.manifest.pack_flat(r.base - r.flat()),  # Δ = θ_base − θ_local
            worker_id=self.ids[i],
            push_id=self.push_ids[i],
            base_version=r.base_version,
            num_local_steps=k,
            num_tokens=k * self.cfg.job.tokens_per_step,
            compute_s=k * self.speeds[i],
            last=last and self.end.mark_closing,
        )
        self.push_ids[i] += 1
        self.steps += k
        if last:
            self.closing.append((i, k, h_w, outcome.num_workers))
            state.leave(self.ids[i])
        else:
            self.held.hold(outcome.group_id, i)
        self.held.release_due(t, self.on_release)
