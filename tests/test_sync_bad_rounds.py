"""Sync rounds that can be neither poisoned nor crashed by one member: a non-finite or
huge pseudo-gradient makes every member skip the round, and the skip names the member;
a member with a longer allreduce buffer fails the round on every member instead of
aborting their processes in gloo.

A real gRPC server in this process; SyncDiLoCoWorkers on threads building real gloo
groups on 127.0.0.1 (as test_sync.py), or in processes of their own (_sync_member.py)
where a failure could abort a process."""

from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys

import pytest
import torch
from helpers import flat, run_threads
from test_sync import inner_opt, make_model, train

from asyncdiloco.algo.config import OuterConfig
from asyncdiloco.ps.config import SyncConfig
from asyncdiloco.worker.config import SyncWorkerConfig, WorkerConfig
from asyncdiloco.worker.sync_worker import SyncDiLoCoWorker

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_thread")]

HERE = pathlib.Path(__file__).parent


@pytest.fixture
def sgd_server(start_server):
    """A sync server with LocalSGD's outer step (η = 1, μ = 0) and H = 2."""

    def make(**sync):
        return start_server(
            mode="sync",
            outer=OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0),
            local_steps=2,
            lease_s=30.0,
            sync=SyncConfig(join_timeout_s=5.0, round_timeout_s=20.0, **sync),
        )

    return make


