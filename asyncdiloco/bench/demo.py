"""The demo: a parameter server and N workers of different speeds as processes on
loopback (``run_demo``), stopped on a token budget or a time cap, evaluated while they
train, every child reaped on exit. Async or sync mode, a worker that leaves and rejoins,
a sharded server. What it runs, how it stops and every report field: docs/operations.md,
"The demo"; the report itself is demo_report.py's."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Sequence

import torch

from asyncdiloco.bench import demo_report
from asyncdiloco.bench.perf.harness import reap, wait_for_port
from asyncdiloco.errors import AsyncDiLoCoError, ConfigError
from asyncdiloco.flags.settings import WORKER_JOB
from asyncdiloco.job.config import JobConfig
from asyncdiloco.job.dataset import CharCorpus
from asyncdiloco.tools.evaluator import Evaluator
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.shards import load_shard_addresses
from asyncdiloco.worker.client import ParameterServerClient
from asyncdiloco.worker.sharded import ShardedClient

log = logging.getLogger(__name__)

DEFAULT_SLOWDOWNS = (1.0, 1.5, 2.0, 3.0)
#: The demo's default token budget: the server applied 5.59M tokens in 120 s of training
#: with the default job and workers on a quiet 2-core machine (docs/algorithms.md, "The
#: run's end"), so the demo still takes about 3 minutes there, and the same work elsewhere.
DEFAULT_TOKEN_BUDGET = 5_500_000
#: The default cap, seconds of training: a slow or loaded machine stops here instead.
DEFAULT_MAX_SECONDS = 600.0
#: Seconds the workers' own ``--max-seconds`` runs past the demo's cap: the demo stops them
#: itself (after its evaluation at the stop); their own bound only ends a run whose demo hung.
_WORKER_BACKSTOP_S = 60.0
#: The most parameter-server shards the demo runs on one machine.
MAX_SHARDS = 16


@dataclasses.dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """What the demo runs."""

    #: Worker processes.
    num_workers: int = 4
    #: The cap, seconds of training (from ``train_start_s``): the demo evaluates and stops
    #: every worker then if the token budget is not spent yet.
    max_seconds: float = DEFAULT_MAX_SECONDS
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
    #: Stop every worker (SIGTERM) once the server has applied this many tokens, so runs
    #: compare at equal tokens on any machine; None: only ``max_seconds`` stops them.
    token_budget: int | None = DEFAULT_TOKEN_BUDGET
    #: (worker index, leave at s, rejoin at s), seconds of training (from ``train_start_s``):
    #: that worker's process is stopped (SIGTERM: last push, then Leave) at the first time,
    #: or once it has joined if later, and a fresh process with the same index (started
    #: with the others, held back) joins at the second, or once the server shows the
    #: first gone if later. None: nobody leaves.
    leave_rejoin: tuple[int, float, float] | None = None
    #: Parameter-server shards (``asyncdiloco server --shards S``); 1: one unsharded server.
    shards: int = 1

    def __post_init__(self) -> None:
        if self.mode not in ("async", "sync"):
            raise ConfigError(f"mode={self.mode!r} is invalid: choose async or sync")
        if not 1 <= self.shards <= MAX_SHARDS:
            raise ConfigError(f"shards={self.shards} is invalid: use 1..{MAX_SHARDS} on one machine")
        if self.shards > 1 and self.mode != "async":
            raise ConfigError(
                f"shards={self.shards} with mode={self.mode!r}: a sharded server runs async mode only; "
                f"drop the shards or use mode async"
            )
        if self.token_budget is not None and self.token_budget < 1:
            raise ConfigError(f"token_budget={self.token_budget} is invalid: give tokens >= 1, or None for no budget")
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
class WorkerProcess:
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


def spawn(cmd: list[str], log_path: pathlib.Path) -> subprocess.Popen:
    """Start ``cmd`` with one OpenMP thread, its output into ``log_path``; GLOO_SOCKET_IFNAME=lo
    keeps sync-mode collectives on loopback."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", GLOO_SOCKET_IFNAME="lo")
    with open(log_path, "wb") as logf:
        return subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)


