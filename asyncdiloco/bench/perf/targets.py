"""The performance suite's targets (issue 16, "Performance, second round"), in one place:
each benchmark takes its row's target from here, and perf_suite.py shows it in the
target column beside the measured value and its cause.

    target_for(measure, path="", model_mib=0.0) -> float | None   (None: a row without a target)
"""

from __future__ import annotations

TRANSPORT = "push+pull throughput / raw TCP loopback throughput"
OUTER_STEP = "outer step / fused torch SGD(nesterov)"
PEAK_RSS = "peak RSS growth / (params + momentum), 8 pushers"
PUSH_RATE = "pushes applied per second, 1M params, 16 workers"
OVERLAP = "worker blocked on communication / worker wall time"
GPU_COPIES = "worker device<->pinned host copies / torch pinned copies"
GPU_PUSH_PULL = "push+pull from a CUDA model / torch pinned copies"

#: measure -> (sign, larger is better)
SIGNS = {
    TRANSPORT: ("≥", True),
    OUTER_STEP: ("≤", False),
    PEAK_RSS: ("≤", False),
    PUSH_RATE: ("≥", True),
    OVERLAP: ("≤", False),
    GPU_COPIES: ("≤", False),
    GPU_PUSH_PULL: ("≤", False),
}

#: (measure, path) -> target; path "" for measures with one row per size.
_TARGETS = {
    (TRANSPORT, "grpc-stream"): 0.6,
    (TRANSPORT, "bulk-tcp"): 0.9,
    (OUTER_STEP, ""): 1.1,
    (PEAK_RSS, ""): 1.8,
    (PUSH_RATE, "grpc-one"): 300.0,
    (PUSH_RATE, "grpc-stream"): 300.0,
    (PUSH_RATE, "bulk-tcp"): 500.0,
    (OVERLAP, ""): 0.05,
    (GPU_COPIES, ""): 1.2,
}

#: The memory target holds from this model size up (MiB): below it the fixed costs
#: (gRPC's buffers, thread stacks, the 64 MiB receive budget) dominate θ + m.
PEAK_RSS_FROM_MIB = 64.0


def target_for(measure: str, path: str = "", model_mib: float = 0.0) -> float | None:
    """The target of one row: ``measure`` (one of the constants above), its ``path``
    ("grpc-one", "grpc-stream", "bulk-tcp" or ""), its model size in MiB; None where the row has none.

    Raises:
        KeyError: ``measure`` is not one of the suite's measures.
    """
    if measure not in SIGNS:
        raise KeyError(f"{measure!r} is not a measure of the suite; known: {sorted(SIGNS)}")
    if measure == PEAK_RSS and model_mib < PEAK_RSS_FROM_MIB:
        return None
    return _TARGETS.get((measure, path), _TARGETS.get((measure, "")))
