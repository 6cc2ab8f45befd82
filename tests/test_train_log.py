"""The CLI worker's training log (cli/train_log.py): JSON lines, TensorBoard scalars and
the process log, from short real runs against an in-process server; the arithmetic of a
log point on a fake clock; what a killed worker leaves behind."""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import sys
import types

import pytest
import torch
from helpers import FakeClock, wait_until

from asyncdiloco.cli.train import run_worker
from asyncdiloco.cli.train_log import TENSORBOARD_FIX, TrainLog, TrainLogConfig
from asyncdiloco.errors import ConfigError
from asyncdiloco.job.config import JobConfig
from asyncdiloco.worker.config import WorkerConfig
from asyncdiloco.worker.stats import WorkerStats

pytestmark = pytest.mark.timeout(120)

TINY_JOB = JobConfig(batch_size=2, context_len=8, n_layer=1, n_embd=16, n_head=2)
H = 3
LINE_KEYS = {
    "step",
    "loss_nats",
    "tokens_per_s",
    "local_steps",
    "staleness_versions",
    "pushes_applied",
    "pushes_refused",
    "bytes_pushed",
    "bytes_pulled",
    "blocked_s",
    "elapsed_s",
    "time_unix_s",
}


def _read(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_a_short_run_writes_json_lines_with_units_and_events(start_server, tmp_path, caplog, one_thread, recwarn):
    srv = start_server(local_steps=H)
    path = tmp_path / "train.jsonl"
    seen_while_training: list[int] = []

    def on_step(step: int, loss: float) -> None:  # the file is readable while the worker trains
        assert isinstance(loss, float)
        if step == 9:
            seen_while_training.extend(line.get("step", -1) for line in _read(path) if "event" not in line)

    with caplog.at_level(logging.INFO, logger="asyncdiloco"):
        stats = run_worker(
            worker_config=WorkerConfig(server=srv.address, worker_name="logged"),
            job=TINY_JOB,
            max_steps=10,
            on_step=on_step,
            train_log=TrainLogConfig(every=4, jsonl_path=str(path)),
        )
    lines = _read(path)
    events = [line["event"] for line in lines if "event" in line]
    assert events == ["join", "first_sync", "leave"]
    assert lines[0]["event"] == "join" and lines[-1]["event"] == "leave"
    join = lines[0]
    assert (join["name"], join["server"], join["mode"], join["local_steps"]) == ("logged", srv.address, "async", H)
    points = [line for line in lines if "event" not in line]
    assert [p["step"] for p in points] == [4, 8]
    assert seen_while_training == [4, 8]  # flushed per line, not at the end
    for p in points:
        assert set(p) == LINE_KEYS
        assert 0 < p["loss_nats"] < 10 and math.isfinite(p["loss_nats"])
        assert p["tokens_per_s"] > 0 and p["local_steps"] == H and p["staleness_versions"] == 0
    assert [p["pushes_applied"] for p in points] == [1, 2]  # H = 3: syncs after steps 3 and 6
    assert points[1]["bytes_pushed"] > points[0]["bytes_pushed"] > 0
    assert lines[-1]["step"] == 10 and lines[-1]["pushes_applied"] == stats.pushes_applied == 4  # and the last push
    first_sync = next(line for line in lines if line.get("event") == "first_sync")
    assert first_sync["step"] == H
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(f"joined {srv.address} as worker 1 (logged): H_w {H}, mode async") for m in messages)
    assert any(m.startswith(f"first sync after {H} inner steps") for m in messages)
    assert any(m.startswith("step 4: train loss ") and "tokens/s" in m and "1 pushes applied" in m for m in messages)
    assert not [w for w in recwarn if "requires_grad" in str(w.message)]  # float(loss) on a graph


def test_tensorboard_gets_the_same_scalars(start_server, tmp_path, one_thread):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    srv = start_server(local_steps=H)
    run_worker(
        worker_config=WorkerConfig(server=srv.address),
        job=TINY_JOB,
        max_steps=8,
        train_log=TrainLogConfig(every=4, tensorboard_dir=str(tmp_path / "tb")),
    )
    files = [f for f in os.listdir(tmp_path / "tb") if f.startswith("events.out.tfevents")]
    assert len(files) == 1
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {
        "train/loss_nats",
        "train/tokens_per_s",
        "sync/local_steps",
        "sync/pushes_applied",
        "comm/bytes_pushed",
    } <= tags
    assert [e.step for e in acc.Scalars("train/loss_nats")] == [4, 8]
    assert [e.value for e in acc.Scalars("sync/pushes_applied")] == [1.0, 2.0]


