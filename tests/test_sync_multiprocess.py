"""Sync mode with real processes: a server and three workers through the CLI (the demo
code), one of them SIGKILLed with its allreduce in flight (tests/_faulty_sync_worker.py)."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

from asyncdiloco.bench.demo import DemoConfig, run_demo
from asyncdiloco.job.config import JobConfig

pytestmark = [pytest.mark.multiprocess, pytest.mark.heavy, pytest.mark.timeout(240)]

ALLREDUCE_TIMEOUT_S = 3.0
#: Runs the CLI worker with the fault of tests/faults.py installed.
FAULTY_WORKER = pathlib.Path(__file__).with_name("_faulty_sync_worker.py")


def test_killing_one_of_three_workers_mid_allreduce_fails_the_round_then_two_train_on(tmp_path):
    cfg = DemoConfig(
        mode="sync",
        num_workers=3,
        max_seconds=16.0,
        out_dir=str(tmp_path),
        slowdowns=(1.0, 1.0, 1.0),
        server_args=(
            "--mode",
            "sync",
            "--min-workers",
            "2",
            "--quorum-wait-s",
            "4",
            "--round-timeout-s",
            "20",
            "--local-steps",
            "5",
            "--outer-optimizer",
            "nesterov",
            "--outer-lr",
            "0.7",
            "--outer-momentum",
            "0.9",
        ),
        worker_args=("--allreduce-timeout-s", str(ALLREDUCE_TIMEOUT_S), "--quorum-timeout-s", "3"),
        # processes start at different times: die in the first round >= 3 that all three are in
        per_worker_command=((), (), (sys.executable, str(FAULTY_WORKER), "kill", "3", "3")),
        job=JobConfig(n_embd=32, n_head=4, batch_size=16, context_len=32),
        eval_every_s=4.0,
    )
    report = run_demo(cfg, progress=False)
    assert report["mode"] == "sync"
    assert [w["exit_code"] for w in report["workers"]] == [0, 0, -9]
    assert report["rounds_failed"] >= 1
    assert report["rounds_committed"] == report["version"] >= 4
    assert report["final_eval_loss"] < report["initial_eval_loss"] - 0.3
    assert report["round_time_s"] is not None and report["workers"][0]["idle_s"] > 0

    survivors = [json.loads((tmp_path / f"worker-{i}.json").read_text()) for i in (0, 1)]
    for stats in survivors:
        rounds = stats["rounds"]
        failed = [i for i, r in enumerate(rounds) if not r["committed"]]
        assert failed, "the kill must fail a round on the survivors"
        first = failed[0]
        assert rounds[first]["world_size"] == 3
        if first > 0:  # discarded: still at the round committed before it
            assert rounds[first]["round"] == rounds[first - 1]["round"]
        assert rounds[first]["allreduce_s"] < ALLREDUCE_TIMEOUT_S + 10.0  # failed by the bound (slack: load)
        after = [r for r in rounds[first + 1 :] if r["committed"]]
        assert len(after) >= 2 and all(r["world_size"] == 2 for r in after)  # a two-member quorum trains on
    by_round: dict[int, set[int]] = {}
    for stats in survivors:
        for r in stats["rounds"]:
            if r["committed"]:
                by_round.setdefault(r["round"], set()).add(r["checksum"])
    assert by_round and all(len(sums) == 1 for sums in by_round.values())
