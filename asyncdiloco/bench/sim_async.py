"""The simulator's asynchronous loop: workers push to the parameter server's own state on
a virtual clock, paying their links, their noisy step times and the grouping's holds.

A worker's round (``run_async``):

1. It starts when its pull completes, from the model it pulled (``_Worker.start``), and
   runs H_w inner steps (``state.local_steps_for``, DyLU's rule over the rates the server
   has). Each step's duration comes from the worker's ``StepTimer``.
2. Every step's duration feeds the worker's estimator (``RATE_PROBE``: the real worker's
   ``InnerStepRate``, first step untimed, mean of the last 16 timed steps without the
   longest). Until the first push of its registration it reports the rate every 3 timed
   steps with a heartbeat, taking its new H_w from the server (it never runs fewer steps than it has
   already run). No rate is handed over at join.
3. Its push leaves at the round's last step and reaches the server
   ``link.transfer_s(push bytes)`` = latency + bytes / bandwidth later; the server applies
   it then (``state.intake.push`` with ``compute_s`` = its steps at the estimated rate, as the
   real worker sends it, which feeds the server's ``StepRateMeter``) and holds the reply until its group is released
   (``schedule.GroupWindow``). The worker then pulls: latency + bytes / bandwidth, and
   starts its next round. The default worker idles from its push to its pull's end; the
   overlap worker (``--overlap``) trains on and merges (overlap.py), then runs H_w more
   steps (``rounds_from_push``: H_w in all, counted from its push).

The run's wall time ends when the last push is applied.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools

import torch

from asyncdiloco.algo.outer import look_ahead_point
from asyncdiloco.bench.sim import (
    METHODS,
    HeldReplies,
    SimConfig,
    SimResult,
    VirtualClock,
    _eval_point,
    _present,
    _Replica,
    step_timers,
    wire_numel,
)
from asyncdiloco.bench.sim_costs import RATE_PROBE, StepTimer, WorkerRate, wire_bytes
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

    replica: _Replica
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


def run_async(cfg: SimConfig, replicas, evaluator, eval_set, progress) -> SimResult:
    """Asynchronous DiLoCo through the parameter server's own state, on a virtual clock
    (the round as in the module docstring)."""
    clock = VirtualClock()
    state = ParameterServerState(cfg.server_config(), clock=clock)
    held: HeldReplies[int] = HeldReplies(state.groups.window, clock)  # replies (workers) waiting for a release
    manifest = Manifest.from_module(replicas[0].model)
    numel = wire_numel(cfg, manifest.numel)
    push_bytes, pull_bytes = wire_bytes(cfg.wire_codec, numel), wire_bytes(cfg.wire_codec, numel)
    spec = METHODS[cfg.method]
    codec = make_codec(cfg.wire_codec, manifest)  # the server's: pushes and pulls travel through it
    wire = torch.empty(codec.wire_bytes, dtype=torch.uint8)
    workers = [_Worker(r, timer) for r, timer in zip(replicas, step_timers(cfg))]
    ids = [state.join(manifest, f"worker-{r.index}")[0] for r in replicas]  # no rate: each measures its own
    state.intake.push(
        manifest.pack_flat(replicas[0].flat()), worker_id=ids[0], push_id=1, kind=pb.PUSH_KIND_INITIAL_PARAMETERS
    )
    outer = state.model.outer
    assert outer is not None  # initialised by the push above
    push_ids = [2] * len(replicas)
    tps = cfg.job.tokens_per_step
    curve = [_eval_point(evaluator, eval_set, state.params, 0, tps, 0.0, 0)]
    seq = itertools.count()
    events: list[tuple[float, int, int, int, object]] = []  # (time, kind, seq, worker, data)
    unallotted = [cfg.total_steps]
    true_hist: list[int] = []
    log: list[list[int]] = []
    acct = _Tally()

    def at(t: float, kind: int, i: int, data: object = None) -> None:
        heapq.heappush(events, (t, kind, next(seq), i, data))

    def allot(h: int) -> int:
        h = max(0, min(h, unallotted[0]))
        unallotted[0] -= h
        return h

    def pull(i: int, t: float) -> None:
        """Worker i reads the model at the server at ``t``; it has it a transfer later."""
        theta = state.params
        assert theta is not None
        if spec.look_ahead > 0:
            params = look_ahead_point(outer, state.version, torch.empty_like(theta), spec.look_ahead)
        else:
            params = theta.clone()
        if cfg.wire_codec != "raw":
            codec.decode(codec.encode(params, wire), params)
        cost = cfg.link(i).transfer_s(pull_bytes)
        acct.comm_s += cost
        acct.bytes_down += pull_bytes
        at(t + cost, _PULLED, i, _Pull(params, state.version, outer.momentum_steps))

    def plan(i: int, now: float) -> None:
        """Schedule worker i's next event (not before ``now``): a rate report, or the end of its round."""
        w = workers[i]
        while w.rate.reporting and w.fed < w.target:
            rate = w.feed()
            if rate is not None:
                at(w.end_of(w.fed), _PROBE, i, rate)
                return
        at(max(now, w.end_of(w.target)), _FINISH, i)

    def start(i: int, t: float, got: _Pull) -> None:
        """Worker i's pull completed at ``t``: it starts a round (or leaves, if away)."""
        w, r = workers[i], replicas[i]
        if not _present(cfg, i, t):  # away: leave now (what it trained meanwhile is lost), come back later
            state.leave(ids[i])
            w.pushed_at = w.snapshot = None
            assert cfg.leave_rejoin is not None  # only a leave makes a worker absent
            at(cfg.leave_rejoin[2], _REJOIN, i)
            return
        h_w = state.local_steps_for(ids[i])
        ahead = 0
        if spec.overlap and w.pushed_at is not None:  # it trained on while its group formed, then merges
            w.new_round(w.pushed_at)  # its round began at its push: the wait's steps count
            while ahead < h_w and w.end_of(ahead + 1) <= t:
                ahead += 1
            ahead = allot(ahead)
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
        w.target = ahead + allot(h_w - ahead if spec.rounds_from_push else h_w)
        if w.target == 0:  # the budget is spent: this worker is done (it stays registered, so
            return  # the last pushes keep Delayed Nesterov's N, as a run that is stopped would)
        plan(i, t)

    def on_probe(i: int, t: float, rate: float) -> None:
        """Worker i reports a measured rate (heartbeat) and takes its H_w from the reply."""
        w = workers[i]
        state.heartbeat(ids[i], steps_per_s=rate)
        want = max(w.fed, state.local_steps_for(ids[i]))  # it cannot un-run the steps it ran
        if want < w.target:
            unallotted[0] += w.target - want
            w.target = want
        elif want > w.target:
            w.target += allot(want - w.target)
        plan(i, t)

    def finish(i: int, t: float) -> None:
        """Worker i ran its round's last step at ``t``: its push leaves."""
        w, r = workers[i], replicas[i]
        r.train(w.target - w.trained)
        local = r.flat()
        while w.fed < w.target:
            w.feed()
        measured_s = w.end_of(w.target) - w.began  # the summed durations of its steps
        r.busy_s += measured_s
        w.rate.reporting = False  # from now on each push's compute_s carries the rate
        compute_s = w.rate.compute_s(w.target, measured_s)  # as the real worker: steps / v_w
        push = _Push(r.base - local, w.target, compute_s, r.base_version, w.base_outer_steps)
        if spec.overlap:
            w.pushed_at, w.snapshot = t, local
        cost = cfg.link(i).transfer_s(push_bytes)
        acct.comm_s += cost
        acct.bytes_up += push_bytes
        at(t + cost, _ARRIVE, i, push)

    def arrive(i: int, t: float, push: _Push) -> None:
        """Worker i's push reaches the server at ``t`` and is applied; its reply is held."""
        gap = outer.momentum_steps - push.base_outer_steps
        true_hist.extend([0] * (gap + 1 - len(true_hist)))
        true_hist[gap] += 1
        outcome = state.intake.push(
            codec.encode(push.delta, wire),
            worker_id=ids[i],
            push_id=push_ids[i],
            base_version=push.base_version,
            num_local_steps=push.steps,
            compute_s=push.compute_s,
        )
        push_ids[i] += 1
        log.append([i, push.steps])
        held.hold(outcome.group_id, i)
        acct.steps += push.steps
        acct.last_s = t
        progress(acct.steps)
        if acct.steps >= next_eval[0] or acct.steps >= cfg.total_steps:
            curve.append(_eval_point(evaluator, eval_set, state.params, acct.steps, tps, t, state.version))
            next_eval[0] = (acct.steps // cfg.eval_every_steps + 1) * cfg.eval_every_steps

    def rejoin(i: int, t: float) -> None:
        """Worker i is back: a new registration (no rate: it probes again), then a pull."""
        joined = state.join_worker(manifest, f"worker-{i}")
        ids[i] = joined.worker_id  # resumed under its name: its id, numbering pushes on
        push_ids[i] = max(2, joined.last_push_id + 1)
        workers[i].rate = RATE_PROBE()  # a new registration (a restarted worker): it measures anew
        pull(i, t)

    next_eval = [cfg.eval_every_steps]
    for i in range(len(workers)):
        pull(i, 0.0)
    while events or held:
        deadline = held.next_deadline()
        if not events or deadline < events[0][0]:
            clock.t = max(clock.t, deadline)
            held.release_due(deadline, lambda i, when: pull(i, when))
            continue
        t, kind, _, i, data = heapq.heappop(events)
        clock.t = max(clock.t, t)
        if kind == _ARRIVE:
            assert isinstance(data, _Push)
            arrive(i, t, data)
            held.release_due(t, lambda j, when: pull(j, when))
        elif kind == _PULLED:
            assert isinstance(data, _Pull)
            start(i, t, data)
        elif kind == _PROBE:
            assert isinstance(data, float)
            on_probe(i, t, data)
        elif kind == _FINISH:
            finish(i, t)
        else:
            rejoin(i, t)
    st = state.status()
    rates = state.registry.live_rates() if hasattr(state, "registry") else {}
    return SimResult(
        cfg,
        curve,
        curve[-1]["eval_loss"],
        acct.last_s,
        [r.busy_s for r in replicas],
        st.version,
        list(st.staleness_histogram),
        acct.bytes_up,
        acct.bytes_down,
        acct.steps,
        list(st.group_size_histogram),
        true_staleness_histogram=true_hist,
        outer_steps=outer.momentum_steps,
        comm_s=acct.comm_s,
        local_steps_log=log,
        estimated_rates=[rates.get(w) for w in ids],
    )
