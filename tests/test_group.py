"""A torch.distributed group (torchrun) trained as ONE worker (worker/group.py).

The processes are real: two ranks of a gloo group (a FileStore in the test's folder)
train a DDP model against an in-process server on 127.0.0.1 (tests/_group_worker.py).
Every rank records the CRC-32 of its parameters after every inner step: the ranks must
be bit-identical at every step (so after every sync), the server must see one worker
with the group's size and the sum of the ranks' tokens, and the loss must fall.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import threading

import pytest
import torch
from torch import nn

from asyncdiloco import AsyncDiLoCoWorker, WorkerConfig
from asyncdiloco.errors import ConfigError
from asyncdiloco.worker.group import resolve_group, unwrap_model

HERE = pathlib.Path(__file__).resolve().parent
SCRIPT = HERE / "_group_worker.py"
PROCESS_TIMEOUT_S = 90
#: A tiny default job for the CLI (seconds, not minutes, on a CPU).
CLI_JOB = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--context-len", "16", "--batch-size", "8"]


def _env() -> dict[str, str]:
    """The children's environment: this checkout importable, gloo on the loopback interface."""
    return {**os.environ, "PYTHONPATH": str(HERE.parent), "GLOO_SOCKET_IFNAME": "lo"}


def _run_group(tmp_path: pathlib.Path, server: str, *extra: str, world: int = 2, tag: str = "g") -> list[dict]:
    """Start ``world`` ranks of _group_worker.py, wait for all of them (bounded), return their outputs."""
    init_file = tmp_path / f"{tag}-store"
    outs = [tmp_path / f"{tag}-rank{r}.json" for r in range(world)]
    env = _env()
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), str(r), str(world), str(init_file), server, str(outs[r]), *extra],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=PROCESS_TIMEOUT_S)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for r, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {r} exited {proc.returncode}:\n{logs[r] if r < len(logs) else ''}"
    return [json.loads(out.read_text()) for out in outs]


def _check_identical(ranks: list[dict]) -> None:
    steps = len(ranks[0]["steps"])
    assert all(len(r["steps"]) == steps for r in ranks)
    for i in range(steps):
        crcs = {r["steps"][i]["crc"] for r in ranks}
        assert len(crcs) == 1, f"the ranks' parameters differ after inner step {i + 1}"
    assert len({r["final_crc"] for r in ranks}) == 1, "the ranks' parameters differ after close"


