"""The worker's CUDA path against torch's pinned-memory copies of the same bytes, in the
same run (docs/performance.md, "GPU rows"; targets: targets.py); without a CUDA device one line
saying it was skipped. Rows: ``device copies`` (``FlatParams.copy_into`` / ``load``, the
copies every sync makes) and ``push+pull from a CUDA model`` (one H = 1 sync through a
server on 127.0.0.1, bounded by the host's transport).

    python -m asyncdiloco.bench.perf.bench_gpu [--sizes 4,64,256] [--out FILE]
"""

from __future__ import annotations

import argparse

import torch

from asyncdiloco.bench.perf.harness import MIB, emit, parse_sizes
from asyncdiloco.bench.perf.targets import GPU_COPIES, GPU_PUSH_PULL, target_for


def rows(result: dict) -> list[dict]:
    """The suite's rows of one ``gpu_check.check_transfer`` result."""
    mib = result["model_mib"]
    note = (
        f"pinned H2D {result['pinned_h2d_gb_per_s']:.1f} GB/s, D2H {result['pinned_d2h_gb_per_s']:.1f} GB/s; "
        f"host buffers pinned: {result['ok']}"
    )
    return [
        {
            "bench": "gpu",
            "measure": GPU_COPIES,
            "model_mib": mib,
            "ratio": result["flat_copies_vs_pinned"],
            "target": target_for(GPU_COPIES),
            "copy_into_s": result["copy_into_s"],
            "load_s": result["load_s"],
            "note": note,
        },
        {
            "bench": "gpu",
            "measure": GPU_PUSH_PULL,
            "model_mib": mib,
            "ratio": result["push_pull_vs_pinned"],
            "target": target_for(GPU_PUSH_PULL),
            "push_pull_s": result["push_pull_s"],
            "note": "bounded by the host transport (bench_transport's rows), not by the device copies",
        },
    ]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="4,64,256", help="model sizes in MiB (default 4,64,256)")
    p.add_argument("--out", help="also append the JSON lines to this file")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        emit({"bench": "gpu", "skipped": "no CUDA device (torch.cuda.is_available() is False)"}, args.out)
        return
    from asyncdiloco.bench.gpu_check import check_transfer

    for n in parse_sizes(args.sizes):
        for row in rows(check_transfer(max(1, n // MIB))):
            emit(row, args.out)


if __name__ == "__main__":
    main()
