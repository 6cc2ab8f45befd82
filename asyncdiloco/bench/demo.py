"""The main job: a parameter server and N workers of different speeds, on loopback.

``run_demo`` starts ``asyncdiloco server --port 0`` and N ``asyncdiloco worker``
processes (worker i runs ``slowdowns[i]`` times slower), evaluates the global model on
held-out text while they train, shows progress, and writes ``report.json`` and
``loss_curve.png`` to the output folder. Every child process is reaped on exit, also on
errors and Ctrl-C.

``mode="sync"`` runs the same job (model, data, H, workers, speeds, time budget)
through the synchronous quorum mode instead, so the two reports compare directly. The
report then also carries ``rounds_committed``, ``rounds_failed``, ``round_time_s`` and,
per worker, ``idle_s`` (time waiting for the quorum, in the allreduce and for the commit;
in async mode ``idle_s`` is the time blocked in push and pull). Per async worker the report
also gives ``blocked_s`` and ``blocked_fraction`` (blocked_s ÷ the worker's wall time);
``--overlap`` workers (``worker_args``) bring that fraction down.

``leave_rejoin=(i, leave_at_s, rejoin_at_s)`` emulates a worker that goes away and comes
back: at ``leave_at_s`` seconds of training the demo sends worker i's process SIGTERM (it
pushes its last pseudo-gradient and calls Leave), and a fresh process with the same
``--worker-index`` joins at ``rejoin_at_s`` (a new worker id; it pulls the global model).
The fresh process is started with the others and holds its Join until the demo releases
it (``--join-when-file``) at ``rejoin_at_s``, once the server shows the old one left, so
its start-up (seconds on a loaded machine) is not added to the time away. Seconds of
training count from ``train_start_s`` in the report: the moment the demo's status poll
(every 0.25 s) first saw the global model initialized (the first worker's push of its
initial parameters). ``workers[]`` then has one entry per process, with ``index`` and
``rejoin``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import pathlib
import statistics
import subprocess
import sys
import time

import torch

from asyncdiloco.bench.plots import pyplot
from asyncdiloco.errors import AsyncDiLoCoError, ConfigError
from asyncdiloco.job.config import JobConfig
from asyncdiloco.job.dataset import CharCorpus
from asyncdiloco.job.models import evaluate
from asyncdiloco.wire.codec import codec_for
from asyncdiloco.wire.tensors import Manifest
from asyncdiloco.worker.client import ParameterServerClient

log = logging.getLogger(__name__)

DEFAULT_SLOWDOWNS = (1.0, 1.5, 2.0, 3.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """What the demo runs."""

    #: Worker processes.
    num_workers: int = 4
    #: Seconds each worker trains.
    max_seconds: float = 120.0
    #: Folder for report.json, loss_curve.png and the processes' logs.
    out_dir: str = "demo-out"
    #: Speed factor per worker (≥ 1; 2 = twice as slow); None cycles 1, 1.5, 2, 3, 1, 1.5, ...
    slowdowns: tuple[float, ...] | None = None
    #: Extra flags for ``asyncdiloco server`` (outer optimizer, H, ...).
    server_args: tuple[str, ...] = ()
    job: JobConfig = dataclasses.field(default_factory=JobConfig)
    #: Seconds between held-out evaluations of the global model.
    eval_every_s: float = 5.0
    #: Seconds to wait for the server to listen.
    startup_timeout_s: float = 60.0
    #: "async" or "sync" (the server flags must say the same: ``--mode sync``).
    mode: str = "async"
    #: Extra flags for every ``asyncdiloco worker`` (e.g. ``--allreduce-timeout-s 5``).
    worker_args: tuple[str, ...] = ()
    #: Extra flags per worker index (e.g. its own slowdown changes).
    per_worker_args: tuple[tuple[str, ...], ...] = ()
    #: Per worker index, the command run instead of ``python -m asyncdiloco`` (the
    #: ``worker ...`` arguments follow it), e.g. a test script that installs a fault and
    #: then runs the CLI; missing or empty: ``python -m asyncdiloco``.
    per_worker_command: tuple[tuple[str, ...], ...] = ()
    #: Stop every worker (SIGTERM) once the server has applied this many tokens, for
    #: comparisons at equal tokens; None: each worker trains ``max_seconds``.
    token_budget: int | None = None
    #: (worker index, leave at s, rejoin at s), seconds of training (from ``train_start_s``):
    #: that worker's process is stopped (SIGTERM: last push, then Leave) at the first time,
    #: or once it has joined if later, and a fresh process with the same index (started
    #: with the others, held back) joins at the second, or once the server shows the
    #: first gone if later. None: nobody leaves.
    leave_rejoin: tuple[int, float, float] | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("async", "sync"):
            raise ConfigError(f"mode={self.mode!r} is invalid: choose async or sync")
        if not 1 <= self.num_workers <= 64:
            raise ConfigError(f"workers={self.num_workers} is invalid: use 1..64 on one machine")
        if not self.max_seconds > 0:
            raise ConfigError(f"max_seconds={self.max_seconds} is invalid: must be > 0")
        if self.slowdowns is not None and len(self.slowdowns) != self.num_workers:
            raise ConfigError(
                f"{len(self.slowdowns)} slowdowns given for {self.num_workers} workers; give one per worker"
            )
        if self.slowdowns is not None and any(not f >= 1 for f in self.slowdowns):
            raise ConfigError(f"slowdowns={self.slowdowns} are invalid: each must be >= 1")
        if self.leave_rejoin is not None:
            index, leave_s, rejoin_s = self.leave_rejoin
            if not 0 <= index < self.num_workers:
                raise ConfigError(
                    f"leave_rejoin worker index {index} is invalid: give 0..{self.num_workers - 1} (one of the workers)"
                )
            if not 0 <= leave_s < rejoin_s < self.max_seconds:
                raise ConfigError(
                    f"leave_rejoin times (leave at {leave_s} s, rejoin at {rejoin_s} s) are invalid: need "
                    f"0 <= leave < rejoin < max_seconds={self.max_seconds:g} s of training"
                )

    def speed_factors(self) -> tuple[float, ...]:
        if self.slowdowns is not None:
            return self.slowdowns
        return tuple(DEFAULT_SLOWDOWNS[i % len(DEFAULT_SLOWDOWNS)] for i in range(self.num_workers))


def _worker_name(index: int, speed_factor: float, rejoin: bool = False) -> str:
    return f"worker-{index}(x{speed_factor:g})" + ("+rejoin" if rejoin else "")


@dataclasses.dataclass
class _WorkerProcess:
    """One worker process; a rejoin is a second process with the same index."""

    index: int
    speed_factor: float
    rejoin: bool
    popen: subprocess.Popen
    #: A rejoin: seconds of training at which the demo released it to join (None: never).
    join_at_s: float | None = None
    #: Seconds of training when the demo stopped it to leave (None: it did not leave).
    left_s: float | None = None

    @property
    def name(self) -> str:
        return _worker_name(self.index, self.speed_factor, self.rejoin)

    @property
    def stem(self) -> str:
        return _file_stem(self.index, self.rejoin)


def _file_stem(index: int, rejoin: bool) -> str:
    """Of a worker process's log and stats files: worker-I, or worker-I-rejoin."""
    return f"worker-{index}" + ("-rejoin" if rejoin else "")


