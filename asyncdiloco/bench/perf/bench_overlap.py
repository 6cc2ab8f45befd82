"""The worker's time blocked on communication, with and without overlap (target ≤ 0.05
with; targets.py): one ``AsyncDiLoCoWorker`` training an MLP against a real server
process, ``overlap`` off and on, alternating. Measures; asserts nothing.
docs/performance.md, "Overlap"."""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from asyncdiloco.bench.perf.harness import MIB, emit, median, server_process
from asyncdiloco.bench.perf.targets import OVERLAP, target_for
from asyncdiloco.worker.async_worker import AsyncDiLoCoWorker
from asyncdiloco.worker.config import WorkerConfig


def build_mlp(width: int, depth: int, d_in: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(d_in, width), nn.GELU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.GELU()]
    layers.append(nn.Linear(width, d_in))
    return nn.Sequential(*layers)


def run_once(address: str, *, overlap: bool, h: int, rounds: int, width: int, depth: int, batch: int) -> dict:
    d_in = 256
    model = build_mlp(width, depth, d_in, seed=0)  # same init every run: the manifest matches the server's
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(batch, d_in, generator=gen), torch.randn(batch, d_in, generator=gen)) for _ in range(4)]
    cfg = WorkerConfig(server=address, overlap=overlap, worker_name=f"bench-overlap-{overlap}", timeout_s_per_mib=2.0)
    worker = AsyncDiLoCoWorker(model, opt, cfg, tokens_per_step=batch)
    worker.join()

    def steps(n: int) -> None:
        for i in range(n):
            x, y = data[i % len(data)]  # (B, d_in) each
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()  # every H-th step also syncs
            opt.zero_grad(set_to_none=True)

    try:
        steps(h)  # warm-up round; its sync point starts the window
        st = worker.stats
        t0, blocked0, comm0, pushes0 = time.perf_counter(), st.blocked_s, st.comm_s, st.pushes_applied
        steps(rounds * h)
        wall_s = time.perf_counter() - t0
        blocked_s, comm_s = st.blocked_s - blocked0, st.comm_s - comm0
    finally:
        worker.close()
    return {
        "wall_s": wall_s,
        "blocked_s": blocked_s,
        "comm_s": comm_s,
        "ratio": blocked_s / wall_s,
        "steps_per_s": rounds * h / wall_s,
        "pushes": worker.stats.pushes_applied - pushes0,
        "model_bytes": worker.manifest.total_bytes,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=10, help="rounds measured per run (default %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="runs per setting (default %(default)s)")
    p.add_argument("--local-steps", type=int, default=8, help="H, inner steps per round (default %(default)s)")
    p.add_argument("--width", type=int, default=1024, help="MLP width (default %(default)s)")
    p.add_argument("--depth", type=int, default=3, help="MLP hidden layers (default %(default)s)")
    p.add_argument("--batch", type=int, default=64, help="rows per inner step (default %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads of the worker (default %(default)s)")
    p.add_argument(
        "--sizes", default="", help="ignored (the perf suite passes it); the model is sized by --width/--depth"
    )
    p.add_argument("--out", default=None, help="append the JSON lines to this file")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    flags = ("--local-steps", str(args.local_steps), *"--outer-optimizer sgd --outer-lr 0.5 --outer-momentum 0".split())
    shape = {"h": args.local_steps, **{k: getattr(args, k) for k in ("rounds", "width", "depth", "batch")}}
    runs: dict[bool, list[dict]] = {False: [], True: []}
    with server_process(*flags) as (_, address):
        for _ in range(args.repeats):
            for overlap in (False, True):  # alternating, so drift in the machine's load hits both
                runs[overlap].append(run_once(address, overlap=overlap, **shape))
    base_rate = median([r["steps_per_s"] for r in runs[False]])
    for overlap in (False, True):
        rs = runs[overlap]
        med = {k: median([r[k] for r in rs]) for k in ("ratio", "blocked_s", "comm_s", "wall_s", "steps_per_s")}
        record = {"bench": "overlap", "measure": OVERLAP, "overlap": overlap, **med}
        record.update(model_mib=rs[0]["model_bytes"] / MIB, local_steps=args.local_steps, rounds=args.rounds)
        record.update(repeats=args.repeats, comm_per_round_s=med["comm_s"] / args.rounds)
        record.update(speedup_vs_no_overlap=med["steps_per_s"] / base_rate, ratios=[round(r["ratio"], 4) for r in rs])
        if overlap:
            record["target"] = target_for(OVERLAP)
        emit(record, args.out)


if __name__ == "__main__":
    main()
