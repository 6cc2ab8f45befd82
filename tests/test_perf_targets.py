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
