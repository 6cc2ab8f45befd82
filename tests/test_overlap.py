"""Overlap mode of the asynchronous worker (WorkerConfig.overlap, asyncdiloco/worker/push_pull.py).

The background push and pull are held at gates (events set by the test, never sleeps),
so steps are known to happen while a sync is in flight. With the outer optimizer
``sgd`` (η = 1, μ = 0) and constant staleness weights the server's θ is θ_init − ΣΔ, which
makes "nothing lost, nothing counted twice" an exact check: it must equal θ_init plus
every inner step's displacement of every worker (minus what was never pushed).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import threading
import time

import pytest
import torch
from helpers import STUCK_S, flat, wait_until
from torch import nn

from asyncdiloco import AsyncDiLoCoWorker, ConfigError, SyncDiLoCoWorker, WorkerConfig
from asyncdiloco.algo.config import OuterConfig
from asyncdiloco.ps import ParameterServer
from asyncdiloco.ps.config import DurabilityConfig
from asyncdiloco.worker.client import ParameterServerClient

pytestmark = pytest.mark.timeout(120)

SGD1 = OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0, staleness="constant")
W_TRUE = torch.tensor([[1.0, -2.0, 0.5, 3.0]])


@pytest.fixture
def make_server(start_server):
    """Servers whose outer step is plain SGD η = 1 unless ``outer`` is given, with a fixed
    H (no DyLU) and replies not grouped: these tests count pushes and steps, and pin
    overlap's own rule (a sync still in flight at the next sync point is waited for)."""
    return functools.partial(start_server, outer=SGD1, dylu=False, grouping="off")


