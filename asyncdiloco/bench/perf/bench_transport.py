"""Push+pull throughput through the parameter server ÷ raw TCP loopback throughput
(docs/performance.md, "Transport: gRPC and the bulk channel"; targets: targets.py).

Each round pairs one raw TCP transfer between two processes (1 MiB ``sendall`` /
``recv_into`` slices: the machine's ceiling) with one push of the model's size and one
pull from an ``asyncdiloco server`` process, over gRPC ("grpc-stream") or the bulk channel
("bulk-tcp"); ``ratio`` is the median over rounds of 2 × model bytes ÷ (push + pull s) ÷
raw. ``transfer_only_ratio``: the same with a retried push and a pull of an unchanged
version (the transport without the server's work); ``server_work_s``: that work alone,
in this process.

    python -m asyncdiloco.bench.perf.bench_transport [--sizes 4,64,256] [--repeats 3] [--paths grpc,bulk] [--out FILE]
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import socket
import time

import torch

from asyncdiloco._malloc import keep_large_blocks
from asyncdiloco.algo.config import OuterConfig
from asyncdiloco.bench.perf.harness import MIB, emit, median, median_seconds, parse_sizes, server_process
from asyncdiloco.bench.perf.targets import TRANSPORT, target_for
from asyncdiloco.ps.config import ServerConfig
from asyncdiloco.ps.state import ParameterServerState
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.tensors import Manifest
from asyncdiloco.worker.client import ParameterServerClient

#: Bytes per sendall / recv_into of the raw TCP baseline: 1 MiB slices were the fastest of
#: 256 KiB, 1, 2 and 4 MiB and one call for the whole message, so the baseline is a ceiling.
_SLICE = 1 << 20


def _tcp_sink(port_q: mp.Queue, n: int, repeats: int) -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    view = memoryview(bytearray(n))
    for _ in range(repeats):
        got = 0
        while got < n:
            got += conn.recv_into(view[got : got + _SLICE], min(_SLICE, n - got))
        conn.sendall(b"k")
    conn.close()


class RawTcp:
    """The baseline: a sink process on 127.0.0.1 that receives ``rounds`` messages of
    ``n`` bytes (1 MiB ``recv_into`` slices into one preallocated buffer) and acks each;
    ``once()`` sends one (1 MiB ``sendall`` slices) and returns its seconds. Interleaving
    ``once()`` with the measured calls makes each ratio a pair taken moments apart."""

    def __init__(self, n: int, rounds: int) -> None:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        self.n = n
        self._sink = ctx.Process(target=_tcp_sink, args=(q, n, rounds))
        self._sink.start()
        self._data = memoryview(bytearray(b"\x01" * n))
        self._sock = socket.create_connection(("127.0.0.1", q.get(timeout=60)))

    def once(self) -> float:
        t0 = time.perf_counter()
        for start in range(0, self.n, _SLICE):
            self._sock.sendall(self._data[start : start + _SLICE])
        self._sock.recv(1)
        return time.perf_counter() - t0

    def close(self) -> None:
        self._sock.close()
        self._sink.join(timeout=60)


def push_pull(n: int, repeats: int, address: str, chunk_bytes: int, raw: RawTcp, bulk: bool = False) -> dict:
    """Median push and pull seconds of an ``n``-byte fp32 model (over the bulk channel
    when ``bulk`` and the server offers it), each round next to one raw TCP transfer of
    the same size; ``ratio`` is the median of the rounds' (push+pull throughput ÷ raw)."""
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(n // 4))])
    manifest = Manifest.from_module(model)
    client = ParameterServerClient(address, timeout_s_per_mib=2.0, chunk_bytes=chunk_bytes, bulk_channel=bulk)
    reply = client.join(manifest, "bench")
    if bulk and client.bulk_port == 0:
        raise RuntimeError("the server offers no bulk data channel (start it with --bulk-port)")
    payload = manifest.pack(list(model.parameters()))
    if reply.initialize:
        client.push(payload, worker_id=reply.worker_id, push_id=1, base_version=0, kind=pb.PUSH_KIND_INITIAL_PARAMETERS)
    pull_buffer = torch.empty(manifest.total_bytes, dtype=torch.uint8)
    push_s, pull_s, raw_s, ratios = [], [], [], []
    version = 0
    for i in range(repeats + 1):
        raw_t = raw.once()
        t0 = time.perf_counter()
        client.push(payload, worker_id=reply.worker_id, push_id=2 + i, base_version=version)
        t1 = time.perf_counter()
        version = client.pull(manifest, reply.worker_id, buffer=pull_buffer).version
        t2 = time.perf_counter()
        if i:  # the first round allocates the server's buffers
            push_s.append(t1 - t0)
            pull_s.append(t2 - t1)
            raw_s.append(raw_t)
            ratios.append((2 * n / (t2 - t0)) / (n / raw_t))
    # The transfer alone, same connection: a retried push id (sent in full, CRC-32 on the
    # client, read and discarded by the server, nothing applied) and a pull of an
    # unchanged version (the server's snapshot is cached; CRC-32 on the client).
    retry_s, cached_pull_s = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        assert client.push(payload, worker_id=reply.worker_id, push_id=2, base_version=0).duplicate
        t1 = time.perf_counter()
        client.pull(manifest, reply.worker_id, buffer=pull_buffer)
        retry_s.append(t1 - t0)
        cached_pull_s.append(time.perf_counter() - t1)
    fallbacks = client._bulk.fallbacks if client._bulk is not None else 0  # noqa: SLF001
    client.close()
    return {
        "push_s": median(push_s),
        "pull_s": median(pull_s),
        "retry_s": median(retry_s),
        "cached_pull_s": median(cached_pull_s),
        "fallbacks": fallbacks,
        "raw_s": median(raw_s),
        "ratio": median(ratios),
        "ratios": ratios,
    }


def server_work_s(n: int, repeats: int) -> float:
    """Median seconds the server's own work takes per push + pull, in this process and
    without a network: the chunk copies into place, CRC-32 on both sides, validation,
    the outer step and the snapshot's encoding (what a push+pull costs beyond moving bytes)."""
    state = ParameterServerState(ServerConfig(port=0, outer=OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0)))
    manifest = Manifest.from_named_tensors([("w", torch.zeros(n // 4))])
    wid, _, _ = state.join(manifest, "bench")
    payload = torch.zeros(n, dtype=torch.uint8)
    state.intake.push(payload, worker_id=wid, push_id=1, kind=pb.PUSH_KIND_INITIAL_PARAMETERS)
    push_ids = itertools.count(2)

    def push_and_pull() -> None:
        state.intake.push(payload, worker_id=wid, push_id=next(push_ids), base_version=state.version)
        state.snapshots.release(state.snapshots.acquire())

    return median_seconds(push_and_pull, repeats)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="4,64,256", help="model sizes in MiB (default 4,64,256)")
    p.add_argument("--repeats", type=int, default=5, help="measured rounds per size and path (default %(default)s)")
    p.add_argument("--chunk-bytes", type=int, default=4 * MIB)
    p.add_argument("--paths", default="grpc,bulk", help="grpc, bulk or both (default %(default)s)")
    p.add_argument("--out", help="also append the JSON lines to this file")
    args = p.parse_args()
    paths = [x for x in args.paths.split(",") if x]
    torch.set_num_threads(1)
    keep_large_blocks()  # as the worker CLI does
    server_flags: tuple[str, ...] = ("--outer-optimizer", "sgd", "--outer-lr", "1", "--outer-momentum", "0")
    server_flags += ("--chunk-bytes", str(args.chunk_bytes))
    for n in parse_sizes(args.sizes):
        work = server_work_s(n, args.repeats)
        for path in paths:
            bulk = path == "bulk"
            rawtcp = RawTcp(n, rounds=args.repeats + 1)
            try:
                with server_process(*server_flags, *(("--bulk-port", "0") if bulk else ())) as (_, address):
                    g = push_pull(n, args.repeats, address, args.chunk_bytes, rawtcp, bulk=bulk)
            finally:
                rawtcp.close()
            raw = n / g["raw_s"]
            push_pull_bytes_per_s = 2 * n / (g["push_s"] + g["pull_s"])
            record = {
                "bench": "transport",
                "measure": TRANSPORT,
                "path": "bulk-tcp" if bulk else "grpc-stream",
                "model_mib": n / MIB,
                "chunk_bytes": args.chunk_bytes,
                "raw_tcp_gb_s": raw / 1e9,
                "push_gb_s": n / g["push_s"] / 1e9,
                "pull_gb_s": n / g["pull_s"] / 1e9,
                "push_pull_gb_s": push_pull_bytes_per_s / 1e9,
                "ratio": g["ratio"],
                "ratio_per_round": g["ratios"],
                "target": target_for(TRANSPORT, "bulk-tcp" if bulk else "grpc-stream"),
                "repeats": args.repeats,
                # the same bytes without the server's work (retried push + unchanged pull)
                "transfer_only_ratio": 2 * n / (g["retry_s"] + g["cached_pull_s"]) / raw,
            }
            transfer_only = record["transfer_only_ratio"]
            record["server_work_s"] = work
            record["note"] = (
                f"the bytes alone (a retried push the server drains + a pull of an unchanged version) reach "
                f"{transfer_only:.2f} of raw "
                f"TCP; the server's own work without network (CRC-32 both sides, copies into place, validation, "
                f"outer step, the pull's copy out of θ) is {work / (g['push_s'] + g['pull_s']):.0%} of push+pull time"
            )
            if bulk:
                record["grpc_fallbacks"] = g["fallbacks"]
            emit(record, args.out)


if __name__ == "__main__":
    main()
