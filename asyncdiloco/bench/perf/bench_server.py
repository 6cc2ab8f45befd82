"""The parameter server's own costs, each against a baseline in the same run
(docs/performance.md, "Server costs and memory"; targets: targets.py):

- ``outer_step``: ``OuterOptimizer.step`` (nesterov) on a flat fp32 vector ÷ torch's fused
  ``SGD(nesterov=True)`` on the same tensor.
- ``peak_rss``: the server's peak RSS growth over its idle RSS while 8 workers push at once
  (pushes only; push then pull; that with the bf16 codec) ÷ (parameters + momentum) bytes;
  each row's ``note`` compares it with what the server holds by design.
- ``push_rate``: pushes applied per second, 1M parameters, 16 workers (2 processes × 8
  threads), replies not held for groups, over ``grpc-one`` (PushOne), ``grpc-stream``
  (Push streams) and ``bulk-tcp``, with the server's CPU ms per applied push.

    python -m asyncdiloco.bench.perf.bench_server [--sizes 4,64,256] [--repeats 5] [--out FILE]
        [--only push_rate --address HOST:PORT]   (a server started by hand, e.g. under py-spy)
        [--only push_rate --push-workers 1x1]     (one pusher: the latency of a push)
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import threading
import time

import torch

from asyncdiloco._malloc import keep_large_blocks
from asyncdiloco.algo.config import OuterConfig
from asyncdiloco.algo.outer import OuterOptimizer
from asyncdiloco.bench.perf.harness import (
    MIB,
    cpu_seconds,
    emit,
    median_seconds_interleaved,
    parse_sizes,
    reset_peak_rss,
    rss_bytes,
    server_process,
)
from asyncdiloco.bench.perf.targets import OUTER_STEP, PEAK_RSS, PUSH_RATE, target_for
from asyncdiloco.ps.config import ServerConfig
from asyncdiloco.ps.state import ParameterServerState
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.tensors import Manifest
from asyncdiloco.worker.client import ParameterServerClient


def bench_outer_step(n_bytes: int, repeats: int) -> dict:
    n = n_bytes // 4
    delta = torch.randn(n)
    ours = OuterOptimizer(torch.zeros(n), OuterConfig(optimizer="nesterov", lr=0.7, momentum=0.9))
    param = torch.nn.Parameter(torch.zeros(n))
    param.grad = delta.clone()
    fused = torch.optim.SGD([param], lr=0.7, momentum=0.9, nesterov=True, fused=True)

    # interleaved, after one warm-up call each (it allocates torch's momentum buffer)
    t_ours, t_fused = median_seconds_interleaved([lambda: ours.step(delta, 1.0, version=0), fused.step], repeats)
    return {"ours_s": t_ours, "fused_sgd_s": t_fused, "ratio": t_ours / t_fused, "ours_gb_s": n_bytes / t_ours / 1e9}


#: push_rate's paths: (row name, bulk channel, PushOne).
PATHS = (("grpc-one", False, True), ("grpc-stream", False, False), ("bulk-tcp", True, True))


def _join_and_init(
    address: str, manifest: Manifest, name: str, one_message: bool = True
) -> tuple[ParameterServerClient, int]:
    client = ParameterServerClient(address, timeout_s_per_mib=4.0, one_message_pushes=one_message)
    reply = client.join(manifest, name)
    if reply.initialize:
        payload = torch.zeros(manifest.total_bytes, dtype=torch.uint8)
        client.push(payload, worker_id=reply.worker_id, push_id=1, base_version=0, kind=pb.PUSH_KIND_INITIAL_PARAMETERS)
    return client, reply.worker_id


def _push_loop(
    address: str, numel: int, threads: int, seconds: float, start_evt, count_q, one_message: bool = True
) -> None:
    torch.set_num_threads(1)
    keep_large_blocks()  # as the worker CLI does
    manifest = Manifest.from_named_tensors([("w", torch.zeros(numel))])
    payload = manifest.pack([torch.full((numel,), 1e-6)])
    counts = []

    def run(k: int) -> None:
        client, wid = _join_and_init(address, manifest, f"pusher-{os.getpid()}-{k}", one_message)  # a name each
        start_evt.wait()
        deadline = time.monotonic() + seconds
        n, push_id, version = 0, 2, client.status().version
        while time.monotonic() < deadline:  # each push's base is the version its last push made
            reply = client.push(payload, worker_id=wid, push_id=push_id, base_version=version)
            push_id, version = push_id + 1, reply.version
            n += reply.applied
        counts.append(n)
        client.close()

    ts = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    count_q.put(sum(counts))


def in_process_pushes_per_s(numel: int, pushes: int = 50) -> float:
    """Pushes per second ``ParameterServerState.push`` applies in this process, no
    network (chunk copies, CRC-32 on both sides, validation, nesterov outer step)."""
    state = ParameterServerState(ServerConfig(port=0, outer=OuterConfig(optimizer="nesterov")))
    manifest = Manifest.from_named_tensors([("w", torch.zeros(numel))])
    wid, _, _ = state.join(manifest, "bench")
    state.intake.push(
        torch.zeros(numel * 4, dtype=torch.uint8), worker_id=wid, push_id=1, kind=pb.PUSH_KIND_INITIAL_PARAMETERS
    )
    payload = manifest.pack([torch.full((numel,), 1e-6)])
    state.intake.push(payload, worker_id=wid, push_id=2, base_version=0)  # warm: momentum, pooled buffer
    t0 = time.perf_counter()
    for i in range(pushes):
        state.intake.push(payload, worker_id=wid, push_id=3 + i, base_version=state.version)
    return pushes / (time.perf_counter() - t0)


def bench_push_rate(
    numel: int,
    procs: int,
    threads: int,
    seconds: float,
    bulk: bool = False,
    address: str | None = None,
    one_message: bool = True,
) -> dict:
    """Pushes applied per second by ``procs`` × ``threads`` workers pushing for ``seconds``,
    against a server started here, or against ``address`` (a server started by hand,
    e.g. under a profiler; its flags then decide whether the bulk channel is used).
    ``one_message``: pushes within one chunk go as PushOne (False: Push streams)."""
    # --grouping off: the rate of the server itself, replies not held for push groups (schedule.py)
    flags: tuple[str, ...] = ("--outer-optimizer", "nesterov", "--max-staleness", "1000", "--grouping", "off")
    flags += ("--bulk-port", "0") if bulk else ()
    if address is not None:
        return _push_rate_at(address, numel, procs, threads, seconds, one_message)
    with server_process(*flags) as (proc, started):
        return _push_rate_at(started, numel, procs, threads, seconds, one_message, proc.pid)


def _push_rate_at(
    address: str, numel: int, procs: int, threads: int, seconds: float, one_message: bool, server_pid: int | None = None
) -> dict:
    ctx = mp.get_context("spawn")
    manifest = Manifest.from_named_tensors([("w", torch.zeros(numel))])
    client, _ = _join_and_init(address, manifest, f"init-{os.getpid()}")
    start_evt, q = ctx.Event(), ctx.Queue()
    args = (address, numel, threads, seconds, start_evt, q, one_message)
    ps = [ctx.Process(target=_push_loop, args=args) for _ in range(procs)]
    for p in ps:
        p.start()
    time.sleep(5.0)  # let every client join (spawned interpreters import torch)
    v0 = client.status().version
    cpu0 = cpu_seconds(server_pid) if server_pid else 0.0
    t0 = time.monotonic()
    start_evt.set()
    applied = sum(q.get(timeout=seconds + 120) for _ in ps)
    wall = time.monotonic() - t0
    cpu1 = cpu_seconds(server_pid) if server_pid else 0.0
    v1 = client.status().version
    for p in ps:
        p.join(timeout=30)
    client.close()
    return {
        "pushes_applied": applied,
        "versions": v1 - v0,
        "wall_s": wall,
        "pushes_per_s": (v1 - v0) / wall,
        # the server process's CPU (all its threads: handlers, gRPC's poller and I/O) per applied push
        "server_cpu_ms_per_push": 1e3 * (cpu1 - cpu0) / max(1, v1 - v0) if server_pid else None,
    }


def bench_peak_rss(n_bytes: int, pushers: int, then_pull: bool, codec: str = "raw") -> dict:
    """Peak server RSS growth while ``pushers`` workers push at once (each then pulls
    when ``then_pull``), over the RSS of the idle server before the model arrived;
    ``codec``: the server's wire codec (raw, or bf16: pushes and pulls carry bf16)."""
    numel = n_bytes // 4
    manifest = Manifest.from_named_tensors([("w", torch.zeros(numel))])
    flags = ("--outer-optimizer", "nesterov") + (("--wire-codec", codec) if codec != "raw" else ())
    with server_process(*flags) as (proc, address):
        time.sleep(1.0)
        idle = rss_bytes(proc.pid)
        clients = [_join_and_init(address, manifest, f"w{k}") for k in range(pushers)]
        delta = torch.full((numel,), 1e-6)
        payload = manifest.pack([delta]) if codec == "raw" else delta.to(torch.bfloat16).view(torch.uint8)
        clients[0][0].push(payload, worker_id=clients[0][1], push_id=2, base_version=0)  # momentum allocated
        steady = rss_bytes(proc.pid)
        reset_peak_rss(proc.pid)
        barrier = threading.Barrier(pushers)

        def push(k: int) -> None:
            client, wid = clients[k]
            barrier.wait()
            client.push(payload, worker_id=wid, push_id=3, base_version=1)
            if then_pull:  # as workers do: push, then pull the new global model
                client.pull(manifest, wid)

        ts = [threading.Thread(target=push, args=(k,)) for k in range(pushers)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        peak = rss_bytes(proc.pid, "VmHWM")
        for c, _ in clients:
            c.close()
    state = 2 * n_bytes  # parameters + momentum, fp32
    pattern = "push, then pull" if then_pull else "push"  # the codec is its own field (the summary's variant)
    wire = n_bytes if codec == "raw" else n_bytes // 2
    budget = max(64 * MIB, wire)
    if codec == "raw":
        held, parts = 2 * n_bytes + budget, "θ + m + receive budget max(64 MiB, 1 payload), old versions pulled in it"
    else:  # + the encoded θ being packed and 2 pull snapshots when pulled (bf16 decodes per block in the step)
        held = 2 * n_bytes + budget + (wire + 2 * wire if then_pull else 0)
        parts = "θ + m + receive budget" + (" + θ encoded + 2 encoded pull snapshots" if then_pull else "")
    note = (
        f"by design {parts} = {held / state:.2f}×; measured {(peak - idle) / MIB:.0f} MiB growth, of which "
        f"{(peak - idle - held) / MIB:.0f} MiB beyond that (gRPC's per-stream buffers, thread stacks, allocator)"
    )
    return {
        "pattern": pattern,
        "pushers": pushers,
        "codec": codec,
        "idle_rss_mib": idle / MIB,
        "after_one_push_mib": steady / MIB,
        "peak_rss_mib": peak / MIB,
        "state_mib": state / MIB,
        "ratio": (peak - idle) / state,
        "note": note,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="4,64,256", help="model sizes in MiB (default 4,64,256)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--push-seconds", type=float, default=10.0, help="duration of the push-rate run")
    p.add_argument(
        "--push-workers",
        default="2x8",
        help="push_rate's pushers, PROCESSESxTHREADS (default 2x8, the target's 16; 1x1: one push at a time)",
    )
    p.add_argument("--only", choices=["outer_step", "peak_rss", "push_rate"], help="run one measure")
    p.add_argument("--out", help="also append the JSON lines to this file")
    p.add_argument(
        "--address",
        help="push_rate against this running server (HOST:PORT; e.g. one under a profiler), gRPC paths only",
    )
    args = p.parse_args()
    torch.set_num_threads(1)  # as the server runs
    keep_large_blocks()
    sizes = parse_sizes(args.sizes)
    if args.only in (None, "outer_step"):
        for n in sizes:
            row = {"bench": "server", "measure": OUTER_STEP, "model_mib": n / MIB, "target": target_for(OUTER_STEP)}
            emit({**row, **bench_outer_step(n, args.repeats)}, args.out)
    if args.only in (None, "peak_rss"):
        for n in sizes:
            row = {"bench": "server", "measure": PEAK_RSS, "model_mib": n / MIB}
            row["target"] = target_for(PEAK_RSS, model_mib=n / MIB)
            for then_pull, codec in ((False, "raw"), (True, "raw"), (True, "bf16")):
                emit({**row, **bench_peak_rss(n, pushers=8, then_pull=then_pull, codec=codec)}, args.out)
    if args.only in (None, "push_rate"):
        alone = in_process_pushes_per_s(1_000_000)
        procs, threads = (int(n) for n in args.push_workers.lower().split("x"))
        note = (
            f"the server's work alone, in one process without network, applies {alone:.0f} pushes/s; "
            f"here {procs * threads} clients ({procs} processes) and the server share the same "
            f"{os.cpu_count()} cores"
        )
        for path, bulk, one_message in PATHS[:2] if args.address else PATHS:
            r = bench_push_rate(1_000_000, procs, threads, args.push_seconds, bulk, args.address, one_message)
            row = {"bench": "server", "measure": PUSH_RATE, "model_mib": 4e6 / MIB, "path": path}
            row["workers"] = procs * threads
            row["target"] = target_for(PUSH_RATE, path) if procs * threads == 16 else None
            emit({**row, "in_process_pushes_per_s": alone, "note": note, **r}, args.out)


if __name__ == "__main__":
    main()
