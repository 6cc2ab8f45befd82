"""A worker never stuck and no local step ever lost (issue 15, items 1-3).

A real gRPC server in this process and a worker on the test thread whose client calls
fail as a script says (``Faults``: a lost reply, an outage, a refusal, one flipped bit,
an expired lease), injected at the client, never with sleeps. The model is one weight
vector trained with SGD η = 1 on a constant gradient, and the server's outer step is SGD
η = 1 with constant staleness weights, so every number is exact: each inner step moves
every weight by +1, the server's θ is θ_init − ΣΔ_applied, and "nothing lost, nothing
counted twice" is an equality (``assert_accounted``).
"""

from __future__ import annotations

import math
import types
from collections import deque

import hypothesis
import pytest
import torch
from helpers import FakeClock, flat
from hypothesis import strategies as st
from torch import nn

from asyncdiloco.algo.config import OuterConfig
from asyncdiloco.errors import (
    InvalidPayloadError,
    PayloadCorruptedError,
    PayloadTooLargeError,
    ServerUnavailableError,
    StalePushError,
)
from asyncdiloco.ps import ParameterServer, ParameterServerState
from asyncdiloco.ps.config import ServerConfig, SyncConfig
from asyncdiloco.worker import bulk_client, client
from asyncdiloco.worker.async_worker import AsyncDiLoCoWorker
from asyncdiloco.worker.base import WorkerState
from asyncdiloco.worker.config import SyncWorkerConfig, WorkerConfig
from asyncdiloco.worker.sync_worker import SyncDiLoCoWorker

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("one_thread")]

N = 4  # weights
H = 2
LEASE_S = 60.0
SGD1 = OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0, staleness="constant", max_staleness=10**6)