def _loss_falls(rank: dict) -> None:
    losses = [s["loss"] for s in rank["steps"]]
    k = max(3, len(losses) // 5)
    assert sum(losses[-k:]) / k < 0.7 * sum(losses[:k]) / k, losses


def _only_worker_named(srv, name: str):
    return next(w for w in srv.state.registry.workers.values() if w.name == name)


def _only_worker(srv):
    workers = list(srv.state.registry.workers.values())
    assert len(workers) == 1, [w.name for w in workers]
    return workers[0]


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_a_ddp_group_trains_as_one_worker_with_identical_ranks(start_server, tmp_path):
    """Also: rank 1 alone asks to stop before step 36, and every rank stops after it; then
    rank 1 leaves its ``with`` block raising (its close is no collective) and rank 0's
    orderly close does not hang on it."""
    srv = start_server(local_steps=5, lease_s=30.0)
    ranks = _run_group(tmp_path, f"127.0.0.1:{srv.port}", "--steps", "60", "--stop-at", "35", "--last-rank-raises")
    _check_identical(ranks)
    steps = len(ranks[0]["steps"])
    assert steps == 36 and ranks[1].get("raised") and not ranks[0].get("raised")
    rec = _only_worker(srv)
    assert rec.name == "group" and rec.ranks == 2
    assert ranks[0]["steps"][-1]["syncs"] == 7  # every H = 5 steps
    assert rec.tokens == steps * (16 + 32) == ranks[0]["tokens"], "the server counts every rank's tokens"
    assert ranks[1]["tokens"] == steps * 32  # a follower counts its own
    assert ranks[0]["module_names"][0] == "0.weight"
    assert srv.state.model.manifest.tensors[0].name == "0.weight", "DDP's 'module.' prefix is dropped"
    _loss_falls(ranks[0])


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_h_w_changes_between_syncs_on_rank_0_alone_and_the_ranks_stay_identical(start_server, tmp_path, one_thread):
    """DyLU: the group (slowed) shares the server with a faster single worker, so rank 0's
    H_w drops below H after its rate report; the followers never learn H."""
    srv = start_server(local_steps=8, lease_s=30.0, dylu=True, grouping="off")
    fast_done = threading.Event()

    def fast_worker() -> None:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        opt = torch.optim.Adam(model.parameters(), lr=0.02)
        cfg = WorkerConfig(server=f"127.0.0.1:{srv.port}", worker_name="fast", heartbeat_s=0.2)
        with AsyncDiLoCoWorker(model, opt, cfg, tokens_per_step=16, process_group="off"):
            while not fast_done.is_set():
                nn.functional.mse_loss(model(torch.randn(16, 8)), torch.zeros(16, 1)).backward()
                opt.step()
                opt.zero_grad()
                fast_done.wait(0.002)  # fast, but leaves the group's ranks the CPU

    thread = threading.Thread(target=fast_worker, daemon=True)
    thread.start()
    try:
        ranks = _run_group(tmp_path, f"127.0.0.1:{srv.port}", "--steps", "32", "--overlap", "--step-sleep-s", "0.02")
    finally:
        fast_done.set()
        thread.join(timeout=30)
    _check_identical(ranks)
    h_ws = [s["local_steps"] for s in ranks[0]["steps"]]
    assert len(set(h_ws)) > 1 and min(h_ws) < 8, h_ws
    group = next(w for w in srv.state.registry.workers.values() if w.name == "group")
    assert group.ranks == 2 and group.tokens == 32 * 48


#: The group's collective timeout in the tests of long waits on the server, and the wait (seconds).
GROUP_TIMEOUT_S, HOLD_S = 2.0, 4.0


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_the_followers_outlast_a_held_push_reply_longer_than_the_groups_timeout(start_server, tmp_path):
    """The server holds the group's push reply for its grouping window (``grace_s``): a
    second worker is expected in every group (it reported a slow rate) and never pushes.
    Rank 1 waits out the hold in rank 0's keep-alive broadcasts, not in one collective
    that would time out after ``GROUP_TIMEOUT_S``. (With overlap the same wait comes at
    close, or 2 H steps after the push: the same ``_shared`` path.)"""
    from asyncdiloco.wire._proto import parameter_server_pb2 as pb
    from asyncdiloco.wire.tensors import Manifest
    from asyncdiloco.worker.client import ParameterServerClient

    srv = start_server(local_steps=5, lease_s=60.0, dylu=False, grouping="window", grace_s=HOLD_S)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))  # _group_worker.py's
    manifest = Manifest.from_module(model)
    idle = ParameterServerClient(f"127.0.0.1:{srv.port}")
    try:
        reply = idle.join(manifest, "idle", steps_per_s=1e-3)  # expected in every group for hours
        assert reply.initialize
        params = manifest.pack([p.detach() for p in model.parameters()])
        idle.push(params, worker_id=reply.worker_id, push_id=1, base_version=0, kind=pb.PUSH_KIND_INITIAL_PARAMETERS)
        args = ["--steps", "5", "--group-timeout-s", str(GROUP_TIMEOUT_S)]
        ranks = _run_group(tmp_path, f"127.0.0.1:{srv.port}", *args)  # one push (H = 5), held
    finally:
        idle.close()
    _check_identical(ranks)
    assert ranks[0]["held_s"] > GROUP_TIMEOUT_S, "the server held the reply longer than the group's timeout"
    assert ranks[1]["keep_alives"] >= 1 and ranks[0]["keep_alives"] == ranks[1]["keep_alives"]
    assert _only_worker_named(srv, "group").applied_pushes == 1


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_the_followers_outlast_a_quorum_wait_longer_than_the_groups_timeout(start_server, tmp_path):
    """Sync mode: rank 0 waits ``HOLD_S`` for a quorum of 2 that never forms (the
    group is the only worker); the round is skipped and the ranks train on together."""
    from asyncdiloco.ps.config import SyncConfig

    sync = SyncConfig(min_workers=2, join_timeout_s=HOLD_S - 1.0)  # the worker waits join_timeout_s + 1
    srv = start_server(mode="sync", local_steps=5, lease_s=60.0, sync=sync)
    args = ["--mode", "sync", "--steps", "7", "--quorum-timeout-s", "1", "--group-timeout-s", str(GROUP_TIMEOUT_S)]
    ranks = _run_group(tmp_path, f"127.0.0.1:{srv.port}", *args)
    _check_identical(ranks)
    assert ranks[0]["steps"][-1]["syncs"] == 1  # one round asked for at step 5, skipped: no quorum
    assert ranks[1]["keep_alives"] >= 1 and ranks[0]["keep_alives"] == ranks[1]["keep_alives"]


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_sync_rounds_with_a_group_and_a_single_worker_keep_the_ranks_identical(start_server, tmp_path):
    from asyncdiloco.ps.config import SyncConfig

    # fixed H: the checks below read the global model at every 5th step
    sync = SyncConfig(min_workers=2, join_timeout_s=5.0, local_steps="fixed")
    srv = start_server(mode="sync", local_steps=5, lease_s=30.0, sync=sync)
    results: dict[str, list[dict]] = {}

    def group(tag: str, world: int) -> None:
        results[tag] = _run_group(
            tmp_path, f"127.0.0.1:{srv.port}", "--mode", "sync", "--steps", "20", "--name", tag, world=world, tag=tag
        )

    threads = [threading.Thread(target=group, args=(tag, world)) for tag, world in (("pair", 2), ("solo", 1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=PROCESS_TIMEOUT_S + 30)
    assert set(results) == {"pair", "solo"}, "a group failed (its assertion is in the thread's output above)"
    _check_identical(results["pair"])
    assert results["pair"][0]["steps"][-1]["syncs"] >= 3  # rounds committed
    # after each committed round both workers hold the same global model: the solo rank's CRC matches the pair's
    pair, solo = results["pair"][0]["steps"], results["solo"][0]["steps"]
    synced = [i for i in range(4, 20, 5) if pair[i]["syncs"] == solo[i]["syncs"] == (i + 1) // 5]
    assert synced and all(pair[i]["crc"] == solo[i]["crc"] for i in synced)
    workers = {w.name: w for w in srv.state.registry.workers.values()}
    assert workers["pair"].ranks == 2 and workers["solo"].ranks == 1


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_a_restarted_group_resumes_as_itself_and_rank_0s_optimizer_state_reaches_every_rank(start_server, tmp_path):
    """Rank 0 alone keeps the state folder; a restarted group resumes the same worker and
    every rank continues with rank 0's restored Adam moments (a follower with a fresh
    optimizer would step differently and the ranks would part at the first step)."""
    srv = start_server(local_steps=5, lease_s=30.0)
    state = str(tmp_path / "state")
    first = _run_group(tmp_path, f"127.0.0.1:{srv.port}", "--steps", "12", "--state-dir", state, tag="run1")
    worker_id = _only_worker(srv).worker_id
    again = _run_group(tmp_path, f"127.0.0.1:{srv.port}", "--steps", "8", "--state-dir", state, tag="run2")
    for ranks in (first, again):
        _check_identical(ranks)
        for i in range(len(ranks[0]["steps"])):
            assert len({r["steps"][i]["opt_crc"] for r in ranks}) == 1, f"inner optimizer states differ at step {i}"
    assert _only_worker(srv).worker_id == worker_id and _only_worker(srv).ranks == 2
    assert [r["steps"][0]["opt_steps"] for r in again] == [13, 13], "the restarted ranks continue Adam's steps"


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_rank_0_failing_to_join_raises_on_every_rank(tmp_path):
    ranks = _run_group(tmp_path, "127.0.0.1:9", "--expect-join-error")  # port 9 (discard): nobody serves there
    assert [r["join_error"] for r in ranks] == ["ServerUnavailableError"] * 2
    assert "127.0.0.1:9" in ranks[1]["join_message"]


# ---------------------------------------------------------------- in-process checks
def test_the_process_group_argument_is_checked():
    assert resolve_group("auto") is None  # torch.distributed is not initialized here
    assert resolve_group("off") is None
    with pytest.raises(ConfigError, match="process_group='on' is invalid"):
        resolve_group("on")


def test_an_fsdp2_model_is_refused_and_ddp_is_unwrapped(tmp_path, monkeypatch):
    """Also: a group's keep-alive period follows its collective timeout."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from asyncdiloco.worker.group import KEEP_ALIVE_MAX_S, LocalGroup

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    timeout = datetime.timedelta(seconds=6)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1, timeout=timeout)
    try:
        default = LocalGroup(None)
        assert (default.timeout_s, default.keep_alive_s) == (6.0, 1.5)  # a quarter of the timeout
        long = LocalGroup(dist.new_group(timeout=datetime.timedelta(minutes=30)))
        assert (long.timeout_s, long.keep_alive_s) == (1800.0, KEEP_ALIVE_MAX_S)
        plain = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
        assert unwrap_model(DistributedDataParallel(plain)) is plain
        assert resolve_group("auto") is None  # one rank: no group
        sharded = fully_shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)), mesh=init_device_mesh("cpu", (1,)))
        with pytest.raises(ConfigError, match=r"sharded \(FSDPSequential\).*DistributedDataParallel"):
            AsyncDiLoCoWorker(sharded, torch.optim.SGD(sharded.parameters(), lr=0.1), WorkerConfig())
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------- the CLI
@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_torchrun_runs_the_cli_worker_as_one_group(start_server, tmp_path):
    srv = start_server(local_steps=10, lease_s=30.0)
    train_log, stats = tmp_path / "train.jsonl", tmp_path / "stats.json"
    torchrun = pathlib.Path(sys.executable).with_name("torchrun")
    argv = [str(torchrun), "--standalone", "--nproc-per-node", "2", str(torchrun.with_name("asyncdiloco"))]
    argv += ["worker", "--server", f"127.0.0.1:{srv.port}", "--worker-name", "box", "--max-steps", "40"]
    argv += ["--log-every", "10", "--train-log", str(train_log), "--stats-file", str(stats), *CLI_JOB]
    proc = subprocess.run(argv, env=_env(), capture_output=True, text=True, timeout=PROCESS_TIMEOUT_S + 60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rec = _only_worker(srv)
    assert rec.name == "box" and rec.ranks == 2
    summary = json.loads(stats.read_text())
    assert summary["inner_steps"] == 40 and summary["pushes_applied"] >= 4
    assert rec.tokens == summary["tokens"] == 2 * 40 * 8 * 16  # both ranks' batches (B 8 × T 16 each)
    lines = [json.loads(line) for line in train_log.read_text().splitlines()]
    losses = [line["loss_nats"] for line in lines if "loss_nats" in line]
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    assert proc.stdout.count("box: 40 inner steps") == 1, proc.stdout  # rank 0 alone prints the final line


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_torchrun_group_on_a_state_folder_in_use_fails_with_the_same_error_on_every_rank(start_server, tmp_path):
    """Rank 0 alone opens the state folder; its refusal reaches every rank before any
    collective, so rank 1 says the same thing instead of "Connection closed by peer"."""
    from asyncdiloco.worker.state_dir import WorkerStateDir

    srv = start_server(local_steps=10, lease_s=30.0)
    held = WorkerStateDir(str(tmp_path / "state"))  # another running worker holds it
    try:
        torchrun = pathlib.Path(sys.executable).with_name("torchrun")
        argv = [str(torchrun), "--standalone", "--nproc-per-node", "2", str(torchrun.with_name("asyncdiloco"))]
        argv += ["worker", "--server", f"127.0.0.1:{srv.port}", "--state-dir", str(tmp_path / "state")]
        argv += ["--worker-name", "box", "--max-steps", "5", *CLI_JOB]
        proc = subprocess.run(argv, env=_env(), capture_output=True, text=True, timeout=PROCESS_TIMEOUT_S + 60)
    finally:
        held.close()
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert out.count("is in use by another running worker") == 2, out  # rank 0's error, on both ranks
    assert "Connection closed by peer" not in out, out
    assert not srv.state.registry.workers, "nothing joined"
