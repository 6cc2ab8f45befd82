"""The peer row: our ``--mode sync`` beside torchft's DiLoCo (torchft runs only where the
optional ``peer`` extra is installed)."""

import pytest

from asyncdiloco.bench import peer_sync
from asyncdiloco.bench.peer_sync import peer_section
from asyncdiloco.bench.peer_torchft import run_peer, torchft_available
from asyncdiloco.bench.suite_config import SuiteConfig
from asyncdiloco.job.config import JobConfig


def _row(name: str, training: float, command: float) -> dict:
    return {
        "peer": name,
        "final_eval_loss": 2.36,
        "median_round_s": 0.3,
        "outer_steps": 8,
        "training_wall_s": training,
        "command_wall_s": command,
    }


def test_the_report_says_why_torchfts_line_is_missing_and_still_shows_ours(tmp_path, monkeypatch):
    monkeypatch.setattr("asyncdiloco.bench.peer_torchft.torchft_available", lambda: False)
    ran = []

    def ours(**kw):
        ran.append(kw)
        return _row("asyncdiloco --mode sync", 4.0, 10.0)

    monkeypatch.setattr(peer_sync, "run_ours", ours)
    text = peer_section(SuiteConfig(profiles=("uneven",)), tmp_path, progress=False)
    assert "torchft is not installed" in text and "asyncdiloco[peer]" in text
    assert "| asyncdiloco --mode sync | 2.360 | 0.300 | 8 | 4.00 | 10.0 |" in text
    assert ran and ran[0]["replicas"] == 4 and ran[0]["steps"] == SuiteConfig(profiles=("uneven",)).total_steps // 4


def test_the_row_shows_both_walls_and_ours_over_torchfts():
    text = peer_sync.row_table([_row("ours", 3.0, 12.0), _row("torchft", 4.0, 10.0)])
    assert "training wall (s) | whole command (s)" in text
    assert "| ours ÷ torchft | | 1.00 | | 0.75 | 1.20 |" in text


def test_the_training_wall_runs_from_the_first_join_to_the_last_step():
    def worker(join: float, end: float, ends: list[float]) -> dict:
        rounds = [{"committed": True, "end_s": e} for e in ends]
        return {
            "name": "w",
            "join_started_unix_s": join,
            "train_ended_unix_s": end,
            "rounds": rounds,
            "rounds_committed": 3,
        }

    row = peer_sync.summarize([worker(100.0, 104.0, [1, 2, 3]), worker(101.0, 104.5, [1.5, 2.0, 3.5])], 20.0, 2.4, 10)
    assert row["training_wall_s"] == pytest.approx(4.5)
    assert row["median_round_s"] == pytest.approx(1.0)  # of 1, 1, 0.5, 1.5
    assert row["command_wall_s"] == 20.0 and row["outer_steps"] == 3
    with pytest.raises(RuntimeError, match="join_started_unix_s"):
        peer_sync.summarize([{"name": "old", "rounds": []}], 1.0, 2.0, 3)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_our_sync_side_runs_on_loopback_and_learns(tmp_path):
    job = JobConfig(n_layer=1, n_embd=32, context_len=16, batch_size=8)
    r = peer_sync.run_ours(replicas=2, steps=20, local_steps=10, out_dir=str(tmp_path), job=job, timeout_s=240)
    assert r["outer_steps"] == 2 and r["median_round_s"] > 0
    assert 0 < r["training_wall_s"] < r["command_wall_s"]
    phases = r["phases_s"]
    assert phases["first_join_s"] <= phases["last_join_s"] <= phases["first_round_s"] <= phases["last_step_s"]
    assert phases["last_step_s"] <= phases["workers_exited_s"] <= phases["evaluated_s"]
    assert r["final_eval_loss"] < 4.17  # from ln(65)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.skipif(not torchft_available(), reason="the optional peer extra (torchft) is not installed")
def test_torchft_diloco_runs_on_loopback_and_learns(tmp_path):
    r = run_peer(replicas=2, steps=40, local_steps=10, out_dir=str(tmp_path))
    assert r["outer_steps"] == 4 and r["median_round_s"] > 0
    assert r["final_eval_loss"] < 3.5  # from ln(65) ≈ 4.17
    assert 0 < r["training_wall_s"] < r["command_wall_s"]