def test_without_tensorboard_the_flag_is_refused_naming_the_extra(monkeypatch, tmp_path, cli_exit):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    with pytest.raises(ConfigError, match=r"pip install 'asyncdiloco\[tensorboard\]'"):
        TrainLogConfig(tensorboard_dir=str(tmp_path / "tb"))
    argv = ["worker", "--server", "127.0.0.1:1", "--max-steps", "1", "--tensorboard-dir", str(tmp_path / "tb")]
    code, err = cli_exit(argv)
    assert code == 2 and TENSORBOARD_FIX in err


def test_bad_log_settings_are_refused_before_training(cli_exit, tmp_path):
    base = ["worker", "--server", "127.0.0.1:1", "--max-steps", "1"]
    code, err = cli_exit([*base, "--train-log", str(tmp_path / "missing" / "log.jsonl")])
    assert code == 2 and "--train-log" in err and "does not exist or is not writable" in err
    code, err = cli_exit([*base, "--log-every", "0"])
    assert code == 2 and "--log-every 0 is invalid" in err


class _FakeWorker:
    mode, worker_id, local_steps = "async", 7, 5

    def __init__(self) -> None:
        self.stats = WorkerStats()


def test_a_log_point_is_the_mean_loss_and_the_token_rate_since_the_previous_one(tmp_path):
    clock, w, path = FakeClock(100.0), _FakeWorker(), tmp_path / "log.jsonl"
    tlog = TrainLog(TrainLogConfig(every=2, jsonl_path=str(path)), clock=clock)
    tlog.joined(w, name="w", server="h:1")
    for step, loss in ((1, 3.0), (2, 2.0), (3, 1.0), (4, 1.5)):
        clock.advance(0.5)
        w.stats.tokens += 100
        if step == 3:
            w.stats.pushes_applied, w.stats.staleness, w.stats.bytes_pushed = 1, [2], 400
        tlog.after_step(step, torch.tensor(loss, requires_grad=True) * 1.0)
    tlog.left(4)
    lines = _read(path)
    assert [line.get("event", line.get("step")) for line in lines] == ["join", 2, "first_sync", 4, "leave"]
    first, second = lines[1], lines[3]
    assert (first["loss_nats"], first["tokens_per_s"], first["elapsed_s"]) == (2.5, 200.0, 1.0)
    assert (second["loss_nats"], second["staleness_versions"], second["pushes_applied"]) == (1.25, 2, 1)
    assert first["staleness_versions"] is None and lines[2]["step"] == 3
    assert lines[0] == {
        "event": "join",
        "worker_id": 7,
        "name": "w",
        "server": "h:1",
        "mode": "async",
        "local_steps": 5,
        "elapsed_s": 0.0,
        "time_unix_s": lines[0]["time_unix_s"],
    }


def test_sync_mode_lines_count_rounds():
    w = types.SimpleNamespace(mode="sync", worker_id=1, local_steps=4, stats=None)
    from asyncdiloco.worker.stats import SyncWorkerStats

    w.stats = SyncWorkerStats(rounds_committed=2, rounds_failed=1)
    from asyncdiloco.cli.train_log import _counters

    c = _counters(w)
    assert (c["rounds_committed"], c["rounds_failed"], c["staleness_versions"]) == (2, 1, 0)
    assert "pushes_applied" not in c


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_killed_worker_leaves_its_log_lines(start_server, tmp_path):
    srv = start_server(local_steps=H)
    jsonl, stderr_path = tmp_path / "train.jsonl", tmp_path / "worker.log"
    argv = ["worker", "--server", srv.address, "--max-steps", "100000", "--log-every", "2", "--train-log", str(jsonl)]
    job = ["--batch-size", "2", "--context-len", "8", "--n-layer", "1", "--n-embd", "16", "--n-head", "2"]
    with open(stderr_path, "wb") as err:  # redirected to a file, as the demo does (no PYTHONUNBUFFERED)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
        proc = subprocess.Popen([sys.executable, "-m", "asyncdiloco", *argv, *job], stderr=err, env=env)
    try:
        wait_until(lambda: jsonl.exists() and sum('"step"' in x for x in jsonl.read_text().splitlines()) >= 3, "lines")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = _read(jsonl)  # every line whole
    assert lines[0]["event"] == "join" and any(line.get("step") == 2 for line in lines)
    log_text = stderr_path.read_text()
    assert "joined " in log_text and "step 2: train loss" in log_text
    assert "UserWarning" not in log_text
