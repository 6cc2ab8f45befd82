"""The suite's peer row, our side: ``run_ours`` runs ``asyncdiloco server --mode sync``
(the suite's ``sync_diloco`` flags) and ``replicas`` CLI workers at equal speed on
127.0.0.1, measuring what torchft's replicas measure (peer_torchft.py) the same way:
training wall, whole-command wall, median round, final loss, phases. ``peer_section``
writes the report's row. docs/performance.md, "Sync mode end to end".

    python -m asyncdiloco.bench.peer_sync --replicas 4 --steps 160 --local-steps 20 --out DIR [--with-torchft]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

from asyncdiloco.bench import peer_torchft
from asyncdiloco.bench.demo import spawn
from asyncdiloco.bench.perf.harness import free_ports, wait_for_port
from asyncdiloco.bench.sim import SimConfig
from asyncdiloco.bench.suite_config import SuiteConfig
from asyncdiloco.errors import AsyncDiLoCoError
from asyncdiloco.flags.settings import SERVER_RUN
from asyncdiloco.job.config import JobConfig


def _server_flags(replicas: int, local_steps: int, job: JobConfig) -> tuple[str, ...]:
    """The suite's ``sync_diloco`` server flags on the real clock (a quorum of every replica)."""
    sim = SimConfig(
        method="sync_diloco",
        speeds_s_per_step=(1.0,) * replicas,
        total_steps=replicas * local_steps,
        local_steps=local_steps,
        job=job,
    )
    return SERVER_RUN.argv(sim.server_config("real"))


def run_ours(
    *, replicas: int, steps: int, local_steps: int, out_dir: str, job: JobConfig, timeout_s: float = 600
) -> dict:
    """Run ``--mode sync`` with ``replicas`` CLI workers of ``steps`` inner steps each.

    Returns:
        ``training_wall_s``, ``command_wall_s``, ``median_round_s`` (seconds),
        ``final_eval_loss`` (nats/char), ``outer_steps`` (rounds committed), ``tokens``.
    Raises:
        AsyncDiLoCoError: the server did not start; RuntimeError: a worker failed (the logs are named).
    """
    from asyncdiloco.flags.settings import WORKER_JOB
    from asyncdiloco.tools.evaluator import Evaluator  # imported now, not after training
    from asyncdiloco.worker.client import ParameterServerClient

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    python = [sys.executable, "-m", "asyncdiloco"]
    port_file = out / "server.port"
    port_file.unlink(missing_ok=True)
    started, started_unix = time.monotonic(), time.time()
    deadline = started + timeout_s
    (port,) = free_ports()  # the workers start with the server, before it listens
    address = f"127.0.0.1:{port}"
    server_cmd = [*python, "server", "--host", "127.0.0.1", "--port", str(port), "--port-file", str(port_file)]
    server = spawn([*server_cmd, "--drain-s", "0", *_server_flags(replicas, local_steps, job)], out / "server.log")
    procs, workers = [server], []
    marks: dict[str, float] = {}
    try:
        for i in range(replicas):  # started with the server: each holds its join until the server listens
            stats = out / f"worker-{i}.json"
            stats.unlink(missing_ok=True)
            cmd = [*python, "worker", "--mode", "sync", "--server", address, "--worker-index", str(i)]
            cmd += ["--max-steps", str(steps), "--stats-file", str(stats), "--worker-name", f"replica-{i}"]
            cmd += ["--join-when-file", str(port_file)]
            workers.append(spawn([*cmd, *WORKER_JOB.argv(job)], out / f"worker-{i}.log"))
        procs += workers
        wait_for_port(server, port_file, deadline - time.monotonic(), out / "server.log")
        marks["server_listening_s"] = time.monotonic() - started
        for w in workers:
            w.wait(timeout=max(1.0, deadline - time.monotonic()))
        marks["workers_exited_s"] = time.monotonic() - started
        if any(w.returncode != 0 for w in workers):
            raise RuntimeError(
                f"a sync worker failed (exit codes {[w.returncode for w in workers]}); see {out}/worker-*.log"
            )
        evaluator = Evaluator(ParameterServerClient(address), job, name="peer-row")
        try:
            loss = evaluator.evaluate_global().loss
        finally:
            evaluator.client.close()
        marks["evaluated_s"] = time.monotonic() - started
        server.terminate()
        server.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    command_wall_s = time.monotonic() - started
    results = [json.loads((out / f"worker-{i}.json").read_text()) for i in range(replicas)]
    row = summarize(results, command_wall_s, loss, replicas * steps * job.tokens_per_step)
    row["phases_s"] = marks | _phases(results, started_unix)
    return row


def _phases(results: list[dict], started_unix: float) -> dict[str, float]:
    """Seconds from the command's start: the first and last join, the last inner step."""
    joins = [r["join_started_unix_s"] - started_unix for r in results]
    return {
        "first_join_s": min(joins),
        "last_join_s": max(joins),
        "first_round_s": max(r["rounds"][0]["end_unix_s"] for r in results if r["rounds"]) - started_unix
        if all(r["rounds"] and "end_unix_s" in r["rounds"][0] for r in results)
        else float("nan"),
        "last_step_s": max(r["train_ended_unix_s"] for r in results) - started_unix,
    }


