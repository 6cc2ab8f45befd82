"""The server-kill chaos benchmark, cut to 3 kills: real ``AsyncDiLoCoWorker`` processes
keep training while the server is SIGKILLed and restarted on its folder and port, each
kill right after a log append (between logging a push and answering it); every push a
worker saw acknowledged is in the write-ahead log exactly once, and one replay of the
whole log gives the final server's model bit for bit. asyncdiloco/bench/chaos/server_kills.py
runs the full 20 kills and reports the figures (docs/operations.md, "Chaos runs")."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.heavy]

FLAGS = ["--kills", "3", "--workers", "2", "--mean-up-s", "2", "--tail-s", "2", "--seed", "1", "--after-append"]


@pytest.mark.timeout(300)
def test_three_server_kills_lose_no_acknowledged_push_and_apply_none_twice(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncdiloco.bench.chaos.server_kills", *FLAGS, "--out", str(tmp_path / "run")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the benchmark reaps its server and workers on SIGTERM
        out, err = proc.communicate(timeout=30)
        pytest.fail(f"the chaos run did not finish in 240 s:\n{out[-3000:]}\n{err[-3000:]}")
    assert proc.returncode == 0, err[-3000:]
    result = json.loads(out.splitlines()[-1])
    checks = ("completed", "lost", "applied_twice", "archive_complete", "replay_identical", "version_matches")
    assert {k: result[k] for k in checks} == {
        "completed": True,
        "lost": 0,
        "applied_twice": 0,
        "archive_complete": True,
        "replay_identical": True,
        "version_matches": True,
    }, result
    assert result["acknowledged"] > 0, result
    print(f"{result['acknowledged']} pushes acknowledged, {result['acknowledged_as_duplicate']} of them after a kill")
