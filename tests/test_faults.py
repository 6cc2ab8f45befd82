"""Fault injection and load on 127.0.0.1: kill -9 the server, kill workers, 32 clients at once."""

from __future__ import annotations

import functools
import pathlib
import random
import subprocess
import sys
import threading
import time

import pytest
import torch
from helpers import STUCK_S, wait_until

from asyncdiloco.algo.config import OuterConfig
from asyncdiloco.algo.outer import OuterOptimizer
from asyncdiloco.errors import ServerUnavailableError
from asyncdiloco.ps import ParameterServer
from asyncdiloco.ps.config import ServerConfig
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.tensors import Manifest
from asyncdiloco.worker.client import ParameterServerClient

pytestmark = [pytest.mark.multiprocess, pytest.mark.heavy]

CLI = [sys.executable, "-m", "asyncdiloco", "-q"]
HERE = pathlib.Path(__file__).parent
OUTER = OuterConfig(optimizer="nesterov", lr=0.7, momentum=0.9, staleness="inverse")
OUTER_FLAGS = [
    "--outer-optimizer",
    "nesterov",
    "--outer-lr",
    "0.7",
    "--outer-momentum",
    "0.9",
    "--staleness",
    "inverse",
]
MANIFEST = Manifest.from_named_tensors([("w", torch.zeros(40, 50)), ("b", torch.zeros(50))])


class ServerProcess:
    """``asyncdiloco server`` in a child process, restartable on the same port and folder."""

    def __init__(self, tmp_path: pathlib.Path, *flags: str) -> None:
        self.flags = list(flags)
        self.port = 0
        self.log_path = tmp_path / "server.log"
        self.log = open(self.log_path, "ab")
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [*CLI, "server", "--drain-s", "0", "--port", str(self.port), *self.flags],
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        line = self.proc.stdout.readline()  # printed once it accepts connections
        if "listening on 127.0.0.1:" not in line:
            self.proc.wait(timeout=30)
            self.log.flush()
            tail = self.log_path.read_text(errors="replace")[-3000:]
            raise AssertionError(f"server exited with {self.proc.returncode} instead of listening:\n{tail}")
        self.port = int(line.rsplit(":", 1)[1])

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def kill9(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)

    def rss_bytes(self) -> int:
        for line in open(f"/proc/{self.proc.pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.terminate()
            out, _ = self.proc.communicate(timeout=30)
            return out
        return ""


def retry(fn, *, give_up_s: float = 60.0):
    """Call ``fn`` until the server answers (it may be restarting)."""
    deadline = time.monotonic() + give_up_s
    while True:
        try:
            return fn()
        except ServerUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)  # backoff between attempts, not a synchronisation


def delta_for(worker: int, k: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * worker + k)
    return [torch.randn(t.shape, generator=g) * 0.01 for t in MANIFEST.tensors]


@pytest.mark.timeout(180)
def test_kill_9_the_server_repeatedly_and_every_acknowledged_push_survives_exactly_once(tmp_path):
    server = ServerProcess(
        tmp_path, "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "3", "-H", "1", *OUTER_FLAGS
    )
    init = [torch.randn(t.shape, generator=torch.Generator().manual_seed(7)) for t in MANIFEST.tensors]
    with ParameterServerClient(server.address, rpc_timeout_s=2) as c:
        reply = c.join(MANIFEST, "init")
        c.push(
            MANIFEST.pack(init),
            worker_id=reply.worker_id,
            push_id=1,
            base_version=0,
            kind=pb.PUSH_KIND_INITIAL_PARAMETERS,
        )
    acks: dict[int, tuple] = {}  # version -> (worker, push_id, delta payload, staleness weight)
    lock = threading.Lock()
    kills_done = threading.Event()
    errors, duplicates = [], []

    def worker(index: int) -> None:
        try:
            with ParameterServerClient(server.address, rpc_timeout_s=2) as c:
                wid = retry(lambda: c.join(MANIFEST, f"w{index}")).worker_id
                k, extra = 0, 3
                while extra > 0:
                    extra -= kills_done.is_set()
                    base = retry(lambda: c.pull(MANIFEST, wid)).version
                    payload = MANIFEST.pack(delta_for(index, k))
                    # an unacknowledged push is resent with the same push_id, as AsyncDiLoCoWorker does
                    r = retry(functools.partial(c.push, payload, worker_id=wid, push_id=k + 2, base_version=base))
                    assert r.applied
                    with lock:
                        if r.duplicate:
                            duplicates.append(r.version)
                        assert r.version not in acks or acks[r.version][:2] == (index, k + 2)
                        acks[r.version] = (index, k + 2, payload, r.staleness_weight)
                    k += 1
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    rng = random.Random(0)
    kill_versions = []
    for _ in range(6):
        time.sleep(rng.uniform(0.2, 1.0))  # a random moment: the fault being injected
        server.kill9()
        server.start()  # same port, same folder: resumes from checkpoint + log
        with ParameterServerClient(server.address) as c:
            kill_versions.append(retry(c.status).version)
    kills_done.set()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    with ParameterServerClient(server.address) as c:
        final = c.pull(MANIFEST)
        status = c.status()
    out = server.stop()
    assert "stopped at version" in out
    # every version 1..V was acknowledged to exactly one push, and the model is their replay
    assert sorted(acks) == list(range(1, final.version + 1)) and final.version == status.applied_pushes
    assert kill_versions == sorted(kill_versions) and kill_versions[-1] < final.version
    theta = MANIFEST.unpack_flat(MANIFEST.pack(init)).clone()
    outer = OuterOptimizer(theta, OUTER)
    for v in range(1, final.version + 1):
        _, _, payload, weight = acks[v]
        outer.step(MANIFEST.unpack_flat(payload), weight, version=v - 1)
    assert torch.equal(theta, MANIFEST.unpack_flat(final.payload))
    print(
        f"6 kills at versions {kill_versions}; final version {final.version}; "
        f"{len(duplicates)} pushes answered as duplicates after a restart"
    )


