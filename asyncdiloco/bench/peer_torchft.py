"""The suite's peer row, torchft's side: torchft's synchronous DiLoCo
(``torchft.local_sgd.DiLoCo``, https://github.com/pytorch/torchft) on the same job, when
the ``peer`` extra is installed; a lighthouse and N replica-group processes, every socket
on 127.0.0.1 (healing through the process group, not torchft's HTTP transport).
docs/performance.md, "Sync mode end to end".

    python -m asyncdiloco.bench.peer_torchft --replicas 2 --steps 200 --local-steps 20 --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time
from datetime import timedelta

#: The job's settings a replica takes from its flags (the rest: ``JobConfig``'s defaults).
JOB_SETTINGS = ("seed", "n_layer", "n_embd", "context_len", "batch_size")


def torchft_available() -> bool:
    try:
        import torchft  # noqa: F401
    except ImportError:
        return False
    return True


def _replica(args: argparse.Namespace) -> None:
    """One replica group (world size 1): train ``steps`` inner steps under torchft DiLoCo."""
    import torch
    import torchft.manager as tfm
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport
    from torchft.local_sgd import DiLoCo

    from asyncdiloco.job.config import JobConfig
    from asyncdiloco.job.dataset import BatchStream, CharCorpus
    from asyncdiloco.job.models import evaluate, lm_loss

    server_cls = tfm.ManagerServer

    def loopback_manager_server(**kw):  # torchft binds "[::]:port"; keep it on loopback
        kw["bind"] = "127.0.0.1:" + kw["bind"].rsplit(":", 1)[1]
        return server_cls(**kw)

    tfm.ManagerServer = loopback_manager_server
    torch.set_num_threads(1)
    job = JobConfig(**{k: getattr(args, k) for k in JOB_SETTINGS})
    corpus = CharCorpus.default()
    model = job.build(corpus)
    inner = torch.optim.AdamW(model.parameters(), lr=job.inner_lr, weight_decay=job.weight_decay)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    batches = BatchStream(corpus, job.batch_size, job.context_len, job.seed, args.replica_index)
    join_started = time.time()  # as our workers' join_started_unix_s: model and data built (peer_sync.py)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=30))
    manager = Manager(
        pg=pg,
        min_replica_size=args.replicas,
        load_state_dict=model.load_state_dict,
        state_dict=model.state_dict,
        use_async_quorum=False,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=args.lighthouse,
        replica_id=f"replica-{args.replica_index}",
        rank=0,
        world_size=1,
        hostname="127.0.0.1",
        checkpoint_transport=PGTransport(pg, timedelta(seconds=30), torch.device("cpu")),
        timeout=timedelta(seconds=30),
    )
    sync_times, last = [], None
    started = time.monotonic()
    with DiLoCo(manager, [model], inner, outer, sync_every=args.local_steps):
        for step in range(1, args.steps + 1):
            x, y = next(batches)
            lm_loss(model(x), y).backward()
            inner.step()  # every H-th step: torchft quorum, allreduce, outer step
            inner.zero_grad(set_to_none=True)
            if step % args.local_steps == 0:
                now = time.monotonic()
                if last is not None:
                    sync_times.append(now - last)
                last = now
    wall = time.monotonic() - started
    train_ended = time.time()
    loss = evaluate(model, job.eval_set(corpus))
    out = {
        "replica": args.replica_index,
        "steps": args.steps,
        "wall_s": wall,
        "join_started_unix_s": join_started,
        "train_ended_unix_s": train_ended,
        "round_s": sync_times,
        "final_eval_loss": loss,
        "outer_steps": manager.current_step(),
    }
    pathlib.Path(args.out).write_text(json.dumps(out))
    manager.shutdown(wait=False)


def run_peer(
    *,
    replicas: int,
    steps: int,
    local_steps: int,
    out_dir: str,
    seed: int = 0,
    n_layer: int = 1,
    n_embd: int = 64,
    context_len: int = 32,
    batch_size: int = 16,
    timeout_s: float = 600,
) -> dict:
    """Run torchft DiLoCo with ``replicas`` replica groups; returns median round time, the
    replicas' final held-out loss, ``wall_s`` (the slowest replica's own training time,
    from entering DiLoCo), ``training_wall_s`` (the first replica's join, i.e. its manager
    being built, to the last replica's last inner step, on the wall clock: measured as
    peer_sync.py measures ours) and ``command_wall_s`` (lighthouse start to every replica
    reaped), seconds. Raises RuntimeError when torchft is missing or a
    replica fails."""
    if not torchft_available():
        raise RuntimeError("torchft is not installed: pip install torchft==0.2.0 (after torch)")
    from torchft._torchft import LighthouseServer

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    command_started = time.monotonic()
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=replicas, join_timeout_ms=5000, quorum_tick_ms=100)
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    shared = {"--replicas": replicas, "--lighthouse": lighthouse.address(), "--steps": steps}
    shared |= {"--local-steps": local_steps, "--seed": seed, "--n-layer": n_layer, "--n-embd": n_embd}
    shared |= {"--context-len": context_len, "--batch-size": batch_size}
    argv = [x for flag, value in shared.items() for x in (flag, str(value))]
    procs = []
    try:
        for i in range(replicas):
            cmd = [sys.executable, "-m", "asyncdiloco.bench.peer_torchft", "--replica-index", str(i), *argv]
            cmd += ["--out", str(out / f"replica-{i}.json")]
            with open(out / f"replica-{i}.log", "wb") as log:
                procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        lighthouse.shutdown()
    command_wall_s = time.monotonic() - command_started
    if any(p.returncode != 0 for p in procs):
        raise RuntimeError(
            f"a torchft replica failed (exit codes {[p.returncode for p in procs]}); see {out}/replica-*.log"
        )
    results = [json.loads((out / f"replica-{i}.json").read_text()) for i in range(replicas)]
    rounds = sorted(t for r in results for t in r["round_s"])
    return {
        "peer": "torchft 0.2.0 DiLoCo (sync)",
        "replicas": replicas,
        "local_steps": local_steps,
        "tokens": replicas * steps * batch_size * context_len,
        "median_round_s": rounds[len(rounds) // 2] if rounds else None,
        "final_eval_loss": sum(r["final_eval_loss"] for r in results) / len(results),
        "wall_s": max(r["wall_s"] for r in results),
        # as peer_sync.py's: the first replica's join to the last one's last inner step; and the whole run
        "training_wall_s": max(r["train_ended_unix_s"] for r in results)
        - min(r["join_started_unix_s"] for r in results),
        "command_wall_s": command_wall_s,
        "outer_steps": min(r["outer_steps"] for r in results),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replica-index", type=int, help="internal: run one replica group")
    p.add_argument("--lighthouse", help="internal: lighthouse address")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--steps", type=int, default=200, help="inner steps per replica")
    p.add_argument("--local-steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n-layer", type=int, default=1)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--context-len", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--out", default="peer-out")
    args = p.parse_args()
    if args.replica_index is not None:
        _replica(args)
        return
    run = {k: getattr(args, k) for k in ("replicas", "steps", "local_steps", *JOB_SETTINGS)}
    print(json.dumps(run_peer(out_dir=args.out, **run)))


if __name__ == "__main__":
    main()
