"""One sync round of ``--members`` members on one in-process server: how many long-polled
Quorum and Commit calls it takes (docs/protocol.md, "Long-polled waits"). Every member
asks on its own thread while one extra worker holds the quorum back; the extra worker
leaves, the quorum forms, rank 0 uploads a round result and every member votes. One JSON
line: seconds to the last assignment and for the votes, the calls the server's gRPC
metrics counted, and the most calls held at once.

    python -m asyncdiloco.bench.perf.quorum_many [--members 256] [--channels 8] [--rpc-threads 64]
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.request

import torch

from asyncdiloco.ps import ParameterServer
from asyncdiloco.ps.config import ServerConfig, SyncConfig
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.tensors import Manifest
from asyncdiloco.worker.client import ParameterServerClient

MANIFEST = Manifest.from_named_tensors([("w", torch.zeros(8))])


def _calls(metrics_port: int, method: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30).read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("grpc_server_started_total{") and f'grpc_method="{method}"' in line
    )


def _on_threads(fn, n: int) -> None:
    threads = [threading.Thread(target=fn, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", type=int, default=256)
    parser.add_argument("--channels", type=int, default=8)
    parser.add_argument("--rpc-threads", type=int, default=ServerConfig().max_concurrent_rpcs)
    args = parser.parse_args()
    n = args.members
    config = ServerConfig(
        host="127.0.0.1",
        port=0,
        metrics_port=0,
        mode="sync",
        lease_s=600.0,
        max_concurrent_rpcs=args.rpc_threads,
        sync=SyncConfig(min_workers=n, join_timeout_s=600.0, round_timeout_s=600.0),
    )
    srv = ParameterServer(config).start()
    clients = [ParameterServerClient(srv.address, rpc_timeout_s=600.0) for _ in range(args.channels)]
    try:
        ids = [clients[i % len(clients)].join(MANIFEST, f"m{i}").worker_id for i in range(n)]
        late = clients[0].join(MANIFEST, "late").worker_id
        clients[0].push(
            MANIFEST.pack([torch.ones(8)]), worker_id=ids[0], push_id=1, base_version=0,
            kind=pb.PUSH_KIND_INITIAL_PARAMETERS,
        )  # fmt: skip
        replies: dict[int, pb.QuorumReply] = {}
        sync = srv.state.rounds
        assert sync is not None  # a sync-mode server
        rounds = sync.quorum

        def ask(i: int) -> None:
            replies[i] = clients[i % len(clients)].quorum(
                worker_id=ids[i], round=0, manifest_hash=MANIFEST.manifest_hash, timeout_s=600.0
            )

        asking = threading.Thread(target=_on_threads, args=(ask, n), daemon=True)
        asking.start()
        while len(rounds.waiting_workers()) < n:
            time.sleep(0.01)
        started = time.monotonic()
        clients[0].leave(late)
        asking.join()
        formed_s = time.monotonic() - started
        q = replies[0]
        clients[0].push(
            torch.full((8,), 0.5).view(torch.uint8), worker_id=q.members[0], push_id=q.quorum_id,
            base_version=q.round, kind=pb.PUSH_KIND_ROUND_RESULT, quorum_id=q.quorum_id,
        )  # fmt: skip
        decisions: dict[int, pb.CommitReply] = {}

        def vote(i: int) -> None:
            decisions[i] = clients[i % len(clients)].commit(
                worker_id=ids[i], quorum_id=q.quorum_id, success=True, total_weight=float(n), timeout_s=600.0
            )

        started = time.monotonic()
        _on_threads(vote, n)
        voted_s = time.monotonic() - started
        result = {
            "members": n,
            "rpc_threads": args.rpc_threads,
            "formed": sum(r.formed for r in replies.values()),
            "committed": sum(d.committed for d in decisions.values()),
            "version": srv.state.status().version,
            "leave_to_last_assignment_s": round(formed_s, 3),
            "votes_s": round(voted_s, 3),
            "quorum_calls": _calls(srv.metrics_port, "Quorum"),
            "commit_calls": _calls(srv.metrics_port, "Commit"),
            "peak_held_calls": sync.peak_held_waits,
        }
        print(json.dumps(result))
    finally:
        for c in clients:
            c.close()
        srv.stop(None)


if __name__ == "__main__":
    main()
