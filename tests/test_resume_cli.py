"""Done-when of workers that resume as themselves: a CLI worker with --worker-name and
--state-dir is killed with SIGKILL after a few syncs and started again; it gets its
worker id back (the server shows one worker), its data order goes on from the saved
position, and its AdamW state (the step count) from the saved one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from asyncdiloco.job.dataset import BatchStream, CharCorpus
from asyncdiloco.worker.state_dir import STATE_FILE, SUMMARY_FILE
from asyncdiloco.worker.state_file import read_state
from tests.helpers import wait_until

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

JOB = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--batch-size", "4", "--context-len", "16"]


def _start(address: str, folder, log_file, max_steps: int = 100000, name: str = "resumer") -> subprocess.Popen:
    argv = [sys.executable, "-m", "asyncdiloco", "worker", "--server", address, *(["--worker-name", name] * bool(name))]
    argv += ["--state-dir", str(folder), "--max-steps", str(max_steps), "--threads", "1", "--worker-index", "3", *JOB]
    return subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT)


def _summary(folder) -> dict:
    try:
        return json.loads((folder / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return {}


def _saves_by(folder, pid: int, at_least: int) -> dict:
    return wait_until(
        lambda: (s := _summary(folder)).get("pid") == pid and s.get("saves", 0) >= at_least and s,
        f"{at_least} saves of worker process {pid}",
    )


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


def test_a_killed_cli_worker_restarts_as_itself_and_continues(start_server, tmp_path):
    srv = start_server(local_steps=4, dylu=False, grouping="off", lease_s=60.0)
    folder = tmp_path / "state"
    with open(tmp_path / "first.log", "w") as log1:
        first = _start(srv.address, folder, log1)
        try:
            _saves_by(folder, first.pid, 4)  # the join's save and three syncs
            os.kill(first.pid, signal.SIGKILL)
        finally:
            _stop(first)
    killed = read_state(folder / STATE_FILE)  # what the restart continues from
    [row] = srv.state.status().workers
    worker_id, step = row.worker_id, killed["extra"]["step"]
    assert killed["worker_id"] == worker_id and step >= 12
    with open(tmp_path / "second.log", "w") as log2:
        second = _start(srv.address, folder, log2)
        try:
            later = _saves_by(folder, second.pid, 3)
            now = read_state(folder / STATE_FILE)
            status = srv.state.status().workers
        finally:
            _stop(second)
    assert [(w.worker_id, w.worker_name, w.alive) for w in status] == [(worker_id, "resumer", True)]
    assert later["worker_id"] == worker_id
    log = (tmp_path / "second.log").read_text()
    assert f"resuming at inner step {step} (data position {step})" in log
    # the data order went on from the saved position: replay it from there, batch by batch
    done = now["extra"]["step"]
    assert now["extra"]["batches"]["position"] == done > step
    stream = BatchStream(CharCorpus.default(), 4, 16, 0, 3)
    stream.load_state_dict(killed["extra"]["batches"])
    for _ in range(done - step):
        next(stream)
    assert torch.equal(stream.state_dict()["generator"], now["extra"]["batches"]["generator"])
    # AdamW's step count went on too (a fresh optimizer would count done − step)
    adam_steps = {float(s["step"]) for s in now["inner_optimizer"]["state"].values()}
    assert adam_steps == {float(done)}
    assert {float(s["step"]) for s in killed["inner_optimizer"]["state"].values()} == {float(step)}


def test_a_step_cut_short_before_the_inner_step_is_saved_as_not_done_with_its_batch_not_drawn():
    """A rank of a torchrun group dies in DDP's allreduce (or an interrupt lands in
    backward): the step that drew its batch never reached ``inner.step()``; the saved
    position must equal the saved step count, so a restart draws that batch again."""
    from asyncdiloco.cli.train import _Loop, _Pace
    from asyncdiloco.job.config import JobConfig

    job = JobConfig(batch_size=2, context_len=8, n_layer=1, n_embd=16, n_head=2)
    corpus = CharCorpus.default()
    model = job.build(corpus)
    inner, inner_lr = job.build_inner(model.parameters())
    batches = BatchStream(corpus, job.batch_size, job.context_len, job.seed, 0)
    loop = _Loop(None, model, inner, inner_lr, batches, _Pace(1.0, ()), None, "cpu")
    loop.inner_step()
    loop.inner_step()
    forward = model.forward
    model.forward = lambda *a: (_ for _ in ()).throw(RuntimeError("Connection closed by peer"))
    with pytest.raises(RuntimeError):
        loop.inner_step()
    model.forward = forward
    state = loop.state_dict()
    assert (state["step"], state["batches"]["position"]) == (2, 2)
    again = BatchStream(corpus, job.batch_size, job.context_len, job.seed, 0)
    again.load_state_dict(state["batches"])
    expected = BatchStream(corpus, job.batch_size, job.context_len, job.seed, 0)
    for _ in range(2):
        next(expected)
    assert all(torch.equal(a, b) for a, b in zip(next(again), next(expected)))  # the cut step's batch again


def test_a_cli_worker_restarted_on_a_damaged_state_trains_on_as_itself_and_exits_0(start_server, tmp_path):
    """The top exponent bit of θ_base[0] flipped on disk (-0.135 would load as -4.6e37, and
    the inner optimizer's state would turn NaN): the restart sets the file aside, rejoins
    under the name in state.json with its id, trains from the global model and ends well."""
    srv = start_server(local_steps=4, dylu=False, grouping="off", lease_s=60.0)
    folder = tmp_path / "state"
    with open(tmp_path / "first.log", "w") as log1:
        first = _start(srv.address, folder, log1)
        try:
            _saves_by(folder, first.pid, 2)
            os.kill(first.pid, signal.SIGKILL)
        finally:
            _stop(first)
    [row] = srv.state.status().workers
    file = folder / STATE_FILE
    data = bytearray(file.read_bytes())
    base = read_state(file)["theta_base"]
    data[bytes(data).index(bytes(base[:4].view(torch.uint8).tolist())) + 3] ^= 0x40
    file.write_bytes(bytes(data))
    with open(tmp_path / "second.log", "w") as log2:
        second = _start(srv.address, folder, log2, max_steps=8, name="")  # the name from the folder
        try:
            code = second.wait(timeout=120)
        finally:
            _stop(second)
    log = (tmp_path / "second.log").read_text()
    assert code == 0, log
    assert "state.pt fails its checksum" in log and "worker 'resumer' rejoins from the global model" in log
    assert "resuming at inner step" not in log and "Traceback" not in log
    [kept] = folder.glob(f"{STATE_FILE}.corrupt-*")
    assert kept.read_bytes() == bytes(data)
    assert [(w.worker_id, w.worker_name) for w in srv.state.status().workers] == [(row.worker_id, "resumer")]
    after = read_state(file)
    assert after["worker_name"] == "resumer" and after["extra"]["step"] == 8
    assert torch.isfinite(after["theta_base"]).all()
