"""Time a worker's state.pt save and load with and without its checksum (worker/state_file.py).

    .venv/bin/python scripts/bench_state_file.py [--mib 256] [--repeat 5]

A state of four fp32 tensors (θ_base, θ_local, AdamW's two moments) of ``--mib`` MiB in
all, written to a temporary folder; prints the best of ``--repeat`` runs of a bare
``torch.save`` / ``torch.load`` (format 1) and of ``write_state`` / ``read_state``
(format 2: CRC-32 header, verified at load), and the raw speed of ``zlib.crc32`` and
``hashlib.sha256`` on the same number of bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import pathlib
import tempfile
import time
import zlib
from collections.abc import Callable

import torch

from asyncdiloco.worker.state_file import read_state, write_state


def _best(run: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="the state's size in MiB (default 256)")
    parser.add_argument("--repeat", type=int, default=5, help="runs of each; the best is printed (default 5)")
    args = parser.parse_args()
    n = args.mib * 2**20 // 16
    moments = {"exp_avg": torch.randn(n), "exp_avg_sq": torch.rand(n), "step": torch.tensor(1.0)}
    state = {
        "format": 2,
        "worker_name": "bench",
        "theta_base": torch.randn(n),
        "theta_local": torch.randn(n),
        "inner_optimizer": {"state": {0: moments}, "param_groups": []},
    }
    with tempfile.TemporaryDirectory() as tmp:
        old, new = pathlib.Path(tmp) / "old.pt", pathlib.Path(tmp) / "new.pt"

        def write_new() -> None:
            with open(new, "wb") as f:
                write_state(f, state)

        save1, save2 = _best(lambda: torch.save(state, old), args.repeat), _best(write_new, args.repeat)
        load1 = _best(lambda: torch.load(old, weights_only=True), args.repeat)
        load2 = _best(lambda: read_state(new), args.repeat)
    data = os.urandom(args.mib * 2**20)
    crc = _best(lambda: zlib.crc32(data), args.repeat)
    sha = _best(lambda: hashlib.sha256(data).digest(), args.repeat)
    print(f"state of {args.mib} MiB, best of {args.repeat}")
    print(f"save: torch.save {save1:.3f} s, with CRC-32 header {save2:.3f} s")
    print(f"load: torch.load {load1:.3f} s, verified {load2:.3f} s")
    print(f"zlib.crc32 {args.mib / crc:.0f} MiB/s, hashlib.sha256 {args.mib / sha:.0f} MiB/s")


if __name__ == "__main__":
    main()