class Weights(nn.Module):
    """θ, (N,) fp32; its loss −Σθ has the constant gradient −1: SGD η = 1 adds 1 to every
    weight per inner step, exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(N))

    def step(self, opt: torch.optim.Optimizer, n: int = 1) -> None:
        for _ in range(n):
            (-self.w.sum()).backward()
            opt.step()
            opt.zero_grad()


@pytest.fixture
def server(start_server):
    """``server(**ServerConfig fields)``: H = 2, outer SGD η = 1, constant weights, no
    DyLU, no grouping, the state on a fake clock (``srv.clock``) so a lease expires when
    the test says."""

    def make(**fields):
        clock = FakeClock(1000.0)
        fields = {"outer": SGD1, "local_steps": H, "dylu": False, "grouping": "off", "lease_s": LEASE_S, **fields}
        srv = start_server(clock=clock, **fields)
        srv.clock = clock
        return srv

    return make


def make_worker(srv, *, overlap=False, name="w", **cfg):
    model = Weights()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    config = WorkerConfig(
        server=srv.address,
        worker_name=name,
        overlap=overlap,
        heartbeat_s=3600.0,  # the test expires leases itself
        initial_backoff_s=1e-6,  # a failed sync is retried at the next sync point (H steps later)
        max_backoff_s=1e-6,
        rpc_timeout_s=10.0,
        **cfg,
    )
    worker = AsyncDiLoCoWorker(model, opt, config, tokens_per_step=10)
    return model, opt, worker


def settle(worker: AsyncDiLoCoWorker) -> None:
    """Overlap: wait for the sync in flight and merge it (as ``close`` and ``state_dict`` do)."""
    if worker._overlap is not None and worker._overlap.in_flight:
        worker._guarded(worker._wait_and_merge)


# ------------------------------------------------------------------ the script
class Faults:
    """Scripted failures of one worker's client: each push / pull takes the next action
    of its queue ("ok" when empty).

    push actions: "lost" (sent and applied, the reply lost: DEADLINE_EXCEEDED), "down"
    (not sent: UNAVAILABLE), "refused" (not applied: INVALID_ARGUMENT), "too_large"
    (RESOURCE_EXHAUSTED), "stale" (FAILED_PRECONDITION), "corrupt" (one bit of the
    payload flipped in transit, once), "expire" (the server's lease of the worker lapses
    first: a retry is still answered with its outcome, the next new call is NOT_FOUND,
    then the worker rejoins); pull actions: "down", "corrupt".
    """

    PUSH = ("ok", "lost", "down", "refused", "too_large", "stale", "corrupt", "expire")
    PULL = ("ok", "down", "corrupt")

    def __init__(self, worker: AsyncDiLoCoWorker, srv, monkeypatch) -> None:
        self.srv = srv
        self.push: deque[str] = deque()
        self.pull: deque[str] = deque()
        self.flip_next_pull = False
        #: (worker_id, push_id) -> inner steps of a push the server applied whose reply was lost and
        #: whose retry has not been answered yet (what the worker cannot know).
        self.in_doubt: dict[int, int] = {}
        c = worker.client
        real_push, real_pull, real_send_push = c.push, c.pull, c._send_push
        self._flip_next_push = False

        def push(payload, **kw):
            action = self.push.popleft() if self.push and kw.get("kind", 0) != 2 else "ok"
            if action == "down":
                raise ServerUnavailableError("UNAVAILABLE: injected outage")
            if action == "refused":
                raise InvalidPayloadError("injected refusal: a value over max_abs_value")
            if action == "too_large":
                raise PayloadTooLargeError("injected refusal: the payload is too large")
            if action == "stale":
                raise StalePushError("injected refusal: staleness over max_staleness")
            if action == "expire":  # the server ends the silent worker's lease (Status checks leases)
                srv.clock.advance(LEASE_S + 1)
                srv.state.status()
            if action == "corrupt":
                self._flip_next_push = True
            reply = real_push(payload, **kw)
            key = (kw["worker_id"], kw["push_id"])
            if reply.duplicate:
                self.in_doubt.pop(key, None)
            if action == "lost":
                if reply.applied and not reply.duplicate:
                    self.in_doubt[key] = kw["num_local_steps"]
                raise ServerUnavailableError("DEADLINE_EXCEEDED: injected lost reply")
            return reply

        def send_push(payload, header, *rest):
            if self._flip_next_push:
                self._flip_next_push = False
                payload = flipped(payload)
            return real_send_push(payload, header, *rest)

        def pull(*args, **kw):
            action = self.pull.popleft() if self.pull else "ok"
            if action == "down":
                raise ServerUnavailableError("UNAVAILABLE: injected outage")
            self.flip_next_pull = action == "corrupt"
            return real_pull(*args, **kw)

        c.push, c.pull, c._send_push = push, pull, send_push
        faults = self

        class FlippingAssembler(client.PayloadAssembler):
            """Flips one bit of the first chunk a client pull receives once armed."""

            def add(self, chunk):
                if faults.flip_next_pull:
                    faults.flip_next_pull = False
                    data = bytearray(chunk.data)
                    data[len(data) // 2] ^= 0x10
                    chunk = types.SimpleNamespace(index=chunk.index, offset=chunk.offset, data=bytes(data))
                super().add(chunk)

            def fill_with(self, readinto, slice_bytes=1 << 20):
                def flipping(view):
                    got = readinto(view)
                    if faults.flip_next_pull and got:
                        faults.flip_next_pull = False
                        view[got // 2] ^= 0x10
                    return got

                super().fill_with(flipping, slice_bytes)

        monkeypatch.setattr(client, "PayloadAssembler", FlippingAssembler)
        monkeypatch.setattr(bulk_client, "PayloadAssembler", FlippingAssembler)


def flipped(payload: torch.Tensor) -> torch.Tensor:
    """A copy of the uint8 payload with one bit flipped (what a bad link does)."""
    out = payload.clone()
    out[out.numel() // 2] ^= 0x04
    return out


# ------------------------------------------------------------ the invariant
def applied_steps(srv) -> int:
    """Inner steps the server was told with applied pushes (every registration: a worker
    that rejoined without a name has several)."""
    return sum(w.local_steps for w in srv.state.status().workers)


def assert_accounted(srv, model, worker, faults: Faults | None = None) -> None:
    """Every inner step is applied on the server once, dropped (counted, with a reason),
    or still unsent: Σ Δ_applied + (θ_base − θ_local) + dropped = steps trained, weight
    by weight (each step moves each weight by +1, so Δ = −steps), and the same for the
    steps and tokens the server was told.

    A push whose reply was lost is in doubt until its retry is answered (``faults``
    knows what the server did with it): while the worker still holds it, it counts as
    applied; one the worker dropped after a rejoin the server did not resume counts as
    applied, not as dropped."""
    settle(worker)
    s = worker.stats
    in_doubt = dict(faults.in_doubt) if faults is not None else {}  # (worker_id, push_id) -> steps
    pending = worker._pending
    unsent = worker._base - flat(model)  # θ_base − θ_local, (N,)
    unsent_steps = worker._steps_since_sync
    if pending is not None:
        if in_doubt.pop((worker.worker_id, pending.push_id), None) is not None:  # applied, its reply not seen yet
            unsent -= pending.payload.view(torch.float32)  # raw codec: Δ as sent
        else:
            unsent_steps += pending.num_local_steps
    dropped = s.steps_dropped - sum(in_doubt.values())  # the rest were applied: dropped, not lost
    applied_delta = -srv.state.params  # Σ Δ applied = θ_init − θ, θ_init = 0, (N,)
    trained = torch.full((N,), float(s.inner_steps))
    torch.testing.assert_close(-(applied_delta + unsent), trained - dropped, rtol=0, atol=0)
    assert applied_steps(srv) + dropped + unsent_steps == s.inner_steps
    assert srv.state.status().tokens == 10 * applied_steps(srv)


# ------------------------------------------------------------ item 3
@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlap"])
def test_steps_trained_while_a_push_reply_was_lost_are_kept_after_the_retry(server, monkeypatch, overlap):
    """Raw codec, H = 2, a push whose reply is lost: the retry is answered as the push
    already applied, and the pull after it must keep the 2 steps trained meanwhile (the
    weight went 4.0 -> 2.0 before the fix, instead of staying at 4.0 on top of the pull)."""
    srv = server()
    model, opt, worker = make_worker(srv, overlap=overlap)
    faults = Faults(worker, srv, monkeypatch)
    with worker:
        faults.push.append("lost")
        model.step(opt, 2)  # sync point: push 2 is applied, its reply lost
        settle(worker)
        assert float(srv.state.params[0]) == 2.0 and worker.stats.sync_failures == 1
        model.step(opt, 2)  # steps 3, 4; the retry is answered "applied", then the pull
        settle(worker)
        assert float(srv.state.params[0]) == 2.0 and worker.stats.pushes_applied == 1
        assert float(model.w[0].detach()) == 4.0  # θ_pulled (2) + the 2 steps since
        assert_accounted(srv, model, worker)
        model.step(opt, 2)
        settle(worker)
        assert_accounted(srv, model, worker)
    assert float(srv.state.params[0]) == 6.0 and worker.stats.steps_dropped == 0
    assert_accounted(srv, model, worker)


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlap"])
def test_the_worker_state_follows_join_a_lapsed_lease_the_rejoin_and_close(server, monkeypatch, overlap):
    """NEW -> JOINING -> TRAINING; a lapsed lease makes it LOST, the next sync point rejoins
    (REJOINING -> TRAINING); close() leaves it CLOSED. No step is lost on the way."""
    srv = server()
    model, opt, worker = make_worker(srv, overlap=overlap)
    faults = Faults(worker, srv, monkeypatch)
    assert worker.state is WorkerState.NEW
    with worker:
        assert worker.state is WorkerState.TRAINING
        faults.push.append("expire")
        model.step(opt, H)  # the push meets the lapsed lease: NOT_FOUND
        settle(worker)
        assert worker.state is WorkerState.LOST
        model.step(opt, H)  # the sync point rejoins (the server resumes the named worker)
        settle(worker)
        assert worker.state is WorkerState.TRAINING
        model.step(opt, H)
        settle(worker)
        assert_accounted(srv, model, worker)
    assert worker.state is WorkerState.CLOSED
    assert_accounted(srv, model, worker)


# ------------------------------------------------------------ item 1
def poison(model: Weights, value: float = math.nan) -> None:
    """One weight of the local model set to ``value`` (a diverged step)."""
    with torch.no_grad():
        model.w[1] = value


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlap"])
def test_one_nan_weight_before_a_sync_point_is_dropped_the_global_model_pulled_and_training_goes_on(server, overlap):
    """Before the fix the local check's InvalidPayloadError escaped every later step and
    the model stayed NaN."""
    srv = server()
    model, opt, worker = make_worker(srv, overlap=overlap)
    with worker:
        model.step(opt)
        poison(model)
        model.step(opt)  # sync point: Δ is not finite, nothing is sent
        settle(worker)
        assert torch.isfinite(model.w).all()  # the global model (θ_base) again
        assert worker.stats.drops == {"non_finite": 1} and worker.stats.steps_dropped == 2
        assert srv.state.status().rejected_pushes == 0 and srv.state.version == 0
        for _ in range(3):  # later rounds are applied
            model.step(opt, H)
            settle(worker)
        assert worker.stats.pushes_applied >= 2 and torch.isfinite(srv.state.params).all()
        assert_accounted(srv, model, worker)
    assert_accounted(srv, model, worker)


def _stateful(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=0.1)
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _nan_gradient_step(model: Weights, opt: torch.optim.Optimizer) -> None:
    (-model.w.sum()).backward()
    model.w.grad[0] = float("nan")  # one NaN gradient: the optimizer's state takes it in
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlap"])
@pytest.mark.parametrize("kind", ["adamw", "sgd_momentum"])
def test_one_nan_gradient_into_a_stateful_inner_optimizer_is_dropped_once_and_training_goes_on(server, overlap, kind):
    """A NaN gradient also enters AdamW's moments / SGD's momentum buffer. Before the fix
    only the model was restarted, so every later Δ was NaN again: five drops, then a raise."""
    srv = server()
    model = Weights()
    opt = _stateful(kind, model)
    worker = AsyncDiLoCoWorker(model, opt, WorkerConfig(server=srv.address, worker_name="w", overlap=overlap))
    with worker:
        model.step(opt)
        _nan_gradient_step(model, opt)  # sync point: Δ is not finite, dropped
        settle(worker)
        assert worker.stats.drops == {"non_finite": 1} and worker.stats.optimizer_states_cleared == 1
        for _ in range(8):  # more rounds than max_dropped_in_a_row: all applied
            model.step(opt, H)
            settle(worker)
        assert worker.stats.drops == {"non_finite": 1}
        assert worker.stats.pushes_applied >= 6 and torch.isfinite(srv.state.params).all()
        for value in opt.state[model.w].values():
            assert not isinstance(value, torch.Tensor) or torch.isfinite(value).all()


def test_a_sync_member_with_one_nan_gradient_into_adamw_skips_one_round_only(start_server):
    srv = start_server(
        mode="sync",
        outer=OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0),
        local_steps=H,
        lease_s=30.0,
        sync=SyncConfig(min_workers=1, join_timeout_s=1.0, round_timeout_s=20.0),
    )
    model = Weights()
    opt = _stateful("adamw", model)
    cfg = WorkerConfig(server=srv.address, max_dropped_in_a_row=2)
    worker = SyncDiLoCoWorker(model, opt, cfg, sync=SyncWorkerConfig(quorum_timeout_s=5.0, allreduce_timeout_s=5.0))
    with worker:
        model.step(opt)
        _nan_gradient_step(model, opt)  # round 1: skipped
        for _ in range(4):
            model.step(opt, H)
        assert [r["committed"] for r in worker.stats.rounds] == [False, True, True, True, True]
        assert worker.stats.non_finite_rounds == 1 and torch.isfinite(srv.state.params).all()


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlap"])
def test_a_push_the_server_refuses_as_out_of_range_is_dropped_and_later_pushes_are_applied(server, overlap):
    """A finite weight of 1e12 (over --max-abs-value): INVALID_ARGUMENT from the server,
    which made every later step raise before the fix."""
    srv = server(max_abs_value=1e6)
    model, opt, worker = make_worker(srv, overlap=overlap)
    with worker:
        model.step(opt)
        poison(model, 1e12)
        model.step(opt)
        settle(worker)
        assert worker.stats.drops == {"invalid_payload": 1} and worker.stats.pushes_refused == 1
        assert srv.state.status().rejected_pushes == 1 and float(model.w.detach().abs().max()) < 1e6
        model.step(opt, H)
        settle(worker)
        model.step(opt, H)
        settle(worker)
        assert worker.stats.pushes_applied >= 1
        assert_accounted(srv, model, worker)


@pytest.mark.parametrize("refusal", ["too_large", "stale"])
@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlap"])
def test_every_droppable_refusal_is_dropped_counted_and_training_goes_on(server, monkeypatch, overlap, refusal):
    srv = server()
    model, opt, worker = make_worker(srv, overlap=overlap)
    faults = Faults(worker, srv, monkeypatch)
    reason = {"too_large": "payload_too_large", "stale": "stale_push"}[refusal]
    with worker:
        faults.push.append(refusal)
        model.step(opt, H)
        settle(worker)
        assert worker.stats.drops == {reason: 1}
        for _ in range(2):
            model.step(opt, H)
            settle(worker)
        assert worker.stats.pushes_applied >= 1
        assert_accounted(srv, model, worker)


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlap"])
def test_a_worker_that_diverges_every_round_raises_once_after_max_dropped_in_a_row(server, overlap):
    srv = server()
    model, opt, worker = make_worker(srv, overlap=overlap, max_dropped_in_a_row=3)
    with worker:
        for _ in range(2):  # two drops: no error yet
            model.step(opt)
            poison(model)
            model.step(opt)
            settle(worker)
        model.step(opt)
        poison(model)
        with pytest.raises(InvalidPayloadError) as info:
            model.step(opt)
            settle(worker)
        opt.zero_grad()  # the raising step skipped Weights.step's zero_grad
        message = str(info.value)
        assert "the last 3 pseudo-gradients were all dropped" in message, message
        assert "max_dropped_in_a_row=3" in message and "lower the inner learning rate" in message, message
        assert torch.isfinite(model.w).all() and worker.stats.pseudo_gradients_dropped == 3
        model.step(opt, H)  # raised once: the next round is applied
        settle(worker)
        model.step(opt, H)
        settle(worker)
        assert worker.stats.pushes_applied >= 1
        assert_accounted(srv, model, worker)


def test_a_sync_member_whose_pseudo_gradient_is_not_finite_retakes_the_committed_model_and_goes_on(start_server):
    """Sync mode: the round is skipped (by every member); the member restarts from the
    committed round and its next rounds commit; every round in a row raises after the limit."""
    srv = start_server(
        mode="sync",
        outer=OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0),
        local_steps=H,
        lease_s=30.0,
        sync=SyncConfig(min_workers=1, join_timeout_s=1.0, round_timeout_s=20.0),
    )
    model = Weights()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    cfg = WorkerConfig(server=srv.address, max_dropped_in_a_row=2)
    worker = SyncDiLoCoWorker(model, opt, cfg, sync=SyncWorkerConfig(quorum_timeout_s=5.0, allreduce_timeout_s=5.0))
    with worker:
        model.step(opt)
        poison(model)
        model.step(opt)  # round 1: skipped, the model is round 0's again
        assert [r["committed"] for r in worker.stats.rounds] == [False]
        assert torch.equal(model.w.detach(), torch.zeros(N)) and worker.stats.non_finite_rounds == 1
        model.step(opt, H)
        model.step(opt, H)
        assert [r["committed"] for r in worker.stats.rounds] == [False, True, True]
        assert torch.equal(srv.state.params, torch.full((N,), 2.0 * H))
        for _ in range(2):
            model.step(opt)
            poison(model)
            if worker.stats.non_finite_rounds == 2:
                with pytest.raises(InvalidPayloadError, match="the last 2 pseudo-gradients were all dropped"):
                    model.step(opt)
                opt.zero_grad()
            else:
                model.step(opt)
        assert torch.isfinite(model.w).all() and worker.stats.steps_dropped == 3 * H


# ------------------------------------------------------------ item 2
@pytest.mark.parametrize("bulk", [False, True], ids=["grpc", "bulk"])
@pytest.mark.parametrize("where", ["push", "pull"])
@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlap"])
def test_one_flipped_bit_is_sent_again_and_the_push_applied_once(server, monkeypatch, where, bulk, overlap):
    """The CRC-32 catches the flipped bit; before the fix PayloadCorruptedError's message
    ("corrupted in transit: resend it") escaped step()."""
    srv = server(bulk_port=0 if bulk else None)
    model, opt, worker = make_worker(srv, overlap=overlap)
    faults = Faults(worker, srv, monkeypatch)
    with worker:
        assert (worker.client.bulk_port > 0) == bulk
        getattr(faults, where).append("corrupt")
        model.step(opt, H)
        settle(worker)
        assert worker.stats.sync_failures == 0 and worker.client.corrupted_transfers == 1
        assert srv.state.version == 1 and worker.stats.pushes_applied == 1
        assert srv.state.status().rejected_pushes == (1 if where == "push" else 0)
        model.step(opt, H)
        settle(worker)
        assert_accounted(srv, model, worker)
    assert worker.stats.corrupted_transfers == 1 and srv.state.version == 2


def test_a_link_that_corrupts_every_transfer_raises_after_the_resends_and_the_push_is_kept(server, monkeypatch):
    srv = server()
    model, opt, worker = make_worker(srv)
    faults = Faults(worker, srv, monkeypatch)
    worker.client.resend_backoff_s = 0.001
    with worker:
        real = worker.client._send_push
        monkeypatch.setattr(
            worker.client, "_send_push", lambda payload, header, *rest: real(flipped(payload), header, *rest)
        )
        model.step(opt)
        with pytest.raises(PayloadCorruptedError, match="arrived corrupted 4 times in a row") as info:
            model.step(opt)
        opt.zero_grad()
        assert "corrupted_resends=3" in str(info.value) and srv.state.version == 0
        assert worker._pending is not None and worker._pending.push_id == 2
        monkeypatch.setattr(worker.client, "_send_push", real)  # the link is repaired
        model.step(opt, H)  # the kept push goes out with its push id, then the steps since
        assert srv.state.version == 1 and srv.state.status().rejected_pushes == 4
        assert_accounted(srv, model, worker)
    assert faults.push == deque() and srv.state.version == 2
    assert_accounted(srv, model, worker)


# ------------------------------------------------------------ item 3: any sequence
#: One fault of each kind, in an order that also stacks them (a lost reply, then the
#: lease lapses before its retry; an outage of the pull after an acknowledged push).
SCRIPT = [
    ("lost", "ok", 2),
    ("ok", "ok", 2),
    ("refused", "ok", 2),
    ("down", "ok", 2),
    ("ok", "down", 3),
    ("corrupt", "corrupt", 2),
    ("lost", "ok", 2),
    ("expire", "ok", 2),
    ("ok", "ok", 2),
    ("stale", "down", 2),
    ("lost", "down", 1),
    ("expire", "down", 2),
    ("ok", "ok", 2),
    ("down", "ok", 2),
    ("expire", "ok", 2),  # the kept push meets the lapsed lease: NOT_FOUND, rejoin, then retried
    ("ok", "ok", 2),
    ("ok", "ok", 2),
]


def run_script(srv, monkeypatch, script, *, overlap: bool, name: str) -> AsyncDiLoCoWorker:
    """Train through ``script`` (push fault, pull fault, inner steps) and check after
    every round, and after close, that every inner step is accounted for exactly once."""
    model, opt, worker = make_worker(srv, overlap=overlap, name=name, max_dropped_in_a_row=0)
    faults = Faults(worker, srv, monkeypatch)
    worker.client.resend_backoff_s = 0.0
    with worker:
        for push_fault, pull_fault, steps in script:
            faults.push.append(push_fault)
            faults.pull.append(pull_fault)
            model.step(opt, steps)
            settle(worker)
            assert_accounted(srv, model, worker, faults)
    assert_accounted(srv, model, worker, faults)
    assert torch.isfinite(model.w).all()
    return worker


@pytest.mark.parametrize("name", ["w", ""], ids=["named", "nameless"])
@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlap"])
def test_no_local_step_is_lost_or_counted_twice_through_a_scripted_sequence_of_faults(
    server, monkeypatch, overlap, name
):
    """A named worker's rejoins are resumed (its pending push retried with its id); a
    nameless one's are not, and what its old registration had not acknowledged is
    dropped and counted, never sent twice."""
    srv = server()
    worker = run_script(srv, monkeypatch, SCRIPT, overlap=overlap, name=name)
    registrations = len(srv.state.status().workers)
    if name:  # resumed: nothing dropped but the two refusals
        assert registrations == 1 and set(worker.stats.drops) == {"invalid_payload", "stale_push"}
    else:
        assert registrations >= 2 and worker.stats.drops.get("not_resumed", 0) >= 1
    assert worker.stats.corrupted_transfers == 2


@hypothesis.settings(max_examples=40, deadline=None, derandomize=True)
@hypothesis.given(
    script=st.lists(
        st.tuples(st.sampled_from(Faults.PUSH), st.sampled_from(Faults.PULL), st.integers(1, 3)), max_size=10
    ),
    overlap=st.booleans(),
    name=st.sampled_from(["w", ""]),
)
def test_no_local_step_is_lost_or_counted_twice_whatever_fails_when(script, overlap, name):
    clock = FakeClock(1000.0)
    srv = ParameterServer(ServerConfig(port=0, outer=SGD1, local_steps=H, dylu=False, grouping="off", lease_s=LEASE_S))
    srv.state = ParameterServerState(srv.config, clock=clock)
    srv.clock = clock
    srv.start()
    try:
        with pytest.MonkeyPatch.context() as monkeypatch:
            run_script(srv, monkeypatch, script, overlap=overlap, name=name)
    finally:
        srv.stop(None)
