"""End to end: a server process and worker processes on 127.0.0.1, through the CLI."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys

import pytest

from asyncdiloco.bench.demo import DemoConfig, run_demo
from asyncdiloco.job.config import JobConfig

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

CLI = [sys.executable, "-m", "asyncdiloco"]


@pytest.mark.heavy  # four processes, about a minute in all: a load test, run after the suite
def test_server_and_three_worker_processes_lower_the_held_out_loss(tmp_path):
    job = JobConfig(n_embd=64, n_head=4)
    cfg = DemoConfig(
        num_workers=3,
        token_budget=240 * job.tokens_per_step,  # equal work on any machine: the loss drop below holds
        max_seconds=180.0,  # a bound only (the budget takes ~20 s on a 2-core machine)
        out_dir=str(tmp_path),
        slowdowns=(1.0, 1.5, 2.5),
        server_args=("--local-steps", "10", "--outer-optimizer", "sgd", "--outer-lr", "0.5", "--outer-momentum", "0"),
        job=job,
        eval_every_s=3.0,
    )
    report = run_demo(cfg, progress=False)
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk["final_eval_loss"] == report["final_eval_loss"]
    for key in (
        "initial_eval_loss",
        "final_eval_loss",
        "version",
        "applied_pushes",
        "rejected_pushes",
        "staleness_histogram",
        "bytes_pushed",
        "bytes_pulled",
        "wall_s",
        "tokens",
        "workers",
    ):
        assert key in report, key
    assert report["tokens"] >= cfg.token_budget  # stopped by the budget, not the time bound
    assert abs(report["initial_eval_loss"] - math.log(65)) < 0.3
    assert report["final_eval_loss"] < report["initial_eval_loss"] - 0.7
    assert report["version"] == report["applied_pushes"] > 0
    assert sum(report["staleness_histogram"]) == report["applied_pushes"]
    assert sum(report["staleness_histogram"][1:]) > 0, "three workers of different speeds must see staleness"
    assert report["bytes_pushed"] > 0 and report["bytes_pulled"] > 0
    assert [w["exit_code"] for w in report["workers"]] == [0, 0, 0]
    assert [w["speed_factor"] for w in report["workers"]] == [1.0, 1.5, 2.5]
    assert all(w["pushes"] > 0 and w["tokens"] > 0 for w in report["workers"])
    # the fastest worker did the most inner steps
    steps = [w["inner_steps"] for w in report["workers"]]
    assert steps[0] > steps[2]
    assert (tmp_path / "loss_curve.png").stat().st_size > 1000


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_worker_exits_nonzero_with_a_clear_message_when_it_cannot_join(cli_exit):
    port = _closed_port()
    code, err = cli_exit(["worker", "--server", f"127.0.0.1:{port}", "--max-steps", "1", "--join-retry-s", "1"])
    assert code == 1
    assert f"could not join the parameter server at 127.0.0.1:{port}" in err


def test_worker_without_a_bound_is_refused(cli_exit):
    code, err = cli_exit(["worker", "--server", "127.0.0.1:1"])
    assert code == 2
    assert "give --max-steps N or --max-seconds S" in err


def test_worker_with_an_unwritable_stats_file_is_refused_before_it_trains(cli_exit, tmp_path):
    stats = tmp_path / "no-such-folder" / "stats.json"
    code, err = cli_exit(["worker", "--server", "127.0.0.1:1", "--max-steps", "1", "--stats-file", str(stats)])
    assert code == 2
    assert "--stats-file" in err and "Traceback" not in err


def test_server_on_a_busy_port_exits_with_a_clear_message(cli_exit):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        code, err = cli_exit(["server", "--port", str(port)])
    assert code == 2
    assert f"cannot listen on 127.0.0.1:{port}" in err


def test_server_prints_the_chosen_port_and_stops_on_sigterm(tmp_path):
    port_file = tmp_path / "port"
    proc = subprocess.Popen(
        [*CLI, "-q", "server", "--drain-s", "0", "--port", "0", "--port-file", str(port_file)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("asyncdiloco server listening on 127.0.0.1:")
        assert int(line.rsplit(":", 1)[1]) == int(port_file.read_text())
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0
        assert "stopped at version 0" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["demo", "--slowdowns", "a,b"], "--slowdowns 'a,b' is invalid"),
        (["demo", "--local-steps", "0"], "local_steps=0 is invalid"),
        (["worker", "--server", "127.0.0.1:1", "--max-steps", "1", "--threads", "0"], "--threads 0 is invalid"),
        (["worker", "--server", "127.0.0.1:99999", "--max-steps", "1"], "server='127.0.0.1:99999' is invalid"),
        (["server", "--lease-s", "inf"], "lease_s=inf is invalid"),
        (["worker", "--server", "127.0.0.1:1", "--max-steps", "-5"], "max_steps=-5 is invalid"),
    ],
)
def test_bad_cli_values_get_one_line_errors(argv, needle, cli_exit):
    code, err = cli_exit(argv)
    assert code == 2, err
    assert needle in err and "Traceback" not in err