def _stop(proc: subprocess.Popen, grace_s: float = 30.0) -> int:
    """The exit code of a worker; one still running gets ``grace_s`` to finish its final
    push, then SIGTERM, then SIGKILL."""
    if proc.poll() is None:
        try:
            return proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            reap([proc])
    return proc.returncode


@dataclasses.dataclass
class Outcome:
    """What a finished demo saw: the server's last status, the eval curve, the processes."""

    address: str
    status: pb.StatusReply
    curve: list[dict]
    initial_loss: float
    final_loss: float
    wall_s: float
    #: One per worker process (the demo's ``WorkerProcess``, a fleet's workers).
    workers: Sequence[demo_report.ReportedWorker]
    #: Of each worker's process, in ``workers``' order; None: it never exited on its own.
    exit_codes: Sequence[int | None]
    #: When the global model first existed: seconds after the demo started, and on the wall clock.
    train_start_s: float
    train_start_unix_s: float | None
    #: The shards' addresses, shard 0 first; empty: one unsharded server.
    shard_addresses: Sequence[str] = ()
    #: How training ended (``_Watch.stop_info``): which bound, the bounds, and the global
    #: model's evaluation at the stop, before the closing pushes; None: not recorded.
    stop: dict | None = None


class _Processes:
    """The demo's server and worker processes; ``reap`` ends whichever still run."""

    def __init__(self, cfg: DemoConfig, out: pathlib.Path) -> None:
        self.cfg, self.out = cfg, out
        self.speeds = cfg.speed_factors()
        self.popens: list[subprocess.Popen] = []
        self.python = [sys.executable, "-m", "asyncdiloco"]
        #: With ``cfg.shards`` > 1: the shard-map file the server writes and the workers read.
        self.shard_map = out / "shards.json" if cfg.shards > 1 else None

    def start_server(self) -> str:
        """Start ``asyncdiloco server`` on a free port (``cfg.shards`` > 1: S shards on free
        ports, their addresses in ``shard_map``); returns (shard 0's) address once it listens."""
        port_file = self.out / "server.port"
        port_file.unlink(missing_ok=True)
        cmd = [*self.python, "server", "--host", "127.0.0.1", "--port", "0", "--port-file", str(port_file)]
        cmd += ["--drain-s", "0"]  # no load balancer routes to it: stop at once
        if self.shard_map is not None:  # the server writes the map before the port file
            self.shard_map.unlink(missing_ok=True)
            cmd += ["--shards", str(self.cfg.shards), "--shard-map", str(self.shard_map)]
        server = spawn([*cmd, *self.cfg.server_args], self.out / "server.log")
        self.popens.append(server)
        return f"127.0.0.1:{wait_for_port(server, port_file, self.cfg.startup_timeout_s, self.out / 'server.log')}"

    def start_workers(self, address: str) -> list[WorkerProcess]:
        """One process per worker, plus the ``leave_rejoin`` worker's fresh process (the
        last), started now and held back until released (``_leave_or_rejoin``)."""
        workers = [self._start_worker(address, i) for i in range(len(self.speeds))]
        if self.cfg.leave_rejoin is not None:
            i, _, rejoin_s = self.cfg.leave_rejoin
            go = self.out / f"{_file_stem(i, True)}.go"
            go.unlink(missing_ok=True)
            max_s = max(1.0, self.cfg.max_seconds - rejoin_s) + _WORKER_BACKSTOP_S
            workers.append(self._start_worker(address, i, True, max_s, ("--join-when-file", str(go))))
        return workers

    def _start_worker(
        self, address: str, i: int, rejoin: bool = False, max_seconds: float | None = None, extra: tuple[str, ...] = ()
    ) -> WorkerProcess:
        cfg, stem = self.cfg, _file_stem(i, rejoin)
        launcher = (cfg.per_worker_command[i] if i < len(cfg.per_worker_command) else ()) or self.python
        max_s = cfg.max_seconds + _WORKER_BACKSTOP_S if max_seconds is None else max_seconds
        cmd = [*launcher, "worker", "--server", address, "--worker-index", str(i), "--mode", cfg.mode]
        stats = self.out / f"{stem}.json"
        cmd += ["--slowdown", str(self.speeds[i]), "--max-seconds", str(max_s), "--stats-file", str(stats)]
        cmd += ["--worker-name", _worker_name(i, self.speeds[i], rejoin), *WORKER_JOB.argv(cfg.job)]
        cmd += [*(("--shard-map", str(self.shard_map)) if self.shard_map is not None else ()), *cfg.worker_args]
        cmd += [*(cfg.per_worker_args[i] if i < len(cfg.per_worker_args) else ()), *extra]
        stats.unlink(missing_ok=True)  # a stale file from an earlier run in this folder
        self.popens.append(spawn(cmd, self.out / f"{stem}.log"))
        return WorkerProcess(i, self.speeds[i], rejoin, self.popens[-1])

    def reap(self) -> None:
        reap(self.popens)

    def shard_addresses(self) -> list[str]:
        """Every shard's address, shard 0 first (after ``start_server``); empty: one server."""
        return load_shard_addresses(self.shard_map) if self.shard_map is not None else []

    def client(self, address: str) -> ParameterServerClient | ShardedClient:
        """The demo's own client: of every shard (``ShardedClient``), or of the one server."""
        shards = self.shard_addresses()
        return ShardedClient(shards) if shards else ParameterServerClient(address)


