"""The demo's leave and rejoin: a worker process stopped mid-run calls Leave, and a fresh
process with the same index joins as a new worker and trains."""

from __future__ import annotations

import re

import pytest

from asyncdiloco.bench.demo import DemoConfig, run_demo
from asyncdiloco.errors import ConfigError
from asyncdiloco.job.config import JobConfig

TINY = JobConfig(n_layer=1, n_embd=32, n_head=2, context_len=16, batch_size=8)


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_worker_1_leaves_and_a_fresh_process_rejoins_with_the_same_index(tmp_path):
    cfg = DemoConfig(
        num_workers=2,
        max_seconds=8.0,
        out_dir=str(tmp_path),
        slowdowns=(1.0, 1.0),
        server_args=("--local-steps", "5", "--outer-optimizer", "sgd", "--outer-lr", "0.5", "--outer-momentum", "0"),
        job=TINY,
        eval_every_s=2.0,
        leave_rejoin=(1, 1.0, 2.0),
    )
    report = run_demo(cfg, progress=False)
    workers = report["workers"]
    assert [(w["index"], w["rejoin"]) for w in workers] == [(0, False), (1, False), (1, True)]
    assert [w["exit_code"] for w in workers] == [0, 0, 0]
    first, again = workers[1], workers[2]
    assert first["left_s"] >= 1.0 and again["left_s"] is None
    assert again["join_at_s"] >= 2.0 and first["join_at_s"] is None
    assert again["train_started_s"] >= again["join_at_s"] - 1e-3  # it waited to be released
    assert again["name"] == first["name"] + "+rejoin"
    assert first["worker_ids"] and again["worker_ids"] and not set(first["worker_ids"]) & set(again["worker_ids"])
    assert again["inner_steps"] > 0 and again["pushes"] > 0
    assert report["leave_rejoin"] == [1, 1.0, 2.0]
    # The server saw worker 1's Leave before the new process joined.
    log = (tmp_path / "server.log").read_text()
    left = re.search(rf"worker {first['worker_ids'][0]} \(worker-1\(x1\)\) left", log)
    joined = re.search(rf"worker {again['worker_ids'][0]} \(worker-1\(x1\)\+rejoin\) joined", log)
    assert left and joined and left.start() < joined.start(), log[-2000:]
    assert (tmp_path / "worker-1-rejoin.json").exists() and (tmp_path / "worker-1-rejoin.log").exists()


@pytest.mark.parametrize(
    ("leave_rejoin", "needle"),
    [
        ((2, 1.0, 2.0), "leave_rejoin worker index 2 is invalid: give 0..1"),
        ((1, 3.0, 2.0), "need 0 <= leave < rejoin < max_seconds=8 s"),
        ((1, 1.0, 9.0), "rejoin at 9.0 s) are invalid"),
    ],
)
def test_bad_leave_rejoin_is_refused(leave_rejoin, needle):
    with pytest.raises(ConfigError) as err:
        DemoConfig(num_workers=2, max_seconds=8.0, leave_rejoin=leave_rejoin)
    assert needle in str(err.value)