class Displacement:
    """Σ over inner steps of (θ after the optimizer's update − θ before it). Built before
    the worker, so its post-step hook runs before the worker's (no merge is included)."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model = model
        self.total = torch.zeros_like(flat(model))
        self.steps = 0
        self.after: torch.Tensor | None = None  # θ right after the last update, before any merge
        self.cond = threading.Condition()
        opt.register_step_pre_hook(lambda *_: self._pre())
        opt.register_step_post_hook(lambda *_: self._post())

    def _pre(self) -> None:
        self._before = flat(self.model)

    def _post(self) -> None:
        self.after = flat(self.model)
        self.total += self.after - self._before
        with self.cond:
            self.steps += 1
            self.cond.notify_all()


class Gate:
    """Holds the worker client's ``method`` ("push" or "pull") once per ``arm()`` until
    ``release`` is set; ``entered`` says the background thread got there."""

    def __init__(self, worker: AsyncDiLoCoWorker, method: str) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        self.armed = False
        real = getattr(worker.client, method)

        def gated(*args, **kwargs):
            if self.armed:
                self.armed = False
                self.entered.set()
                assert self.release.wait(30), "the test never released the gate"
            return real(*args, **kwargs)

        setattr(worker.client, method, gated)

    def arm(self) -> None:
        self.entered.clear()
        self.release.clear()
        self.armed = True


class LaggingPulls:
    """The i-th pull after ``join`` (the one of sync point i·H) waits until the training
    thread has taken 2 more inner steps, so every sync overlaps real steps."""

    def __init__(self, worker: AsyncDiLoCoWorker, disp: Displacement, h: int) -> None:
        self.closing = threading.Event()
        self.n = 0
        real = worker.client.pull

        def lagging(*args, **kwargs):
            self.n += 1
            target = self.n * h + 2
            with disp.cond:
                disp.cond.wait_for(lambda: disp.steps >= target or self.closing.is_set(), timeout=30)
            return real(*args, **kwargs)

        worker.client.pull = lagging


def make_worker(srv, seed=0, **cfg):
    torch.manual_seed(seed)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    disp = Displacement(model, opt)
    cfg.setdefault("overlap", True)
    worker = AsyncDiLoCoWorker(model, opt, WorkerConfig(server=srv.address, **cfg), tokens_per_step=16)
    return model, opt, disp, worker


def stepper(model, opt, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def steps(n: int) -> None:
        for _ in range(n):
            x = torch.randn(16, 4, generator=gen)
            nn.functional.mse_loss(model(x), x @ W_TRUE.T).backward()
            opt.step()
            opt.zero_grad()

    return steps


def wait_background(worker: AsyncDiLoCoWorker) -> None:
    """Wait until the sync in flight finished, without collecting it (the next step merges)."""
    concurrent.futures.wait([worker._overlap._future], timeout=30)


# ------------------------------------------------------------------ merge math
def test_merge_keeps_the_steps_taken_during_the_sync_on_top_of_the_new_global_model(make_server):
    srv = make_server(local_steps=3)
    model, opt, disp, worker = make_worker(srv)
    steps = stepper(model, opt)
    with worker:
        other = ParameterServerClient(srv.address)
        other_id = other.join(worker.manifest, "other").worker_id
        gate = Gate(worker, "pull")
        gate.arm()
        steps(3)  # sync point: the push goes out, the pull waits at the gate
        theta_t0 = disp.after.clone()
        assert gate.entered.wait(30)
        torch.testing.assert_close(srv.state.params, theta_t0, rtol=0, atol=1e-6)  # θ_init − Δ1 = θ(t0)
        delta_o = torch.full_like(theta_t0, 0.01)
        reply = other.push(worker.manifest.pack_flat(delta_o), worker_id=other_id, push_id=2, base_version=1)
        assert reply.applied and srv.state.version == 2
        theta_g = srv.state.params.clone()  # θ_g' = θ(t0) − Δ_o
        steps(2)  # steps 4, 5 run while the sync is in flight
        assert worker.version == 0 and worker.stats.pulls == 0  # it initialized the server: nothing merged yet
        gate.release.set()
        wait_background(worker)
        steps(1)  # step 6: merged in its post-step hook, then the next sync starts
        raw6 = disp.after
        expected = raw6 + (theta_g - theta_t0)  # θ_g' + (θ_local(now) − θ_local(t0))
        torch.testing.assert_close(flat(model), expected, rtol=0, atol=1e-6)
        assert worker.version == 2 and worker.stats.pulls == 1
        wait_background(worker)  # the second push: Δ2 = θ_g' − θ_merged carries steps 4-6
        steps(1)
        torch.testing.assert_close(srv.state.params, expected, rtol=0, atol=1e-6)  # θ_g' − Δ2 = θ_merged
        assert srv.state.version == 3
        st = srv.state.status()
        assert st.tokens == 6 * 16  # steps 1-3, then 4-6: each counted once
        other.close()
    assert worker.stats.pushes_applied == 3  # two rounds and the residual (step 7) at close
    assert worker.stats.inner_steps == 7 and srv.state.status().tokens == 7 * 16


# ------------------------------------------------------- nothing lost or doubled
@pytest.mark.parametrize("push_on_close", [True, False])
def test_two_overlapping_workers_lose_nothing_and_count_nothing_twice(make_server, push_on_close):
    h, n_steps = 4, 19
    srv = make_server(local_steps=h)
    runs = []
    for seed in (0, 1):
        model, opt, disp, worker = make_worker(srv, seed=0, push_on_close=push_on_close)
        runs.append((model, opt, disp, worker, stepper(model, opt, seed)))
    runs[0][3].join()
    theta_init = srv.state.params.clone()
    errors = []

    def run(model, opt, disp, worker, steps):
        try:
            if not worker.worker_id:
                worker.join()
            lag = LaggingPulls(worker, disp, h)
            steps(n_steps)
            lag.closing.set()
            worker.close()
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=r) for r in runs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    assert not errors, errors
    displacement = sum(r[2].total for r in runs)
    unpushed = sum(flat(r[0]) - r[3]._base for r in runs) if not push_on_close else 0
    # θ_server = θ_init − ΣΔ (sgd, η = 1, μ = 0, s(τ) = 1); nothing lost: ΣΔ = −(displacement − unpushed)
    torch.testing.assert_close(srv.state.params, theta_init + displacement - unpushed, rtol=0, atol=2e-5)
    assert not torch.allclose(displacement, torch.zeros_like(displacement), atol=1e-3)
    st = srv.state.status()
    pushes = sum(r[3].stats.pushes_applied for r in runs)
    assert st.version == st.applied_pushes == pushes and st.duplicate_pushes == 0
    per_worker = n_steps // h + (1 if push_on_close else 0)  # 4 rounds (+ the residual of 3 steps)
    assert [r[3].stats.pushes_applied for r in runs] == [per_worker, per_worker]
    pushed_steps = 2 * (n_steps if push_on_close else h * (n_steps // h))
    assert st.tokens == pushed_steps * 16
    for r in runs:
        assert r[3].stats.blocked_s <= r[3].stats.wall_s


# ------------------------------------------------------------ real server, loss
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_overlap_trains_the_global_model_with_a_real_server_process(tmp_path):
    from asyncdiloco.bench.demo import DemoConfig, run_demo
    from asyncdiloco.job.config import JobConfig

    # a small model: the loss drops by the bound below within a few dozen steps, which
    # 8 s of training give even on a machine many times slower than a quiet one
    cfg = DemoConfig(
        num_workers=2,
        max_seconds=8.0,
        out_dir=str(tmp_path),
        slowdowns=(1.0, 1.5),
        server_args=("--local-steps", "10", "--outer-optimizer", "sgd", "--outer-lr", "0.5", "--outer-momentum", "0"),
        job=JobConfig(n_layer=1, n_embd=32, n_head=4),
        eval_every_s=3.0,
        worker_args=("--overlap",),
    )
    report = run_demo(cfg, progress=False)
    assert report["overlap"] is True
    assert report["final_eval_loss"] < report["initial_eval_loss"] - 0.5
    assert report["version"] == report["applied_pushes"] > 0
    for w in report["workers"]:
        assert w["exit_code"] == 0 and w["pushes"] > 0
        assert w["blocked_fraction"] is not None and 0 <= w["blocked_fraction"] < 1
        stats = json.loads((tmp_path / f"worker-{w['index']}.json").read_text())
        assert stats["comm_s"] > 0 and stats["pulls"] > 0


# --------------------------------------------------------------------- faults
@pytest.mark.parametrize("where", ["push", "pull"])
def test_server_gone_during_a_background_sync_training_goes_on_and_the_push_lands_once(make_server, tmp_path, where):
    def start(port: int) -> ParameterServer:
        return make_server(port=port, local_steps=3, durability=DurabilityConfig(checkpoint_dir=str(tmp_path / "ck")))

    srv = start(0)
    port = srv.port
    model, opt, disp, worker = make_worker(srv, initial_backoff_s=0.01, max_backoff_s=0.05, rpc_timeout_s=2)
    steps = stepper(model, opt)
    worker.join()
    theta_init = srv.state.params.clone()
    steps(3)  # one clean round
    wait_background(worker)
    gate = Gate(worker, where)
    gate.arm()
    steps(3)  # the second sync waits at the gate before its push (or its pull)
    assert gate.entered.wait(30)
    version = srv.state.version
    srv.stop(None)  # the server goes away while the sync is in flight
    gate.release.set()
    wait_background(worker)
    steps(4)  # the failure is merged; training goes on locally
    assert worker.stats.sync_failures >= 1 and worker.stats.inner_steps == 10
    srv = start(port)  # same folder, same port
    # held at the pull, the push was acknowledged before the server went (``version`` includes it)
    assert srv.state.version >= version
    target = version + (2 if where == "push" else 1)  # the retried push and one more round, or one more
    deadline = time.monotonic() + STUCK_S
    while srv.state.version < target and time.monotonic() < deadline:
        steps(1)  # the retry (or the residual) is sent at the next sync points
    worker.close()
    st = srv.state.status()
    assert st.duplicate_pushes == 0
    assert st.version == worker.stats.pushes_applied  # each acknowledged push applied once
    torch.testing.assert_close(srv.state.params, theta_init + disp.total, rtol=0, atol=2e-5)
    assert st.tokens == worker.stats.inner_steps * 16


def test_close_waits_for_the_sync_in_flight_then_pushes_the_residual(make_server):
    srv = make_server(local_steps=3)
    model, opt, disp, worker = make_worker(srv)
    steps = stepper(model, opt)
    worker.join()
    theta_init = srv.state.params.clone()
    gate = Gate(worker, "pull")
    gate.arm()
    steps(4)  # sync at step 3 (held at the pull), step 4 in the meantime
    assert gate.entered.wait(30)
    waiting = threading.Event()
    real_wait = worker._overlap.wait

    def wait_spy():
        waiting.set()
        return real_wait()

    worker._overlap.wait = wait_spy
    releaser = threading.Thread(target=lambda: waiting.wait(30) and gate.release.set())
    releaser.start()
    worker.close()  # blocks until the pull comes back, merges, then pushes step 4
    releaser.join(timeout=30)
    assert waiting.is_set() and not worker._overlap.in_flight
    assert worker.stats.pulls == 1 and worker.stats.pushes_applied == 2  # the initializer had not pulled before
    torch.testing.assert_close(srv.state.params, theta_init + disp.total, rtol=0, atol=1e-6)
    assert srv.state.status().tokens == 4 * 16


def test_a_stale_refusal_restarts_from_the_global_model_at_the_merge(make_server):
    srv = make_server(local_steps=3, outer=OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0, max_staleness=0))
    model, opt, disp, worker = make_worker(srv)
    steps = stepper(model, opt)
    with worker:
        other = ParameterServerClient(srv.address)
        other_id = other.join(worker.manifest, "other").worker_id
        gate = Gate(worker, "push")
        gate.arm()
        steps(3)
        assert gate.entered.wait(30)
        delta_o = worker.manifest.pack_flat(torch.full((5,), 0.01))
        assert other.push(delta_o, worker_id=other_id, push_id=2, base_version=0).applied  # τ of ours becomes 1
        steps(1)
        gate.release.set()
        wait_background(worker)
        steps(1)  # merge: refused, so the model restarts from θ_g'
        assert worker.stats.pushes_refused == 1 and worker.stats.pushes_applied == 0
        assert torch.equal(flat(model), srv.state.params) and worker.version == srv.state.version == 1
        assert worker._steps_since_sync == 0
        other.close()


def test_a_forgotten_worker_rejoins_on_the_training_thread(make_server):
    srv = make_server(local_steps=3)
    model, opt, disp, worker = make_worker(srv, initial_backoff_s=0.01, max_backoff_s=0.05)
    steps = stepper(model, opt)
    with worker:
        first_id = worker.worker_id
        gate = Gate(worker, "push")
        gate.arm()
        steps(3)
        assert gate.entered.wait(30)
        with ParameterServerClient(srv.address) as c:
            c.leave(first_id)  # the server forgets the worker while its push is held
        gate.release.set()
        wait_background(worker)
        steps(3)  # step 4 merges: UnknownWorkerError; step 6 is a sync point: rejoin, on this thread
        assert worker.worker_id not in (0, first_id)
        assert torch.equal(flat(model), srv.state.params)  # rejoined from the global model
        steps(6)
        assert worker.stats.pushes_applied >= 1


# ------------------------------------------------------------------ refusals
def test_the_sync_worker_refuses_overlap():
    with pytest.raises(ConfigError, match="overlap=True is invalid for the sync worker"):
        SyncDiLoCoWorker(
            nn.Linear(2, 1), torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1), WorkerConfig(overlap=True)
        )
    with pytest.raises(ConfigError, match="overlap='yes' is invalid"):
        WorkerConfig(overlap="yes")


@pytest.mark.parametrize("cmd", [["worker", "--server", "127.0.0.1:1", "--max-steps", "1"], ["demo"]])
def test_cli_refuses_overlap_in_sync_mode(cmd, cli_exit):
    code, err = cli_exit([*cmd, "--mode", "sync", "--overlap"])
    assert code == 2, err
    assert "--overlap is invalid with --mode sync" in err and "Traceback" not in err


@pytest.mark.parametrize(("value", "refused"), [(3.0e38, False), (float("inf"), True), (float("nan"), True)])
def test_the_finiteness_check_of_delta_is_exact(value, refused):
    # Δ = θ_base − θ_local = −value: a sum of 5 × −3e38 overflows, yet every element is finite.
    from asyncdiloco import InvalidPayloadError

    model = nn.Linear(4, 1)
    worker = AsyncDiLoCoWorker(
        model, torch.optim.SGD(model.parameters(), lr=0.1), WorkerConfig(server="127.0.0.1:1", overlap=True)
    )
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(3.0e38)
        model.bias.fill_(value)
    worker._steps_since_sync = 1
    try:
        if refused:
            with pytest.raises(InvalidPayloadError, match="non-finite values"):
                worker._new_pending(worker._overlap.snapshot)
        else:
            worker._new_pending(worker._overlap.snapshot)
            assert worker._pending is not None and worker._pending.num_local_steps == 1
    finally:
        worker.client.close()


def test_a_non_finite_delta_is_refused_in_the_background_before_anything_is_sent():
    from asyncdiloco import InvalidPayloadError, ServerUnavailableError
    from asyncdiloco.worker.push_pull import SyncLink, SyncRequest, push_then_pull

    class NoNetwork:
        def push(self, *a, **k):
            raise AssertionError("a non-finite Δ must not be pushed")

        def pull(self, *a, **k):  # the pull still runs: the merge restarts from the global model
            raise ServerUnavailableError("no network in this test")

    pending = dataclasses.make_dataclass(
        "P", ["payload", "push_id", "base_version", "num_local_steps", "num_tokens", "compute_s"]
    )(None, 2, 0, 3, 0, 0.0)
    snapshot = torch.tensor([0.0, float("nan"), 1.0])
    link = SyncLink(client=NoNetwork(), manifest=None, encode=lambda d: d.view(torch.uint8), decode=None)
    request = SyncRequest(
        worker_id=7, pending=pending, base=torch.zeros(3), snapshot=snapshot, theta_g=torch.empty(3), pull_buffer=None
    )
    out = push_then_pull(link, request)
    assert isinstance(out.refused, InvalidPayloadError) and "non-finite" in str(out.refused)
    assert out.drop_reason == "non_finite" and isinstance(out.error, ServerUnavailableError)
    assert pending.payload is None and out.push_reply is None and not out.pulled


# ------------------------------------------------------------ under grouping
def test_a_held_reply_does_not_block_training_and_nothing_is_lost(start_server):
    # The server holds the reply until the other expected worker pushes; the overlapping
    # worker trains past its next sync point instead of waiting, merges once the group is
    # released, and every step still reaches the server exactly once.
    srv = start_server(outer=SGD1, dylu=False, grouping="window", grace_s=120.0, local_steps=3)
    model, opt, disp, worker = make_worker(srv)
    steps = stepper(model, opt)
    worker.join()
    assert worker._grouped
    theta_init = srv.state.params.clone()
    other = ParameterServerClient(srv.address)
    other_id = other.join(worker.manifest, "other").worker_id  # expected: it joined just now
    steps(3)  # sync point: push in the background, its reply held for "other"
    wait_until(lambda: srv.state.counters.applied_pushes >= 1, "the push to reach the server")
    assert srv.state.counters.applied_pushes == 1
    steps(3)  # the next sync point comes while the reply is held: no wait
    assert worker._overlap.in_flight and worker.stats.pulls == 0 and worker.stats.inner_steps == 6
    delta_o = torch.full_like(theta_init, 0.01)
    reply = other.push(worker.manifest.pack_flat(delta_o), worker_id=other_id, push_id=2, base_version=0)
    assert reply.applied  # the group is whole: both replies go out
    wait_background(worker)
    steps(1)  # merged in the post-step hook
    assert worker.stats.pulls == 1 and worker._round_steps is not None and worker._round_steps >= 3
    worker.close()  # pushes the steps since the snapshot
    other.close()
    torch.testing.assert_close(srv.state.params, theta_init + disp.total - delta_o, rtol=0, atol=1e-5)
    assert srv.state.status().tokens == worker.stats.inner_steps * 16


def test_an_acknowledged_push_lowers_theta_base_once_when_the_pull_cannot_be_decoded():
    """``push_then_pull`` with a lossy codec: the acknowledged payload is taken out of
    θ_base before the pull is decoded; a pull that then fails to decode must not take it
    out a second time (what is left of θ_base − θ_local goes out later as a residual)."""
    from asyncdiloco.wire._proto import parameter_server_pb2 as pb
    from asyncdiloco.wire.codec import make_codec
    from asyncdiloco.wire.tensors import Manifest
    from asyncdiloco.worker.client import Pulled
    from asyncdiloco.worker.push_pull import PendingPush, SyncLink, SyncRequest, push_then_pull

    manifest = Manifest.from_named_tensors([("w", torch.zeros(8))])
    codec = make_codec("bf16", manifest)

    class Client:
        def push(self, payload, **_):
            return pb.PushReply(applied=True, version=1)

        def pull(self, manifest, worker_id, buffer=None):
            return Pulled(1, torch.zeros(3, dtype=torch.uint8), pb.RunConfig())  # not a bf16 payload of 8

    link = SyncLink(
        Client(),
        manifest,
        encode=lambda d: codec.encode(d, torch.empty(codec.wire_bytes, dtype=torch.uint8)),
        decode=codec.decode,
    )
    base = torch.zeros(8)
    delta = torch.full((8,), 0.25)  # exactly representable in bf16
    pending = PendingPush(
        payload=link.encode(delta), push_id=2, base_version=0, num_local_steps=1, num_tokens=0, compute_s=0.0
    )
    request = SyncRequest(
        worker_id=1,
        pending=pending,
        base=base,
        snapshot=None,
        theta_g=torch.empty(8),
        pull_buffer=None,
        lossy=True,
        keep_unsent=False,
    )
    out = push_then_pull(link, request)
    assert out.acknowledged and not out.pulled and out.error is not None
    assert torch.equal(base, -delta)  # lowered once