def summarize(results: list[dict], command_wall_s: float, loss: float, tokens: int) -> dict:
    """The row from the workers' stats files (``asyncdiloco worker --stats-file``).

    Raises:
        RuntimeError: a stats file lacks the join or end time (a worker from before them).
    """
    missing = [r.get("name") for r in results if "join_started_unix_s" not in r or "train_ended_unix_s" not in r]
    if missing:
        raise RuntimeError(f"the stats of {missing} carry no join_started_unix_s / train_ended_unix_s")
    rounds = []
    for r in results:
        ends = [x["end_s"] for x in r["rounds"] if x["committed"]]
        rounds += [b - a for a, b in zip(ends, ends[1:])]
    first_join = min(r["join_started_unix_s"] for r in results)
    return {
        "peer": "asyncdiloco --mode sync",
        "replicas": len(results),
        "tokens": tokens,
        "median_round_s": statistics.median(rounds) if rounds else None,
        "final_eval_loss": loss,
        "training_wall_s": max(r["train_ended_unix_s"] for r in results) - first_join,
        "command_wall_s": command_wall_s,
        "outer_steps": min(r["rounds_committed"] for r in results),
    }


def run_row(*, replicas: int, steps: int, local_steps: int, out_dir: str, job: JobConfig) -> list[dict]:
    """Ours, then torchft's DiLoCo when it is installed, on the same job, one after the
    other in this call: one result dict each (``run_ours``'s and ``run_peer``'s keys).

    Raises:
        RuntimeError / AsyncDiLoCoError: either run failed (its logs are named).
    """
    out = pathlib.Path(out_dir)
    rows = [run_ours(replicas=replicas, steps=steps, local_steps=local_steps, out_dir=str(out / "ours"), job=job)]
    if peer_torchft.torchft_available():
        rows.append(
            peer_torchft.run_peer(
                replicas=replicas,
                steps=steps,
                local_steps=local_steps,
                out_dir=str(out / "torchft"),
                n_layer=job.n_layer,
                n_embd=job.n_embd,
                context_len=job.context_len,
                batch_size=job.batch_size,
                seed=job.seed,
            )
        )
    return rows


def row_table(rows: list[dict]) -> str:
    """The peer row as a markdown table: one line per side, and ours ÷ torchft's."""
    head = (
        "| run | final loss | median round (s) | outer steps | training wall (s) | whole command (s) |\n"
        "|---|---|---|---|---|---|\n"
    )
    lines = [
        f"| {r['peer']} | {r['final_eval_loss']:.3f} | {r['median_round_s'] or float('nan'):.3f} | "
        f"{r['outer_steps']} | {r['training_wall_s']:.2f} | {r['command_wall_s']:.1f} |\n"
        for r in rows
    ]
    if len(rows) == 2:
        ours, theirs = rows
        lines.append(
            f"| ours ÷ torchft | | {(ours['median_round_s'] or 0) / (theirs['median_round_s'] or 1):.2f} | | "
            f"{ours['training_wall_s'] / theirs['training_wall_s']:.2f} | "
            f"{ours['command_wall_s'] / theirs['command_wall_s']:.2f} |\n"
        )
    return head + "".join(lines)


def peer_section(cfg: SuiteConfig, out: pathlib.Path, progress: bool = True) -> str:
    """The peer row: our ``--mode sync`` (``run_ours``: a server and 4 CLI workers)
    and torchft's synchronous DiLoCo (https://github.com/pytorch/torchft) on the same
    model, data order, H and token budget, 4 replicas at full speed, one after the other
    in this run, each with its training wall and whole-command wall measured the same way;
    torchft's line is left out, saying why, when it is not installed."""
    head = (
        "## Peer: synchronous DiLoCo, ours and torchft's (4 replicas, equal speeds, same model, data, H and tokens)\n\n"
    )
    if progress:
        print("peer: --mode sync, then torchft DiLoCo", flush=True)
    job = cfg.job
    try:
        rows = run_row(
            replicas=4, steps=cfg.total_steps // 4, local_steps=cfg.local_steps, out_dir=str(out / "peer"), job=job
        )
    except (RuntimeError, AsyncDiLoCoError) as exc:
        return head + f"peer run failed: {exc}\n"
    (out / "peer.json").write_text(json.dumps(rows) + "\n")
    missing = (
        ""
        if peer_torchft.torchft_available()
        else "torchft is not installed, so its line was skipped: `pip install 'asyncdiloco[peer]'` (after torch) "
        "adds it.\n\n"
    )
    return (
        head
        + missing
        + row_table(rows)
        + (
            "\nTraining wall: the first replica's join to the last replica's last inner step; whole command: the "
            'first process started to the last one reaped (docs/performance.md, "Sync mode end to end").\n'
        )
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--steps", type=int, default=160, help="inner steps per replica")
    p.add_argument("--local-steps", type=int, default=20)
    p.add_argument("--out", default="peer-sync-out")
    p.add_argument("--with-torchft", action="store_true", help="also run torchft's DiLoCo (when installed)")
    args = p.parse_args()
    job = JobConfig(n_layer=1, n_embd=64, context_len=32, batch_size=16)
    kw = {"replicas": args.replicas, "steps": args.steps, "local_steps": args.local_steps, "job": job}
    if args.with_torchft:
        rows = run_row(out_dir=args.out, **kw)
        pathlib.Path(args.out, "peer_row.json").write_text(json.dumps(rows, indent=1) + "\n")
        print(row_table(rows))
        return
    print(json.dumps(run_ours(out_dir=args.out, **kw)))


if __name__ == "__main__":
    main()