class PoisonedSyncWorker(SyncDiLoCoWorker):
    """A member whose model holds ``value`` in its first weight when it enters round
    ``at_round`` (1-based), once: a diverged replica (Inf, NaN) or a runaway one (1e30)."""

    def __init__(self, *args, value: float, at_round: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.value, self.at_round, self.fired = value, at_round, False

    def _take_pseudo_gradient(self) -> torch.Tensor:
        if not self.fired and self.round + 1 == self.at_round:
            self.fired = True
            with torch.no_grad():
                next(self.model.parameters()).view(-1)[0] = self.value
        return super()._take_pseudo_gradient()


class MismatchedSyncWorker(SyncDiLoCoWorker):
    """A member whose contribution to round ``at_round`` differs from what it announced:
    it agrees with its honest, finite ‖Δ‖∞, then puts ``value`` into its buffer before the
    sum (a faulty or altered member, or memory corrupted between the two)."""

    def __init__(self, *args, value: float, at_round: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.value, self.at_round, self.fired = value, at_round, False

    def _agree(self, pg, q) -> None:
        super()._agree(pg, q)
        if not self.fired and q.round + 1 == self.at_round:
            self.fired = True
            self._buf[0] = self.value


def _worker(srv, cls=SyncDiLoCoWorker, **kwargs) -> SyncDiLoCoWorker:
    model = make_model()
    sync = SyncWorkerConfig(allreduce_timeout_s=4.0, quorum_timeout_s=20.0)
    return cls(model, inner_opt(model), WorkerConfig(server=srv.address), sync=sync, **kwargs)


@pytest.mark.parametrize("value", [math.inf, math.nan, 1e30], ids=["inf", "nan", "1e30"])
def test_one_members_bad_pseudo_gradient_makes_every_member_skip_the_round_naming_it(sgd_server, value):
    H, R = 2, 3
    srv = sgd_server(min_workers=3)
    workers = [_worker(srv), _worker(srv, PoisonedSyncWorker, value=value, at_round=2), _worker(srv)]
    for w in workers:
        w.join()  # join order = rank order: the poisoned member is rank 1, rank 0 uploads
    bad = workers[1]
    run_threads([lambda i=i, w=w: train(w, i, steps=H * R) for i, w in enumerate(workers)])
    for w in workers:
        w.close()

    for w in workers:
        assert [r["committed"] for r in w.stats.rounds] == [True, False, True], w.stats.rounds
        skipped = w.stats.rounds[1]
        assert skipped["round"] == 1 and skipped["world_size"] == 3
        if math.isfinite(value):  # rank 0's upload was refused as an async push would be
            assert "over max_abs_value=1e+09" in skipped["reason"], skipped["reason"]
            assert f"the largest pseudo-gradient was worker {bad.worker_id}'s" in skipped["reason"]
        else:  # every member agreed before the sum
            assert f"worker {bad.worker_id} sent a non-finite pseudo-gradient" in skipped["reason"], skipped["reason"]
        assert torch.isfinite(flat(w.model)).all()  # the poisoned member restarted from θ_base too
    assert srv.state.status().rounds_failed == 1 and srv.state.version == 2
    theta = srv.state.params
    assert torch.isfinite(theta).all() and float(theta.abs().max()) < srv.config.max_abs_value
    # the skipped round changed nothing: round 3 started from round 1's θ
    assert len({w.stats.rounds[0]["checksum"] for w in workers}) == 1
    assert len({w.stats.rounds[2]["checksum"] for w in workers}) == 1


@pytest.mark.parametrize("value", [math.inf, math.nan], ids=["inf", "nan"])
def test_a_contribution_that_differs_from_its_announcement_is_named_and_blames_no_honest_member(sgd_server, value):
    """Issue 32: every member announced a finite ‖Δ‖∞, so the sum cannot overflow; the
    abort says a contribution did not match its announcement instead of telling the
    member with the largest honest ‖Δ‖∞ to lower its learning rate."""
    H, R = 2, 3
    srv = sgd_server(min_workers=2)
    workers = [_worker(srv), _worker(srv, MismatchedSyncWorker, value=value, at_round=2)]
    for w in workers:
        w.join()
    run_threads([lambda i=i, w=w: train(w, i, steps=H * R) for i, w in enumerate(workers)])
    for w in workers:
        w.close()
    for w in workers:
        assert [r["committed"] for r in w.stats.rounds] == [True, False, True], w.stats.rounds
        reason = w.stats.rounds[1]["reason"]
        assert "a member's contribution did not match its announcement" in reason, reason
        assert "every member announced a finite pseudo-gradient" in reason, reason
        assert "largest pseudo-gradient was" not in reason and "lower that worker's" not in reason, reason
    assert srv.state.status().rounds_failed == 1 and srv.state.version == 2
    assert len({w.stats.rounds[2]["checksum"] for w in workers}) == 1


def test_a_non_finite_sum_of_huge_announced_values_is_still_an_overflow_naming_the_largest():
    from asyncdiloco.wire._proto import parameter_server_pb2 as pb
    from asyncdiloco.worker.collectives import non_finite_sum_reason

    q = pb.QuorumReply(round=4, members=[3, 7, 9])
    overflow = non_finite_sum_reason([1e3, 3e38, 2e38], 3.0, q)
    assert "(the sum overflowed float32); the largest pseudo-gradient was worker 7's (‖Δ‖∞ = 3e+38)" in overflow
    mismatch = non_finite_sum_reason([1e3, 2.5, 0.0], 3.0, q)
    assert "a member's contribution did not match its announcement" in mismatch and "worker 3" not in mismatch
    assert "restarts from round 4" in mismatch
    assert "did not match" in non_finite_sum_reason([1.0, 1.0, 1.0], math.nan, q)  # the weights' sum


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_member_with_a_longer_buffer_fails_the_round_on_every_member_and_no_process_dies(sgd_server):
    """Before the agreement, the honest member died of gloo's size check (signal 6)."""
    H, R, EXTRA = 2, 2, 8
    srv = sgd_server(min_workers=2)
    numel = 8 + 1  # nn.Linear(8, 1); the buffer is [w·Δ, w]
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "_sync_member.py"), srv.address, str(i), str(H * R), *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i, extra in enumerate(((), (str(EXTRA),)))
    ]
    try:
        outs = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    for out, _ in outs:
        rounds = json.loads(out.strip().splitlines()[-1])
        assert len(rounds) == R and not any(r["committed"] for r in rounds), rounds
        for r in rounds:
            assert f"allreduce buffers differ in size ({numel + 1} to {numel + 1 + EXTRA} floats" in r["reason"], r
    assert srv.state.version == 0 and srv.state.status().rounds_failed == R
