"""Push/pull throughput and each shard's CPU time per push through 1, 2 and 4 shard
processes, with worker threads pushing seeded pseudo-gradients and pulling. Measures;
asserts nothing. docs/performance.md, "A sharded server".

    python -m asyncdiloco.bench.perf.bench_shards [--shards 1,2,4] [--numel 4000000] [--pushes 20] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from asyncdiloco.bench.perf.harness import cpu_seconds, free_ports, reap
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.shards import write_shard_addresses
from asyncdiloco.wire.tensors import Manifest
from asyncdiloco.worker.sharded import ShardedClient


def start_shards(count: int, folder: Path) -> tuple[list[subprocess.Popen], list[str]]:
    addresses = [f"127.0.0.1:{p}" for p in free_ports(count)]
    path = folder / f"map-{count}.json"
    write_shard_addresses(path, addresses)
    procs = []
    for i in range(count):
        argv = [sys.executable, "-m", "asyncdiloco", "-q", "server", "--shard-index", str(i), "--shard-map", str(path)]
        argv += ["--grouping", "off", "--no-dylu", "--drain-s", "0", "--max-staleness", "1000"]
        procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return procs, addresses


def run(count: int, numel: int, pushes: int, workers: int, folder: Path) -> dict:
    procs, addresses = start_shards(count, folder)
    try:
        per = numel // 16
        manifest = Manifest.from_named_tensors([(f"p{i}", torch.empty(per)) for i in range(16)])
        clients = [ShardedClient(addresses, rpc_timeout_s=60.0) for _ in range(workers)]
        deadline = time.monotonic() + 60
        while True:
            try:
                joined = [c.join(manifest, f"w{k}") for k, c in enumerate(clients)]
                break
            except Exception:  # noqa: BLE001 - the shards are still starting
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        theta = torch.randn(manifest.numel, generator=torch.Generator().manual_seed(0))
        first = next(k for k, j in enumerate(joined) if j.initialize)
        initial = manifest.pack_flat(theta)
        clients[first].push(
            initial, worker_id=joined[first].worker_id, push_id=1, base_version=0, kind=pb.PUSH_KIND_INITIAL_PARAMETERS
        )
        payloads = [manifest.pack_flat(torch.randn(manifest.numel) * 1e-3) for _ in range(workers)]
        cpu0 = [cpu_seconds(p.pid) for p in procs]
        t0 = time.perf_counter()

        def loop(k: int) -> None:
            version = 0
            for n in range(pushes):
                clients[k].push(payloads[k], worker_id=joined[k].worker_id, push_id=n + 2, base_version=version)
                version = clients[k].pull(manifest, joined[k].worker_id).version

        threads = [threading.Thread(target=loop, args=(k,)) for k in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        cpu = [cpu_seconds(p.pid) - c for p, c in zip(procs, cpu0)]
        total = pushes * workers
        for c in clients:
            c.close()
        return {
            "bench": "shards",
            "shards": count,
            "workers": workers,
            "numel": manifest.numel,
            "pushes": total,
            "wall_s": round(wall, 3),
            "pushes_per_s": round(total / wall, 2),
            "push_pull_bytes_per_s": round(2 * total * manifest.total_bytes / wall),
            "shard_cpu_ms_per_push": [round(1000 * c / total, 2) for c in cpu],
            "max_shard_cpu_ms_per_push": round(1000 * max(cpu) / total, 2),
        }
    finally:
        reap(procs, timeout_s=30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", default="1,2,4", help="shard counts to run, comma separated (default %(default)s)")
    ap.add_argument("--numel", type=int, default=4_000_000, help="fp32 parameter elements (default %(default)s)")
    ap.add_argument("--pushes", type=int, default=20, help="push+pull rounds per worker (default %(default)s)")
    ap.add_argument("--workers", type=int, default=2, help="concurrent workers (default %(default)s)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for count in (int(s) for s in args.shards.split(",")):
            print(json.dumps(run(count, args.numel, args.pushes, args.workers, Path(tmp))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