def run_demo(cfg: DemoConfig, progress: bool = True) -> dict:
    """Run the demo; returns the report (also written to ``out_dir/report.json``).

    Raises:
        AsyncDiLoCoError: the server did not start, or no worker initialized the model.
    """
    torch.set_num_threads(1)
    out = pathlib.Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    procs = _Processes(cfg, out)
    try:
        outcome = _train(cfg, procs, progress)
    finally:
        procs.reap()
    report = demo_report.report(cfg, out, outcome)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    demo_report.plot(outcome.curve, out / "loss_curve.png", vocab_size=CharCorpus.default().vocab_size, mode=cfg.mode)
    demo_report.print_summary(report, out)
    return report


def _train(cfg: DemoConfig, procs: _Processes, progress: bool) -> Outcome:
    """Start the processes, watch them train, stop them and evaluate the final global model."""
    started = time.monotonic()
    address = procs.start_server()
    workers = procs.start_workers(address)
    evaluator = Evaluator(procs.client(address), cfg.job, name="demo")
    initial_loss = evaluator.held_out_loss()  # the seed's model = the server's version 0
    curve = [{"wall_s": 0.0, "version": 0, "tokens": 0, "eval_loss": initial_loss}]
    watched, train_start_s, train_start_unix_s, run_config, stop = _watch(
        cfg, evaluator, workers, started, progress, initial_loss
    )
    curve += watched
    exit_codes = [_stop(w.popen) for w in workers]  # overdue workers (hung, stopped) are terminated
    client = evaluator.client
    status = client.combined_status(evaluator.manifest) if isinstance(client, ShardedClient) else client.status()
    if not status.initialized:
        raise AsyncDiLoCoError(
            f"no worker initialized the global model (exit codes {exit_codes}); see {cfg.out_dir}/worker-*.log"
        )
    final = evaluator.evaluate_global()  # reported too: the server's status shows the final loss
    wall_s = time.monotonic() - started
    curve.append({"wall_s": wall_s, "version": final.version, "tokens": status.tokens, "eval_loss": final.loss})
    evaluator.client.close()
    if run_config is not None:
        status.run_config.CopyFrom(run_config)
    return Outcome(
        address=address,
        status=status,
        curve=curve,
        initial_loss=initial_loss,
        final_loss=final.loss,
        wall_s=wall_s,
        workers=workers,
        exit_codes=exit_codes,
        train_start_s=train_start_s,
        train_start_unix_s=train_start_unix_s,
        shard_addresses=procs.shard_addresses(),
        stop=stop,
    )


