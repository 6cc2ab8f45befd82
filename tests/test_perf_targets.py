"""The performance suite carries issue 16's targets in its target column (targets.py)
and keeps each row's cause note; rows without a target show "—"."""

from __future__ import annotations

import pytest

from asyncdiloco.bench.perf.perf_suite import summarize
from asyncdiloco.bench.perf.targets import OUTER_STEP, PEAK_RSS, PUSH_RATE, TRANSPORT, target_for


def test_targets_are_the_issue_16_table():
    assert target_for(TRANSPORT, "grpc-stream") == 0.6
    assert target_for(TRANSPORT, "bulk-tcp") == 0.9
    assert target_for(OUTER_STEP, model_mib=4) == 1.1
    assert target_for(PEAK_RSS, model_mib=64) == 1.8
    assert target_for(PEAK_RSS, model_mib=4) is None  # "at >= 64 MiB"
    assert target_for(PUSH_RATE, "grpc-stream") == 300
    assert target_for(PUSH_RATE, "bulk-tcp") == 500
    with pytest.raises(KeyError, match="not a measure"):
        target_for("throughput")


def test_summary_shows_target_met_and_cause():
    rows = [
        {"measure": TRANSPORT, "path": "grpc-stream", "model_mib": 64, "ratio": 0.5, "target": 0.6, "note": "CRC"},
        {"measure": PUSH_RATE, "path": "bulk-tcp", "model_mib": 3.8, "pushes_per_s": 510, "target": 500, "note": ""},
        {"measure": PEAK_RSS, "model_mib": 4, "ratio": 9.0, "target": None, "note": "fixed costs"},
    ]
    lines = summarize(rows).splitlines()
    assert (
        "| push+pull throughput / raw TCP loopback throughput | grpc-stream | 64 MiB | 0.5 | ≥ 0.6 | no | CRC |"
        in lines
    )
    assert any("| 510 | ≥ 500 | yes |" in line for line in lines)
    assert any("| 4 MiB | 9 | — | — | fixed costs |" in line for line in lines)


def test_gpu_rows_carry_their_target_and_a_cpu_machine_says_it_skipped(capsys):
    """The suite's GPU rows (bench_gpu.py) from one gpu_check transfer result; without a
    CUDA device the script writes one "skipped" line, which the summary reports."""
    from asyncdiloco.bench.perf import bench_gpu
    from asyncdiloco.bench.perf.targets import GPU_COPIES

    result = {
        "model_mib": 64.0,
        "ok": True,
        "pinned_h2d_gb_per_s": 20.0,
        "pinned_d2h_gb_per_s": 18.0,
        "copy_into_s": 0.004,
        "load_s": 0.004,
        "push_pull_s": 0.5,
        "flat_copies_vs_pinned": 1.1,
        "push_pull_vs_pinned": 70.0,
    }
    copies, push_pull = bench_gpu.rows(result)
    assert (copies["measure"], copies["target"], copies["ratio"]) == (GPU_COPIES, 1.2, 1.1)
    assert push_pull["target"] is None
    lines = summarize([copies, push_pull, {"bench": "gpu", "skipped": "no CUDA device"}]).splitlines()
    assert any("| 64 MiB | 1.1 | ≤ 1.2 | yes |" in line for line in lines)
    assert "Skipped: gpu: no CUDA device." in lines
    if not __import__("torch").cuda.is_available():
        bench_gpu.main(["--sizes", "4"])
        assert '"skipped": "no CUDA device' in capsys.readouterr().out
