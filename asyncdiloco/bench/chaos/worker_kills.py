"""kill -9 random workers (a seeded Poisson process, mean ``--mtbf-s``) during a run of the
default job, restart them on their state folders, and compare the final loss with a
fault-free run (docs/operations.md, "Chaos runs"). One JSON line per kill, run and mode.

    python -m asyncdiloco.bench.chaos.worker_kills [--modes async,sync] [--workers 4] [--repeats 1] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from asyncdiloco.bench.perf.harness import exit_on_sigterm, wait_for_port

#: Seconds a server may take to listen, and a run to finish.
START_TIMEOUT_S = 120.0
RUN_TIMEOUT_S = 1800.0


class Run:
    """One server and its workers in ``folder``."""

    def __init__(self, folder: pathlib.Path, args: argparse.Namespace, mode: str) -> None:
        self.folder, self.args, self.mode = folder, args, mode
        folder.mkdir(parents=True)
        self.server: subprocess.Popen | None = None
        self.address = ""
        self.workers: list[subprocess.Popen | None] = [None] * args.workers
        self.lives = [0] * args.workers
        self.exit_codes: list[int | None] = [None] * args.workers

    def start_server(self) -> None:
        port_file = self.folder / "port"
        cmd = [sys.executable, "-m", "asyncdiloco", "server", "--port", "0", "--port-file", str(port_file)]
        cmd += ["--mode", self.mode, "--drain-s", "0"]
        with open(self.folder / "server.log", "w") as log:
            self.server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        port = wait_for_port(self.server, port_file, START_TIMEOUT_S, self.folder / "server.log")
        self.address = f"127.0.0.1:{port}"

    def start_worker(self, i: int) -> None:
        """Start (or restart, on its state folder) worker ``i``."""
        self.lives[i] += 1
        cmd = [sys.executable, "-m", "asyncdiloco", "worker", "--server", self.address, "--mode", self.mode]
        cmd += ["--worker-name", f"w{i}", "--worker-index", str(i), "--max-steps", str(self.args.max_steps)]
        cmd += ["--state-dir", str(self.folder / f"state-{i}"), "--stats-file", str(self.folder / f"stats-{i}.json")]
        cmd += ["--train-log", str(self.folder / f"train-{i}.jsonl")]
        with open(self.folder / f"worker-{i}.log", "a") as log:
            log.write(f"===== life {self.lives[i]}\n")
            log.flush()
            self.workers[i] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def training(self) -> list[int]:
        """Indices of the workers still running (their exit codes recorded when they end)."""
        live = []
        for i, p in enumerate(self.workers):
            if p is not None and p.poll() is None:
                live.append(i)
            elif p is not None and self.exit_codes[i] is None:
                self.exit_codes[i] = p.returncode
        return live

    def kill_and_restart(self, i: int) -> None:
        p = self.workers[i]
        assert p is not None
        os.killpg(p.pid, signal.SIGKILL)  # its own session: the process and anything it started
        p.wait()
        self.start_worker(i)

    def status(self):  # noqa: ANN201 - pb.StatusReply
        from asyncdiloco.worker.client import ParameterServerClient

        with ParameterServerClient(self.address) as client:
            return client.status()

    def final_loss(self) -> tuple[float, int]:
        from asyncdiloco.job.config import JobConfig
        from asyncdiloco.tools.evaluator import Evaluator
        from asyncdiloco.worker.client import ParameterServerClient

        with ParameterServerClient(self.address) as client:
            result = Evaluator(client, JobConfig(), name="chaos").evaluate_global(report=False)
            return result.loss, result.version

    def reap(self) -> None:
        for p in [*self.workers, self.server]:
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def stop_server(self) -> int:
        assert self.server is not None
        self.server.send_signal(signal.SIGTERM)
        try:
            return self.server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.reap()
            return -9


def run_once(args: argparse.Namespace, folder: pathlib.Path, mode: str, kill_seed: int | None) -> dict:
    """One run; ``kill_seed`` None: fault-free."""
    run = Run(folder, args, mode)
    rng = random.Random(kill_seed)
    kills: list[dict] = []
    began = time.monotonic()
    try:
        run.start_server()
        for i in range(args.workers):
            run.start_worker(i)
        while not run.status().initialized:
            if time.monotonic() - began > START_TIMEOUT_S:
                raise RuntimeError(f"no worker initialized the global model; see {folder}")
            time.sleep(0.2)
        train_start = time.monotonic()
        next_kill = train_start + rng.expovariate(1.0 / args.mtbf_s) if kill_seed is not None else None
        while True:
            live = run.training()
            if not live:
                break
            now = time.monotonic()
            if now - began > RUN_TIMEOUT_S:
                raise RuntimeError(f"the run did not finish within {RUN_TIMEOUT_S:g} s (hung?); see {folder}")
            if next_kill is not None and now >= next_kill:
                i = rng.choice(live)
                run.kill_and_restart(i)
                kill = {"bench": "chaos_worker_kills", "event": "kill", "mode": mode, "worker": i}
                kill.update(at_s=round(now - train_start, 1), life=run.lives[i])
                kills.append(kill)
                print(json.dumps(kill), flush=True)
                next_kill = now + rng.expovariate(1.0 / args.mtbf_s)
            time.sleep(0.1)
        train_s = time.monotonic() - train_start
        status = run.status()
        loss, version = run.final_loss()
        server_rc = run.stop_server()
    finally:
        run.reap()
    from asyncdiloco.job.config import JobConfig

    per_step = JobConfig().tokens_per_step  # the default job's, as the CLI workers train it
    stats = []
    for i in range(args.workers):
        path = folder / f"stats-{i}.json"
        stats.append(json.loads(path.read_text()) if path.exists() else None)
    result = {
        "bench": "chaos_worker_kills",
        "event": "run",
        "mode": mode,
        "kills": len(kills),
        "kill_seed": kill_seed,
        "final_loss": round(loss, 5),
        "version": version,
        "tokens": status.tokens,
        # steps the server's token count is off from workers × max_steps (async: lost < 0 or
        # counted twice > 0; sync: also the steps a healing member drops by design)
        "steps_off": (status.tokens - args.workers * args.max_steps * per_step) // per_step,
        "applied_pushes": status.applied_pushes,
        "rejected_pushes": status.rejected_pushes,
        "worker_exit_codes": run.exit_codes,
        "server_exit_code": server_rc,
        "completed": all(rc == 0 for rc in run.exit_codes) and server_rc == 0,
        "lives": run.lives,
        "inner_steps_last_life": [s.get("inner_steps") if s else None for s in stats],
        "train_s": round(train_s, 1),
    }
    if mode == "sync":
        result.update(rounds_committed=status.rounds_committed, rounds_failed=status.rounds_failed)
    print(json.dumps(result), flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="async,sync", help="comma-separated: async, sync (default %(default)s)")
    p.add_argument("--workers", type=int, default=4, help="worker processes (default %(default)s)")
    p.add_argument(
        "--max-steps",
        type=int,
        default=300,
        help="inner steps per worker, all its lives together (default %(default)s)",
    )
    p.add_argument(
        "--mtbf-s",
        type=float,
        default=30.0,
        help="mean seconds between two kills, over the whole run (exponential; default %(default)s)",
    )
    p.add_argument(
        "--repeats", type=int, default=1, help="fault-free + with-kills pairs per mode (default %(default)s)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the kill times and victims (default %(default)s)")
    p.add_argument("--out", help="keep every run's logs and state folders here (default: a temp folder, removed)")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, exit_on_sigterm)  # the finally blocks reap the children
    modes = args.modes.split(",")
    with tempfile.TemporaryDirectory(prefix="chaos-workers-") as tmp:
        out = pathlib.Path(args.out) if args.out else pathlib.Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        runs: dict[str, list[tuple[dict, dict]]] = {mode: [] for mode in modes}
        for r in range(args.repeats):
            for mode in modes:
                base = run_once(args, out / f"{mode}-{r}-fault-free", mode, None)
                chaos = run_once(args, out / f"{mode}-{r}-kills", mode, args.seed + r)
                runs[mode].append((base, chaos))
                rel = (chaos["final_loss"] - base["final_loss"]) / base["final_loss"]
                line = {
                    "bench": "chaos_worker_kills",
                    "event": "compare",
                    "mode": mode,
                    "repeat": r,
                    **{k: getattr(args, k) for k in ("max_steps", "workers", "mtbf_s")},
                    "kills": chaos["kills"],
                    "fault_free_loss": base["final_loss"],
                    "with_kills_loss": chaos["final_loss"],
                    "relative_difference": round(rel, 5),
                    "within_2_percent": abs(rel) <= 0.02,
                    "completed": base["completed"] and chaos["completed"],
                }
                print(json.dumps(line), flush=True)
        for mode, pairs in runs.items():
            print(json.dumps(_summary(mode, pairs)), flush=True)
    return 0


def _summary(mode: str, pairs: list[tuple[dict, dict]]) -> dict:
    """Every run of one mode: the fault-free and with-kills losses, their means and the
    relative difference of the means (the spread of the fault-free runs is the noise)."""
    base = [b["final_loss"] for b, _ in pairs]
    chaos = [c["final_loss"] for _, c in pairs]
    rel = (statistics.mean(chaos) - statistics.mean(base)) / statistics.mean(base)
    return {
        "bench": "chaos_worker_kills",
        "event": "summary",
        "mode": mode,
        "repeats": len(pairs),
        "kills": [c["kills"] for _, c in pairs],
        "fault_free_losses": base,
        "with_kills_losses": chaos,
        "fault_free_mean": round(statistics.mean(base), 5),
        "fault_free_range": round(max(base) - min(base), 5),
        "with_kills_mean": round(statistics.mean(chaos), 5),
        "relative_difference_of_means": round(rel, 5),
        "all_completed": all(b["completed"] and c["completed"] for b, c in pairs),
    }


if __name__ == "__main__":
    sys.exit(main())