def _job_flags(job: JobConfig) -> list[str]:
    return [
        "--batch-size", str(job.batch_size), "--context-len", str(job.context_len),
        "--n-layer", str(job.n_layer), "--n-embd", str(job.n_embd), "--n-head", str(job.n_head),
        "--inner-lr", str(job.inner_lr), "--seed", str(job.seed),
    ]  # fmt: skip


class _Evaluator:
    """Pulls the global model as an observer and measures held-out loss (nats/char)."""

    def __init__(self, address: str, job: JobConfig) -> None:
        corpus = CharCorpus.default()
        self.model = job.build(corpus)
        self.batches = job.eval_set(corpus)
        self.manifest = Manifest.from_module(self.model)
        self.client = ParameterServerClient(address)
        self.initial_loss = evaluate(self.model, self.batches)  # the seed's model = the server's version 0
        #: The run config the server dictated while workers trained (auto values need their rates).
        self.run_config = None

    def evaluate_global(self) -> tuple[int, float]:
        pulled = self.client.pull(self.manifest)
        flat = codec_for(pulled.run_config, self.manifest).decode(pulled.payload, torch.empty(self.manifest.numel))
        with torch.no_grad():
            pos = 0
            for p in self.model.parameters():
                p.copy_(flat[pos : pos + p.numel()].view(p.shape))
                pos += p.numel()
        return pulled.version, evaluate(self.model, self.batches)


