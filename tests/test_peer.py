"""The torchft peer row: runs only where the optional ``peer`` extra is installed."""

import pytest

from asyncdiloco.bench.peer_torchft import run_peer, torchft_available
from asyncdiloco.bench.suite import SuiteConfig, peer_section


def test_the_report_says_why_the_peer_row_is_missing(tmp_path, monkeypatch):
    monkeypatch.setattr("asyncdiloco.bench.peer_torchft.torchft_available", lambda: False)
    text = peer_section(SuiteConfig(profiles=("uneven",)), tmp_path, progress=False)
    assert "torchft is not installed" in text and "asyncdiloco[peer]" in text


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.skipif(not torchft_available(), reason="the optional peer extra (torchft) is not installed")
def test_torchft_diloco_runs_on_loopback_and_learns(tmp_path):
    r = run_peer(replicas=2, steps=40, local_steps=10, out_dir=str(tmp_path))
    assert r["outer_steps"] == 4 and r["median_round_s"] > 0
    assert r["final_eval_loss"] < 3.5  # from ln(65) ≈ 4.17