def _watch(
    cfg: DemoConfig, ev: Evaluator, workers: list[WorkerProcess], started: float, progress: bool, initial_loss: float
) -> tuple[list[dict], float, float | None, pb.RunConfig | None, dict]:
    """Poll status every 0.25 s, evaluate every ``eval_every_s`` (each loss reported to
    the server), stop the ``leave_rejoin`` worker and release its fresh process (the last
    in ``workers``), until the token budget is spent or ``max_seconds`` of training have
    passed (then evaluate and stop the workers) or every worker exited. Returns the eval
    curve, when training started (s since ``started``; and on the wall clock, None if it
    never did), the run config once every worker was live (None if never) and how
    training ended (``_Watch.stop_info``)."""
    from tqdm import tqdm

    watch = _Watch(cfg, ev, workers, started, initial_loss)
    budget = cfg.token_budget
    bar = tqdm(  # in tokens against the budget (seconds against the cap in the text), else in seconds
        total=budget if budget is not None else round(cfg.max_seconds),
        unit="tokens" if budget is not None else "s",
        disable=not progress,
        dynamic_ncols=True,
        bar_format="{l_bar}{bar}| {n:,.0f}/{total:,.0f} " + ("tokens" if budget is not None else "s") + "{postfix}",
    )
    bar.set_postfix_str(_starting_text(len(workers)))
    try:
        while watch.running():
            if time.monotonic() > watch.deadline:
                log.warning(
                    "workers still running %.0f s after the demo started (budget %g s of training + 120 s); "
                    "stopping them",
                    time.monotonic() - started,
                    cfg.max_seconds,
                )
                break
            time.sleep(0.25)
            try:
                st = watch.poll()
            except AsyncDiLoCoError as exc:
                log.info("status/eval skipped: %s", exc)
                continue
            if st is None:
                break
            watch.show(bar, st)
    finally:
        bar.close()
    since = watch.training_since
    train_start = (since - started) if since is not None else 0.0
    return watch.curve, train_start, watch.training_since_unix, watch.run_config, watch.stop_info()