def _spawn(cmd: list[str], log_path: pathlib.Path) -> subprocess.Popen:
    # GLOO_SOCKET_IFNAME=lo keeps sync-mode collectives on loopback.
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", GLOO_SOCKET_IFNAME="lo")
    with open(log_path, "wb") as logf:
        return subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)


def _reap(procs: list[subprocess.Popen], timeout_s: float = 10.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _stop(proc: subprocess.Popen, grace_s: float = 30.0) -> int:
    """The exit code of a worker; one still running gets ``grace_s`` to finish its final
    push, then SIGTERM, then SIGKILL."""
    if proc.poll() is None:
        try:
            return proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            _reap([proc])
    return proc.returncode


def _wait_for_port(proc: subprocess.Popen, port_file: pathlib.Path, timeout_s: float, log_path: pathlib.Path) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if port_file.exists():
            return int(port_file.read_text())
        if proc.poll() is not None:
            raise AsyncDiLoCoError(f"the server exited with status {proc.returncode}; see {log_path}")
        time.sleep(0.05)
    raise AsyncDiLoCoError(f"the server did not listen within {timeout_s:g} s; see {log_path}")


def run_demo(cfg: DemoConfig, progress: bool = True) -> dict:
    """Run the demo; returns the report (also written to ``out_dir/report.json``).

    Raises:
        AsyncDiLoCoError: the server did not start.
    """
    torch.set_num_threads(1)
    out = pathlib.Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    port_file = out / "server.port"
    port_file.unlink(missing_ok=True)
    python = [sys.executable, "-m", "asyncdiloco"]
    speeds = cfg.speed_factors()
    procs: list[subprocess.Popen] = []
    started = time.monotonic()
    try:
        server = _spawn(
            [*python, "server", "--host", "127.0.0.1", "--port", "0", "--port-file", str(port_file), *cfg.server_args],
            out / "server.log",
        )
        procs.append(server)
        address = f"127.0.0.1:{_wait_for_port(server, port_file, cfg.startup_timeout_s, out / 'server.log')}"

        def spawn_worker(
            i: int, rejoin: bool = False, max_seconds: float = cfg.max_seconds, extra: tuple[str, ...] = ()
        ) -> _WorkerProcess:
            name, stem = _worker_name(i, speeds[i], rejoin), _file_stem(i, rejoin)
            launcher = (cfg.per_worker_command[i] if i < len(cfg.per_worker_command) else ()) or python
            cmd = [
                *launcher, "worker", "--server", address, "--worker-index", str(i), "--slowdown", str(speeds[i]),
                "--max-seconds", str(max_seconds), "--stats-file", str(out / f"{stem}.json"),
                "--name", name, "--mode", cfg.mode, *_job_flags(cfg.job), *cfg.worker_args,
                *(cfg.per_worker_args[i] if i < len(cfg.per_worker_args) else ()), *extra,
            ]  # fmt: skip
            (out / f"{stem}.json").unlink(missing_ok=True)  # a stale file from an earlier run in this folder
            procs.append(_spawn(cmd, out / f"{stem}.log"))
            return _WorkerProcess(i, speeds[i], rejoin, procs[-1])

        workers = [spawn_worker(i) for i in range(len(speeds))]
        if cfg.leave_rejoin is not None:  # started now, joins when released (_leave_or_rejoin)
            i, _, rejoin_s = cfg.leave_rejoin
            go = out / f"{_file_stem(i, True)}.go"
            go.unlink(missing_ok=True)
            workers.append(spawn_worker(i, True, max(1.0, cfg.max_seconds - rejoin_s), ("--join-when-file", str(go))))
        evaluator = _Evaluator(address, cfg.job)
        curve = [{"wall_s": 0.0, "version": 0, "tokens": 0, "eval_loss": evaluator.initial_loss}]
        watched, train_start_s, train_start_unix_s = _watch(cfg, evaluator, workers, started, progress)
        curve += watched
        exit_codes = [_stop(w.popen) for w in workers]  # overdue workers (hung, stopped) are terminated
        status = evaluator.client.status()
        if not status.initialized:
            raise AsyncDiLoCoError(
                f"no worker initialized the global model (exit codes {exit_codes}); see {out}/worker-*.log"
            )
        version, final_loss = evaluator.evaluate_global()
        curve.append(
            {"wall_s": time.monotonic() - started, "version": version, "tokens": status.tokens, "eval_loss": final_loss}
        )
        wall_s = time.monotonic() - started
        evaluator.client.close()
    finally:
        _reap(procs)
    if evaluator.run_config is not None:
        status.run_config.CopyFrom(evaluator.run_config)
    report = _report(
        cfg,
        out,
        status,
        curve,
        evaluator.initial_loss,
        final_loss,
        wall_s,
        workers,
        exit_codes,
        address,
        train_start_unix_s,
    )
    report["train_start_s"] = train_start_s  # when the global model existed: training time is wall_s − this
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    _plot(curve, out / "loss_curve.png", vocab_size=CharCorpus.default().vocab_size, mode=cfg.mode)
    _print_summary(report, out)
    return report


def _watch(
    cfg: DemoConfig, ev: _Evaluator, workers: list[_WorkerProcess], started: float, progress: bool
) -> tuple[list[dict], float, float | None]:
    """Poll status every second, evaluate every ``eval_every_s``, stop the
    ``leave_rejoin`` worker and release its fresh process (the last in ``workers``),
    until workers exit (or the token budget is spent). Returns the eval curve and when
    training started (s since ``started``; and on the wall clock, None if it never did)."""
    from tqdm import tqdm

    curve: list[dict] = []
    leaver = workers[cfg.leave_rejoin[0]] if cfg.leave_rejoin is not None else None
    rejoiner = workers[-1] if cfg.leave_rejoin is not None else None
    rejoined = False
    training_since_unix: float | None = None
    last_eval = time.monotonic()
    loss = ev.initial_loss
    training_since: float | None = None  # when the global model was first there
    deadline = started + cfg.max_seconds + 120.0  # workers' start-up plus their training time
    bar = tqdm(total=round(cfg.max_seconds), unit="s", disable=not progress, dynamic_ncols=True,
               bar_format="{l_bar}{bar}| {n:.0f}/{total_fmt} s{postfix}")  # fmt: skip
    try:
        while any(w.popen.poll() is None for w in workers) or (leaver is not None and not rejoined):
            if time.monotonic() > deadline:
                log.warning(
                    "workers still running %.0f s after the demo started (budget %g s of training + 120 s); "
                    "stopping them", time.monotonic() - started, cfg.max_seconds,
                )  # fmt: skip
                break
            time.sleep(1.0 if cfg.token_budget is None and cfg.leave_rejoin is None else 0.25)
            try:
                st = ev.client.status()
                if sum(w.alive for w in st.workers) >= cfg.num_workers:  # the auto values need every rate
                    ev.run_config = st.run_config
                if cfg.token_budget is not None and st.tokens >= cfg.token_budget:
                    for w in workers:  # budget spent: workers stop (their final push may land)
                        if w.popen.poll() is None:
                            w.popen.terminate()
                    break
                if leaver is not None and training_since is not None and not rejoined:
                    rejoined = _leave_or_rejoin(cfg, leaver, rejoiner, st, time.monotonic() - training_since)
                if st.initialized and time.monotonic() - last_eval >= cfg.eval_every_s:
                    version, loss = ev.evaluate_global()
                    last_eval = time.monotonic()
                    curve.append(
                        {"wall_s": last_eval - started, "version": version, "tokens": st.tokens, "eval_loss": loss}
                    )
            except AsyncDiLoCoError as exc:
                log.info("status/eval skipped: %s", exc)
                continue
            hist = list(st.staleness_histogram)
            mean_tau = sum(i * c for i, c in enumerate(hist)) / max(1, sum(hist))
            if st.initialized and training_since is None:
                training_since, training_since_unix = time.monotonic(), time.time()
            bar.n = min(bar.total, time.monotonic() - training_since) if training_since else 0
            what = (
                f"round {st.version} | aborted {st.rounds_failed}" if cfg.mode == "sync"
                else f"version {st.version} | pushes {st.applied_pushes} | staleness {mean_tau:.2f}"
            )  # fmt: skip
            bar.set_postfix_str(f"{what} | eval loss {loss:.3f} | workers {sum(w.alive for w in st.workers)}")
    finally:
        bar.close()
    return curve, (training_since - started) if training_since is not None else 0.0, training_since_unix


#: Seconds a leaving worker gets for its last push and Leave before it is stopped.
_LEAVE_GRACE_S = 30.0


def _leave_or_rejoin(cfg: DemoConfig, leaver: _WorkerProcess, rejoiner: _WorkerProcess, st, train_s: float) -> bool:
    """One poll's step of ``cfg.leave_rejoin`` at ``train_s`` seconds of training: stop
    the leaver once it is due and has joined; release the waiting fresh process once
    the rejoin is due and the server shows the leaver gone. True when nothing is left."""
    index, leave_s, rejoin_s = cfg.leave_rejoin
    if leaver.left_s is None:
        if leaver.popen.poll() is not None:  # it ended (or crashed) before its leave: nothing to rejoin
            log.warning(
                "worker %d exited (status %s) before its leave at %g s", index, leaver.popen.returncode, leave_s
            )
            rejoiner.popen.terminate()  # still waiting: it exits without joining
            return True
        joined = any(w.worker_name == leaver.name and w.alive for w in st.workers)
        if train_s >= leave_s and joined:
            leaver.popen.terminate()  # SIGTERM: the worker pushes its last Δ and calls Leave
            leaver.left_s = train_s
            log.info("worker %d leaves at %.2f s of training", index, train_s)
        return False
    if leaver.popen.poll() is None and train_s - leaver.left_s > _LEAVE_GRACE_S:
        log.warning("worker %d still running %g s after it was asked to leave; stopping it", index, _LEAVE_GRACE_S)
        _reap([leaver.popen])  # a second SIGTERM interrupts it, then SIGKILL
    gone = not any(w.worker_name == leaver.name and w.alive for w in st.workers)  # it called Leave
    if train_s >= rejoin_s and gone:
        pathlib.Path(cfg.out_dir, f"{rejoiner.stem}.go").touch()
        rejoiner.join_at_s = train_s
        log.info("worker %d rejoins at %.2f s of training (a new process)", index, train_s)
        return True
    return False


def _run_config(rc) -> dict:
    """What the server dictated (RunConfig): the outer step, H, DyLU and grouping."""
    return {
        "mode": rc.mode, "outer_optimizer": rc.outer_optimizer, "outer_lr": rc.outer_lr,
        "outer_momentum": rc.outer_momentum, "local_steps": rc.local_steps, "dylu": rc.dylu,
        "grouping": rc.grouping, "group_window_s": round(rc.group_window_s, 3),
        "group_max_wait_s": round(rc.group_max_wait_s, 3), "wire_codec": rc.wire_codec or "raw",
    }  # fmt: skip


def _report(
    cfg, out, status, curve, initial_loss, final_loss, wall_s, workers, exit_codes, address, train_start_unix_s=None
) -> dict:
    hist = list(status.staleness_histogram)
    while len(hist) > 1 and hist[-1] == 0:
        hist.pop()
    server_view: dict[str, dict] = {}  # by name, summed over a process's own rejoins (lapsed leases)
    for w in status.workers:
        agg = server_view.setdefault(w.worker_name, {"pushes": 0, "tokens": 0, "worker_ids": []})
        agg["pushes"] += w.applied_pushes
        agg["tokens"] += w.tokens
        agg["worker_ids"].append(w.worker_id)
    per_worker = []
    for p, code in zip(workers, exit_codes):
        stats_path = out / f"{p.stem}.json"
        stats = json.loads(stats_path.read_text()) if stats_path.exists() else {}
        name = p.name
        seen = server_view.get(name, {"pushes": 0, "tokens": 0, "worker_ids": []})
        began = stats.get("train_started_unix_s")
        per_worker.append(
            {
                "index": p.index,
                "rejoin": p.rejoin,
                "name": name,
                "worker_ids": seen["worker_ids"],
                "speed_factor": p.speed_factor,
                "slowdown_changes": stats.get("slowdown_changes", ""),
                "exit_code": code,
                "train_started_s": round(began - train_start_unix_s, 3) if began and train_start_unix_s else None,
                "left_s": None if p.left_s is None else round(p.left_s, 3),
                "join_at_s": None if p.join_at_s is None else round(p.join_at_s, 3),
                "pushes": seen["pushes"],
                "tokens": stats.get("tokens", seen["tokens"]),  # a crashed worker wrote no stats file
                "inner_steps": stats.get("inner_steps", 0),
                "pushes_refused": stats.get("pushes_refused", 0),
                "sync_failures": stats.get("sync_failures", 0),
                "comm_s": round(stats.get("comm_s", 0.0), 3),
                "idle_s": round(stats.get("idle_s", stats.get("blocked_s", stats.get("comm_s", 0.0))), 3),
                "blocked_s": round(stats.get("blocked_s", 0.0), 3),
                "held_s": round(stats.get("held_s", 0.0), 3),
                "blocked_fraction": round(stats["blocked_s"] / stats["wall_s"], 4) if stats.get("wall_s") else None,
                "mean_staleness": (sum(stats["staleness"]) / len(stats["staleness"]))
                if stats.get("staleness")
                else None,
                "rounds_committed": stats.get("rounds_committed"),
                "rounds_failed": stats.get("rounds_failed"),
                "heals": stats.get("heals"),
            }
        )
    return {
        "mode": cfg.mode,
        "overlap": "--overlap" in cfg.worker_args,
        "rounds_committed": status.rounds_committed if cfg.mode == "sync" else None,
        "rounds_failed": status.rounds_failed if cfg.mode == "sync" else None,
        "round_time_s": _round_times([out / f"{p.stem}.json" for p in workers]) if cfg.mode == "sync" else None,
        "server": address,
        "initial_eval_loss": initial_loss,
        "final_eval_loss": final_loss,
        "eval_loss_unit": "nats/char on the held-out split",
        "ln_vocab": math.log(CharCorpus.default().vocab_size),
        "version": status.version,
        "applied_pushes": status.applied_pushes,
        "rejected_pushes": status.rejected_pushes,
        "duplicate_pushes": status.duplicate_pushes,
        "staleness_histogram": hist,
        "bytes_pushed": status.bytes_pushed,
        "bytes_pulled": status.bytes_pulled,
        "pulls": status.pulls,
        "wall_s": wall_s,
        "tokens": sum(w["tokens"] for w in per_worker),
        "tokens_applied": status.tokens,
        "outer_optimizer": status.outer_optimizer,
        "staleness_weighting": status.staleness_weighting,
        "local_steps": status.run_config.local_steps,
        "run_config": _run_config(status.run_config),
        "group_size_histogram": list(status.group_size_histogram),
        "divergence_warnings": status.divergence_warnings,
        "num_parameters": sum(math.prod(t.shape) for t in status.manifest.tensors),
        "job": dataclasses.asdict(cfg.job),
        "max_seconds_per_worker": cfg.max_seconds,
        "leave_rejoin": list(cfg.leave_rejoin) if cfg.leave_rejoin is not None else None,
        "workers": per_worker,
        "eval_curve": curve,
    }


def _round_times(stats_paths: list[pathlib.Path]) -> dict | None:
    """Medians over the workers' round logs, seconds: wall time between two committed
    rounds (``round``), waiting for the quorum, collective plus upload, commit wait."""
    between, quorum, collective, commit = [], [], [], []
    for path in stats_paths:
        if not path.exists():
            continue
        rounds = json.loads(path.read_text()).get("rounds", [])
        ends = [r["end_s"] for r in rounds if r["committed"]]
        between += [b - a for a, b in zip(ends, ends[1:])]
        quorum += [r["quorum_wait_s"] for r in rounds]
        collective += [r["allreduce_s"] for r in rounds]
        commit += [r["commit_wait_s"] for r in rounds]
    if not between:
        return None
    med = lambda xs: round(statistics.median(xs), 4) if xs else None  # noqa: E731
    return {"round": med(between), "quorum_wait": med(quorum), "allreduce_and_upload": med(collective),
            "commit_wait": med(commit), "samples": len(between)}  # fmt: skip


def _plot(curve: list[dict], path: pathlib.Path, vocab_size: int, mode: str = "async") -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((ax1, "wall_s", "wall time (s)"), (ax2, "tokens", "tokens applied (characters)")):
        ax.plot([c[key] for c in curve], [c["eval_loss"] for c in curve], marker="o", ms=3)
        ax.axhline(math.log(vocab_size), ls="--", c="gray", lw=0.8, label=f"ln(vocab) = {math.log(vocab_size):.2f}")
        ax.set_xlabel(label)
        ax.set_ylabel("held-out loss (nats/char)")
        ax.grid(alpha=0.3)
        ax.legend()
    title = "synchronous (quorum allreduce)" if mode == "sync" else "asynchronous"
    fig.suptitle(f"asyncdiloco demo: global model, {title} DiLoCo")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _print_summary(report: dict, out: pathlib.Path) -> None:
    hist = report["staleness_histogram"]
    stale = sum(hist[1:])
    print(
        f"\nasyncdiloco demo: {len(report['workers'])} worker{'s' if len(report['workers']) != 1 else ''}, "
        f"{report['wall_s']:.0f} s, {report['tokens']:,} tokens\n"
        f"  held-out loss {report['initial_eval_loss']:.3f} -> {report['final_eval_loss']:.3f} nats/char\n"
        f"  version {report['version']}: {report['applied_pushes']} pushes applied, {report['rejected_pushes']} refused, "
        f"{stale} applied with staleness > 0 (histogram {hist})\n"
        f"  bytes pushed {report['bytes_pushed']:,}, pulled {report['bytes_pulled']:,}\n"
        + (
            f"  rounds committed {report['rounds_committed']}, aborted {report['rounds_failed']}; "
            f"median round times (s) {report['round_time_s']}\n"
            if report["mode"] == "sync"
            else ""
        )
        + "".join(
            f"  {w['name']}: {w['inner_steps']} steps, {w['pushes']} pushes, {w['tokens']:,} tokens, "
            f"idle {w['idle_s']:.1f} s\n"
            for w in report["workers"]
        )
        + f"  report: {out / 'report.json'}, plot: {out / 'loss_curve.png'}",
        flush=True,
    )