@pytest.mark.timeout(120)
def test_workers_killed_at_random_do_not_stop_the_run(tmp_path):
    with ParameterServer(
        ServerConfig(port=0, local_steps=2, lease_s=2.0, outer=OuterConfig(optimizer="sgd", lr=0.5, momentum=0.0))
    ) as srv:

        def spawn(index: int, steps: int) -> subprocess.Popen:
            return subprocess.Popen(
                [sys.executable, str(HERE / "_tiny_worker.py"), srv.address, str(index), str(steps)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )

        procs = [spawn(i, 100) for i in range(4)]
        rng = random.Random(1)
        victims = rng.sample(range(4), 2)
        for v in victims:
            assert procs[v].stdout.readline().startswith("joined")  # it is in the run
            wait_until(lambda: srv.state.version >= 2, "pushes to flow")
            time.sleep(rng.uniform(0.0, 0.5))  # a random moment: the fault being injected
            procs[v].kill()
            procs[v].wait(timeout=30)
        procs.append(spawn(9, 60))  # a newcomer joins mid-run
        for i, p in enumerate(procs):
            if i in victims:
                continue
            out, err = p.communicate(timeout=90)
            assert p.returncode == 0, err[-2000:]
            assert "done" in out
        st = srv.state.status()
        # (a push may be refused when a worker's lease ran out on the loaded machine; it rejoins)
        assert st.version == st.applied_pushes > 0, st
        # the killed workers' leases run out (lease_s = 2)
        wait_until(lambda: not any(w.alive for w in srv.state.status().workers), "every lease to lapse")


@pytest.mark.timeout(180)
def test_32_concurrent_workers_push_and_pull_without_errors_and_bounded_memory(tmp_path):
    server = ServerProcess(
        tmp_path, "-H", "1", "--outer-optimizer", "sgd", "--outer-lr", "0.1", "--outer-momentum", "0"
    )
    manifest = Manifest.from_named_tensors([("w", torch.zeros(50_000))])  # 200 KB per push and per pull
    with ParameterServerClient(server.address) as c:
        wid = c.join(manifest, "init").worker_id
        c.push(
            manifest.pack([torch.zeros(50_000)]),
            worker_id=wid,
            push_id=1,
            base_version=0,
            kind=pb.PUSH_KIND_INITIAL_PARAMETERS,
        )
    errors = []
    clients = [ParameterServerClient(server.address, rpc_timeout_s=60) for _ in range(32)]
    ids = [c.join(manifest, f"w{i}").worker_id for i, c in enumerate(clients)]
    payload = manifest.pack([torch.full((50_000,), -0.01)])
    barrier = threading.Barrier(33)

    def rounds(i: int, first: int, n: int) -> None:
        try:
            for k in range(first, first + n):
                base = clients[i].pull(manifest, ids[i]).version
                assert clients[i].push(payload, worker_id=ids[i], push_id=k, base_version=base).applied
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
        barrier.wait(timeout=150)

    def phase(first: int, n: int) -> None:
        threads = [threading.Thread(target=rounds, args=(i, first, n)) for i in range(32)]
        for t in threads:
            t.start()
        barrier.wait(timeout=150)
        for t in threads:
            t.join()

    phase(2, 3)  # warm up: thread pool, channels, allocator
    rss_warm = server.rss_bytes()
    phase(5, 12)
    rss_end = server.rss_bytes()
    for c in clients:
        c.close()
    with ParameterServerClient(server.address) as c:
        st = c.status()
        theta = manifest.unpack_flat(c.pull(manifest).payload)
    server.stop()
    assert not errors, errors[:3]
    assert st.version == st.applied_pushes == 32 * 15 and st.rejected_pushes == 0 and st.duplicate_pushes == 0
    assert torch.allclose(theta, torch.full_like(theta, 0.1 * 0.01 * st.version), rtol=1e-4)
    growth = rss_end - rss_warm
    print(
        f"server RSS {rss_warm / 2**20:.1f} MiB after warm-up, "
        f"{rss_end / 2**20:.1f} MiB after 384 more push+pull rounds"
    )
    assert growth < 64 * 2**20, f"server RSS grew by {growth / 2**20:.1f} MiB"


@pytest.mark.timeout(60)
def test_a_worker_is_recognised_by_a_restarted_server_and_nothing_is_reinitialised(tmp_path):
    from torch import nn

    from asyncdiloco import AsyncDiLoCoWorker, WorkerConfig
    from asyncdiloco.ps.config import DurabilityConfig

    def config(port: int) -> ServerConfig:
        return ServerConfig(
            port=port, local_steps=2, outer=OUTER, durability=DurabilityConfig(checkpoint_dir=str(tmp_path / "ckpt"))
        )

    srv = ParameterServer(config(0)).start()
    port = srv.port
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(16, 4)

    def steps(n: int) -> None:
        for _ in range(n):
            nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
            opt.step()
            opt.zero_grad()

    cfg = WorkerConfig(server=srv.address, initial_backoff_s=0.01, max_backoff_s=0.05, rpc_timeout_s=2)
    worker = AsyncDiLoCoWorker(model, opt, cfg)
    worker.join()
    steps(6)
    first_id, version = worker.worker_id, srv.state.version
    assert version == 3
    theta = srv.state.params.clone()
    srv.stop(None)
    steps(2)  # the sync fails: the server is down; training goes on
    assert worker.stats.sync_failures >= 1
    srv = ParameterServer(config(port)).start()  # same folder, same port
    try:
        assert srv.state.version == version and torch.equal(srv.state.params, theta)
        deadline = time.monotonic() + STUCK_S
        while srv.state.version == version:  # the worker's backoff ends; its next sync lands
            assert time.monotonic() < deadline, "the worker never synced with the restarted server"
            steps(2)
        assert worker.worker_id == first_id  # no rejoin, no re-initialisation
        assert [w.worker_id for w in srv.state.status().workers] == [first_id]
    finally:
        worker.close()
        srv.stop(None)


@pytest.mark.timeout(90)
def test_server_refuses_to_start_from_a_corrupt_checkpoint_unless_told_to_fall_back(tmp_path):
    folder = tmp_path / "ckpt"
    server = ServerProcess(tmp_path, "--checkpoint-dir", str(folder), "--checkpoint-every", "2", *OUTER_FLAGS)
    with ParameterServerClient(server.address) as c:
        wid = c.join(MANIFEST, "w").worker_id
        c.push(
            MANIFEST.pack(delta_for(0, 0)),
            worker_id=wid,
            push_id=1,
            base_version=0,
            kind=pb.PUSH_KIND_INITIAL_PARAMETERS,
        )
        for k in range(3):
            c.push(MANIFEST.pack(delta_for(1, k)), worker_id=wid, push_id=k + 2, base_version=k)
        theta = c.pull(MANIFEST).payload
    assert "stopped at version 3" in server.stop()
    newest = sorted(folder.glob("ckpt-*.pt"))[-1]
    newest.write_bytes(newest.read_bytes()[:-10])  # truncated
    flags = [*CLI, "server", "--drain-s", "0", "--port", "0", "--checkpoint-dir", str(folder), *OUTER_FLAGS]
    refused = subprocess.run(flags, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1
    assert f"checkpoint tensors {newest} are missing, truncated or corrupt" in refused.stderr
    assert "start with --fallback-to-previous" in refused.stderr
    server.flags += ["--fallback-to-previous"]
    server.port = 0
    server.start()
    with ParameterServerClient(server.address) as c:
        pulled = c.pull(MANIFEST)
    assert pulled.version == 3 and torch.equal(pulled.payload, theta)  # previous checkpoint + the log
    server.stop()
