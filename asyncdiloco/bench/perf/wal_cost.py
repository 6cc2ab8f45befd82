"""Cost of durability: pushes/s of the parameter server in memory only, with the
write-ahead log without fsync, and with the log fsynced (the default with
``--checkpoint-dir``), in-process and through gRPC. Measures; asserts nothing.
docs/performance.md, "Durability"."""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import tempfile
import time

import torch

from asyncdiloco.algo.config import OuterConfig
from asyncdiloco.ps import ParameterServer, ParameterServerState
from asyncdiloco.ps.config import DurabilityConfig, ServerConfig
from asyncdiloco.ps.durable.store import DurableStore
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.header_crc import seal
from asyncdiloco.wire.tensors import Manifest, PayloadAssembler, crc32_of, iter_chunks, num_chunks_for
from asyncdiloco.worker.client import ParameterServerClient

MODES = {"memory": None, "wal": False, "wal+fsync": True}


def _fill(assembler: PayloadAssembler, chunks: list) -> None:
    for chunk in chunks:
        assembler.add(chunk)


def _config(mode: str, folder: str) -> ServerConfig:
    fsync = MODES[mode]
    durability = None if fsync is None else DurabilityConfig(checkpoint_dir=folder, checkpoint_every=100, fsync=fsync)
    return ServerConfig(port=0, outer=OuterConfig(optimizer="sgd", lr=0.1, momentum=0.0), durability=durability)


def bench_state(manifest: Manifest, mode: str, pushes: int, folder: str) -> float:
    cfg = _config(mode, folder)
    state = ParameterServerState(cfg)
    store = DurableStore(cfg.durability, cfg) if cfg.durability else None
    if store:
        store.open(state.durability)
    wid = state.join(manifest, "bench")[0]
    init = manifest.pack([torch.zeros(manifest.numel)])
    state.intake.push(init, worker_id=wid, push_id=1, kind=pb.PUSH_KIND_INITIAL_PARAMETERS)
    payload = manifest.pack([torch.full((manifest.numel,), 0.01)])
    chunks = list(iter_chunks(payload, cfg.chunk_bytes))
    started = time.perf_counter()
    for k in range(pushes):
        header = seal(
            pb.PushHeader(
                worker_id=wid,
                push_id=k + 2,
                base_version=state.version,
                total_bytes=payload.numel(),
                num_chunks=num_chunks_for(payload.numel(), cfg.chunk_bytes),
                crc32=crc32_of(payload),
                kind=pb.PUSH_KIND_PSEUDO_GRADIENT,
            )
        )
        state.intake.receive(header, fill=functools.partial(_fill, chunks=chunks), drain=lambda: None)
    elapsed = time.perf_counter() - started
    if store:
        store.close()
    return elapsed


def bench_grpc(manifest: Manifest, mode: str, pushes: int, folder: str) -> float:
    srv = ParameterServer(_config(mode, folder)).start()
    try:
        with ParameterServerClient(srv.address) as c:
            wid = c.join(manifest, "bench").worker_id
            c.push(
                manifest.pack([torch.zeros(manifest.numel)]),
                worker_id=wid,
                push_id=1,
                base_version=0,
                kind=pb.PUSH_KIND_INITIAL_PARAMETERS,
            )
            payload = manifest.pack([torch.full((manifest.numel,), 0.01)])
            started = time.perf_counter()
            for k in range(pushes):
                c.push(payload, worker_id=wid, push_id=k + 2, base_version=srv.state.version)
            return time.perf_counter() - started
    finally:
        srv.stop(None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pushes", type=int, default=300)
    parser.add_argument("--sizes", default="10000,1000000", help="model sizes in fp32 parameters, comma-separated")
    parser.add_argument("--dir", default=None, help="folder on the disk to measure (default: the system temp dir)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    base = tempfile.mkdtemp(prefix="wal-cost-", dir=args.dir)
    fs = subprocess.run(["df", "-T", base], capture_output=True, text=True).stdout.splitlines()[-1].split()[1]
    try:
        bench_state(
            Manifest.from_named_tensors([("w", torch.zeros(1000))]), "wal+fsync", 50, os.path.join(base, "warm")
        )
        for layer, fn in (("state", bench_state), ("grpc", bench_grpc)):
            for n in (int(s) for s in args.sizes.split(",")):
                manifest = Manifest.from_named_tensors([("w", torch.zeros(n))])
                for mode in MODES:
                    folder = os.path.join(base, f"{layer}-{n}-{mode}")
                    elapsed = fn(manifest, mode, args.pushes, folder)
                    print(
                        json.dumps(
                            {
                                "layer": layer,
                                "params": n,
                                "payload_bytes": manifest.total_bytes,
                                "mode": mode,
                                "pushes": args.pushes,
                                "pushes_per_s": round(args.pushes / elapsed, 1),
                                "ms_per_push": round(1000 * elapsed / args.pushes, 3),
                                "filesystem": fs,
                            }
                        ),
                        flush=True,
                    )
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