class _Watch:
    """What the demo's status poll keeps between polls."""

    def __init__(
        self, cfg: DemoConfig, ev: Evaluator, workers: list[WorkerProcess], started: float, initial_loss: float
    ) -> None:
        self.cfg, self.ev, self.workers, self.started = cfg, ev, workers, started
        #: The run config the server dictated while every worker trained (auto values need their rates).
        self.run_config: pb.RunConfig | None = None
        self.curve: list[dict] = []
        self.leaver = workers[cfg.leave_rejoin[0]] if cfg.leave_rejoin is not None else None
        self.rejoiner = workers[-1] if cfg.leave_rejoin is not None else None
        self.rejoined = False
        self.training_since: float | None = None  # when the global model was first there
        self.training_since_unix: float | None = None
        self.last_eval = time.monotonic()
        self.loss = initial_loss
        self.deadline = started + cfg.max_seconds + 120.0  # workers' start-up plus their training time
        #: Which bound ended training: "tokens", "time", or "workers" (they all exited first).
        self.stop = "workers"
        #: The evaluation at the stop, before the workers' closing pushes (None: none made).
        self.stop_point: dict | None = None

    def running(self) -> bool:
        return any(w.popen.poll() is None for w in self.workers) or (self.leaver is not None and not self.rejoined)

    def train_s(self) -> float:
        """Seconds of training so far (0 before the global model existed)."""
        return time.monotonic() - self.training_since if self.training_since is not None else 0.0

    def poll(self) -> pb.StatusReply | None:
        """One poll: the status, the leave or rejoin when due, an evaluation when due.
        None once the token budget is spent or ``max_seconds`` of training have passed
        (the global model is then evaluated and the workers stopped: ``stop_workers``)."""
        cfg, st = self.cfg, self.ev.client.status()
        if sum(w.alive for w in st.workers) >= cfg.num_workers:  # the auto values need every rate
            self.run_config = st.run_config
        if cfg.token_budget is not None and st.tokens >= cfg.token_budget:
            self.stop_workers("tokens", st)
            return None
        if self.training_since is not None and self.train_s() >= cfg.max_seconds:
            self.stop_workers("time", st)
            return None
        if self.leaver is not None and self.rejoiner is not None and self.training_since is not None:
            if not self.rejoined:
                train_s = time.monotonic() - self.training_since
                self.rejoined = _leave_or_rejoin(cfg, self.leaver, self.rejoiner, st, train_s)
        if st.initialized and time.monotonic() - self.last_eval >= cfg.eval_every_s:
            self.evaluate(st.tokens)
        return st

    def evaluate(self, tokens: int) -> dict:
        """Evaluate the global model now (the loss reported to the server); returns its
        curve point, appended to ``curve``."""
        result = self.ev.evaluate_global()
        self.loss, self.last_eval = result.loss, time.monotonic()
        point = {"wall_s": self.last_eval - self.started, "version": result.version, "tokens": tokens}
        self.curve.append({**point, "eval_loss": result.loss})
        return self.curve[-1]

    def stop_workers(self, why: str, st: pb.StatusReply) -> None:
        """Training ends (``why``: "tokens" or "time"): evaluate the global model as it is
        (the last evaluation while training, before the closing pushes), then stop every
        worker (SIGTERM: each pushes its partial round and leaves)."""
        self.stop = why
        try:
            self.stop_point = dict(self.evaluate(st.tokens))
        except AsyncDiLoCoError as exc:
            log.info("the evaluation at the stop was skipped: %s", exc)
        for w in self.workers:
            if w.popen.poll() is None:
                w.popen.terminate()

    def stop_info(self) -> dict:
        """How training ended, for the report: ``reason`` ("tokens", "time" or "workers"),
        the bounds (``max_tokens``, ``max_seconds``), seconds of training at the stop and
        the evaluation there (``eval_loss``, ``version``, ``tokens``; None without one)."""
        point = self.stop_point or {}
        return {
            "reason": self.stop,
            "max_tokens": self.cfg.token_budget,
            "max_seconds": self.cfg.max_seconds,
            "train_s": round(self.train_s(), 3),
            "eval_loss": point.get("eval_loss"),
            "version": point.get("version"),
            "tokens": point.get("tokens"),
        }

    def show(self, bar, st: pb.StatusReply) -> None:
        """Note when training started; show the progress bar: tokens against the budget
        (seconds of training against the cap in its text), or seconds without a budget."""
        if st.initialized and self.training_since is None:
            self.training_since, self.training_since_unix = time.monotonic(), time.time()
        if self.cfg.token_budget is not None:
            bar.n = min(bar.total, st.tokens)
        else:
            bar.n = min(bar.total, self.train_s()) if self.training_since else 0
        hist = list(st.staleness_histogram)
        mean_tau = sum(i * c for i, c in enumerate(hist)) / max(1, sum(hist))
        what = (
            f"round {st.version} | aborted {st.rounds_failed}"
            if self.cfg.mode == "sync"
            else f"version {st.version} | pushes {st.applied_pushes} | staleness {mean_tau:.2f}"
        )
        alive = sum(w.alive for w in st.workers)
        if not st.initialized:  # nothing trains yet: say what the demo waits for
            bar.set_postfix_str(_starting_text(len(self.workers)) if alive == 0 else "waiting for the initial model")
            return
        clock = f" | {self.train_s():.0f}/{self.cfg.max_seconds:g} s" if self.cfg.token_budget is not None else ""
        bar.set_postfix_str(f"{what} | eval loss {self.loss:.3f} | workers {alive}{clock}")


def _starting_text(num_processes: int) -> str:
    """The bar's text until a worker joined: the worker processes load torch and build
    the model first (seconds each, longer on a loaded machine)."""
    return f"starting {num_processes} worker processes (loading torch, building the model); waiting for the first join"


#: Seconds a leaving worker gets for its last push and Leave before it is stopped.
_LEAVE_GRACE_S = 30.0


def _leave_or_rejoin(
    cfg: DemoConfig, leaver: WorkerProcess, rejoiner: WorkerProcess, st: pb.StatusReply, train_s: float
) -> bool:
    """One poll's step of ``cfg.leave_rejoin`` at ``train_s`` seconds of training: stop
    the leaver once it is due and has joined; release the waiting fresh process once
    the rejoin is due and the server shows the leaver gone. True when nothing is left."""
    assert cfg.leave_rejoin is not None
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
        reap([leaver.popen])  # a second SIGTERM interrupts it, then SIGKILL
    gone = not any(w.worker_name == leaver.name and w.alive for w in st.workers)  # it called Leave
    if train_s >= rejoin_s and gone:
        pathlib.Path(cfg.out_dir, f"{rejoiner.stem}.go").touch()
        rejoiner.join_at_s = train_s
        log.info("worker %d rejoins at %.2f s of training (a new process)", index, train_s)
        return True
    return False
