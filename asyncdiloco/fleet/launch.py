"""``launch(spec)``: the driver of a fleet on Ray. It starts the server's actor, then one
actor per worker with its group's resource request, watches them (watch.py), restarts a
dead worker under its name while it has restarts and time left (the driver's restarts,
not Ray's), ends the overdue (stopping.py) and writes the report (report.py); the policy
is in docs/operations.md "A fleet on Ray".
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

from asyncdiloco.errors import AsyncDiLoCoError
from asyncdiloco.flags.settings import WORKER_JOB
from asyncdiloco.fleet.actors import ServerActor, WorkerActor
from asyncdiloco.fleet.ray_env import connect, ray_module
from asyncdiloco.fleet.report import FleetReport, FleetWorker
from asyncdiloco.fleet.resources import check_fits, fleet_cpus, local_num_cpus
from asyncdiloco.fleet.spec import FleetSpec
from asyncdiloco.fleet.stopping import INTERRUPT_GRACE_S, WorkerRun, interrupted, keep_server_log, overdue, salvage
from asyncdiloco.fleet.watch import Watch
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.security import TRUSTED_NETWORK_FLAG

log = logging.getLogger(__name__)

#: Seconds a restarted worker needs at least (start-up, join, a round); less left: not restarted.
MIN_RESTART_S = 5.0


def launch(
    spec: FleetSpec,
    *,
    address: str | None = None,
    local_cpus: float | None = None,
    on_status: Callable[[Fleet, pb.StatusReply], None] | None = None,
) -> FleetReport:
    """Run the fleet ``spec`` on Ray until its workers are done; write and return the report.

    Args:
        spec: the server, the worker groups, the bounds, the token, the output folder.
        address: the Ray cluster ("HEAD:6379", "auto"); None starts a Ray of this machine
            alone on 127.0.0.1 (ray_env.py) and shuts it down at the end.
        local_cpus: logical CPUs of that local Ray (None: the machine's cores, or as many
            as the fleet reserves when that is more; resources.py).
        on_status: called with the fleet and each status reply of the server's (about
            twice a second), e.g. to kill a worker's actor in a drill.
    Returns:
        The report (also in ``spec.out_dir/report.json``).
    Raises:
        ConfigError: Ray is not installed, or a setting is refused (a request no node holds).
        AsyncDiLoCoError: no cluster at ``address``, the server's actor did not start or
            died, or no worker finished.
        KeyboardInterrupt: Ctrl-C (or SIGTERM through the CLI), after the fleet was stopped
            and its logs collected in ``spec.out_dir`` (stopping.py ``interrupted``).
    """
    num_cpus = _local_ray_cpus(spec, local_cpus) if address is None else local_cpus
    started_ray = connect(address, num_cpus)  # first: a local Ray's loopback switch is read at import
    ray = ray_module()
    try:
        nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        for line in check_fits(spec, nodes):
            log.warning("%s", line)
        fleet = Fleet(spec, ray_address=address or "local", on_status=on_status)
        try:
            fleet.start()
            fleet.watch()
            return fleet.finish()
        except KeyboardInterrupt:
            interrupted(fleet)
            raise
        except AsyncDiLoCoError:
            if fleet.server is not None:
                keep_server_log(fleet, INTERRUPT_GRACE_S)
            raise
        finally:
            fleet.close()
    finally:
        if started_ray:
            ray.shutdown()


def _local_ray_cpus(spec: FleetSpec, local_cpus: float | None) -> float:
    """The local Ray's logical CPUs (resources.py ``local_num_cpus``), with a line when
    they are more than the machine's cores."""
    cores = os.cpu_count() or 1
    num_cpus = local_num_cpus(spec, local_cpus, cores)
    if num_cpus > cores:
        log.info(
            "the fleet reserves %g CPUs and this machine has %d cores: the local Ray gets %g logical CPUs, "
            "oversubscribing the cores",
            fleet_cpus(spec),
            cores,
            num_cpus,
        )
    return num_cpus


class Fleet:
    """The driver's view of a running fleet (``launch`` makes and runs one)."""

    def __init__(self, spec: FleetSpec, ray_address: str, on_status: Callable[..., None] | None = None) -> None:
        self.ray = ray_module()
        self.spec, self.ray_address, self.on_status = spec, ray_address, on_status
        self.run_id = secrets.token_hex(4)
        self.token = spec.token if spec.token is not None else secrets.token_urlsafe(32)
        self.out = pathlib.Path(spec.out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.state_root = spec.state_root or str(
            pathlib.Path(tempfile.gettempdir()) / f"asyncdiloco-fleet-{self.run_id}"
        )
        self.workers: list[FleetWorker] = []
        self.actors: dict[str, Any] = {}  # worker name -> its live actor
        self.runs: dict[Any, WorkerRun] = {}  # ObjectRef of a run call -> the run
        self.ready: dict[Any, WorkerRun] = {}  # ObjectRef of a run's ``ready`` -> the run, until placed
        self.last_end = time.monotonic()  # when a run of the fleet last ended (its resources freed)
        self.first_start: dict[str, float] = {}  # worker name -> when its first actor was made (monotonic)
        self.server: Any = None
        self.serving: Any = None  # ObjectRef of ServerActor.serve: fails when the actor dies
        self.address = ""
        self.where: dict = {}
        self.watcher: Watch | None = None

    # ------------------------------------------------------------------ start
    def start(self) -> None:
        """Start the server's actor, wait until it listens, then every worker's actor."""
        spec, ray = self.spec, self.ray
        server_cls = ray.remote(ServerActor)
        self.server = server_cls.options(
            name=f"asyncdiloco-{self.run_id}-server",
            num_cpus=spec.server_num_cpus,
            resources=spec.server_resources or None,
            max_concurrency=4,
        ).remote(spec.server, self.token, spec.insecure_trusted_network)
        where = self.where = self.get_within(
            self.server.where.remote(), spec.startup_timeout_s, "the server's actor to listen"
        )
        self.address = where["address"]
        if self.ray_address != "local" and self.address.startswith(("127.", "localhost", "[::1]")):
            log.warning(
                "fleet %s: the server listens on %s, which only workers on its own node reach; give the server "
                "host 0.0.0.0 (ServerConfig(host=...), --server-host) for a fleet of several nodes",
                self.run_id,
                self.address,
            )
        self.serving = self.server.serve.remote()
        metrics = f", dashboard at http://{where['node_ip']}:{where['metrics_port']}/" if where["metrics_port"] else ""
        log.info("fleet %s: server listening on %s%s", self.run_id, self.address, metrics)
        self.watcher = Watch(spec, self.token, self.address, self.run_id, self.out)
        index = 0
        for group in spec.groups:
            resources = {"num_cpus": group.num_cpus, "num_gpus": group.num_gpus, **group.resources}
            for name in group.worker_names():
                self.workers.append(FleetWorker(name, group.name, index, group.slowdown, resources))
                index += 1
        for w in self.workers:
            self._start_worker(w, self.spec.max_seconds)
        log.info("fleet %s: %d worker actors requested (%s)", self.run_id, len(self.workers), self._groups_text())

    def _groups_text(self) -> str:
        return ", ".join(f"{g.name}: {g.count} x {g.num_cpus:g} CPU {g.num_gpus:g} GPU" for g in self.spec.groups)

    def get_within(self, ref: Any, timeout_s: float, what: str) -> Any:
        """``ray.get(ref)`` within ``timeout_s``; ``what`` names the wait in the error.

        Raises:
            AsyncDiLoCoError: timed out, or the call failed (its actor died).
        """
        try:
            return self.ray.get(ref, timeout=timeout_s)
        except self.ray.exceptions.GetTimeoutError:
            raise AsyncDiLoCoError(
                f"timed out after {timeout_s:g} s waiting for {what}; is there a node with the resources it asks "
                f"for? (`ray status` lists them)"
            ) from None
        except self.ray.exceptions.RayError as exc:
            raise AsyncDiLoCoError(f"{what} failed: {exc}") from None

    def _group(self, w: FleetWorker):
        return next(g for g in self.spec.groups if g.name == w.group)

    def worker_argv(self, w: FleetWorker, max_seconds: float | None) -> list[str]:
        """``asyncdiloco worker``'s flags for ``w`` (the actor adds name, state folder,
        stats file and token)."""
        group, spec = self._group(w), self.spec
        argv = ["--server", self.address, "--mode", spec.server.mode, "--worker-index", str(w.index)]
        argv += ["--slowdown", str(w.speed_factor), "--device", group.worker_device]
        argv += ["--threads", str(max(1, int(group.num_cpus)))]
        if max_seconds is not None:
            argv += ["--max-seconds", f"{max_seconds:.3f}"]
        if spec.max_steps is not None:
            argv += ["--max-steps", str(spec.max_steps)]
        if spec.insecure_trusted_network:
            argv += [TRUSTED_NETWORK_FLAG]
        return [*argv, *WORKER_JOB.argv(spec.job), *group.worker_args]

    def _start_worker(self, w: FleetWorker, max_seconds: float | None) -> None:
        group = self._group(w)
        attempt = w.restarts
        actor = (
            self.ray.remote(WorkerActor)
            .options(
                name=f"asyncdiloco-{self.run_id}-{w.name}-{attempt}",
                num_cpus=group.num_cpus,
                num_gpus=group.num_gpus,
                resources=group.resources or None,
                max_concurrency=2,
            )
            .remote(w.name, f"{self.state_root}/{w.name}", group.ranks)
        )
        self.actors[w.name] = actor
        now = time.monotonic()
        self.first_start.setdefault(w.name, now)
        run = WorkerRun(w, actor, actor.pid.remote(), max_seconds, requested_at=now)
        self.runs[actor.run.remote(self.worker_argv(w, max_seconds), self.token)] = run
        self.ready[run.ready] = run
        w.state = "running"

    def actor(self, name: str) -> Any:
        """The live actor of worker ``name`` (for drills: ``ray.kill(fleet.actor("cpu-1"))``)."""
        return self.actors[name]

    # ------------------------------------------------------------------ watch
    def watch(self) -> None:
        """Until no worker runs: collect finished runs (restarting the dead), poll the
        server's status, evaluate, log progress, and stop the overdue (stopping.py).

        Raises:
            AsyncDiLoCoError: the server's actor died, or no worker finished.
        """
        assert self.watcher is not None
        while self.runs:
            done, _ = self.ray.wait([*self.runs, *self.ready, self.serving], num_returns=1, timeout=0.5)
            if self.serving in done:
                self.get_within(self.serving, 1.0, "the server's actor")  # raises its death
                raise AsyncDiLoCoError("the server's actor stopped while the workers trained")
            for ref in done:
                if ref in self.ready:
                    self.ready.pop(ref).placed_at = time.monotonic()
                elif ref in self.runs:
                    self._collect(ref)
            status = self.watcher.poll(self.workers)
            if status is not None and self.on_status is not None:
                self.on_status(self, status)
            overdue(self, time.monotonic())
        if not any(w.state == "done" for w in self.workers):
            raise AsyncDiLoCoError(f"no worker of the fleet finished: {self._fates()}; see {self.out}/worker-*.log")

    def _fates(self) -> str:
        return "; ".join(
            f"{w.name}: {w.state} ({', '.join(w.causes) or 'exit ' + str(w.exit_code)})" for w in self.workers
        )

    def _collect(self, ref: Any) -> None:
        """A run call that returned: the worker is done, failed, or restarted."""
        run = self.runs.pop(ref)
        self.ready.pop(run.ready, None)
        w = run.worker
        self.last_end = time.monotonic()
        try:
            result = self.ray.get(ref)
        except self.ray.exceptions.RayError as exc:
            salvage(self, w)  # its log up to its death, where its state folder is on this machine
            self._restart(w, f"actor died ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})")
            return
        w.keep(self.out, result)
        self.kill_actor(w.name)  # its run is over: its CPUs and GPUs go back to Ray at once
        code = result["exit_code"]
        if code == 0:
            w.state = "done"
            log.info("fleet %s: worker %s finished on %s", self.run_id, w.name, w.node_ip)
        elif code == 2:
            w.state = "failed"
            w.causes.append("exit status 2: a flag or setting was refused (not restarted)")
            log.error(
                "fleet %s: worker %s refused its settings (exit status 2); see %s/%s.log",
                self.run_id,
                w.name,
                self.out,
                w.stem,
            )
        else:
            self._restart(w, f"exit status {code}")

    def _restart(self, w: FleetWorker, cause: str) -> None:
        """Start ``w`` again in a new actor, if it has restarts and training time left."""
        w.causes.append(cause)
        self.kill_actor(w.name)
        left = None
        if self.spec.max_seconds is not None:
            left = self.spec.max_seconds - (time.monotonic() - self.first_start[w.name])
        if w.restarts >= self.spec.max_restarts:
            w.state = "failed"
            log.error(
                "fleet %s: worker %s: %s; out of restarts (%d), reported failed", self.run_id, w.name, cause, w.restarts
            )
            return
        if left is not None and left < MIN_RESTART_S:
            w.state = "done"
            log.warning(
                "fleet %s: worker %s: %s with %.1f s of its budget left; not restarted",
                self.run_id,
                w.name,
                cause,
                left,
            )
            return
        w.restarts += 1
        log.warning(
            "fleet %s: worker %s: %s; restart %d of %d", self.run_id, w.name, cause, w.restarts, self.spec.max_restarts
        )
        self._start_worker(w, left)

    def kill_actor(self, name: str) -> None:
        """``ray.kill`` worker ``name``'s actor, if it has one (its resources go back to Ray)."""
        actor = self.actors.pop(name, None)
        if actor is not None:
            self.ray.kill(actor, no_restart=True)  # a dead one: nothing; an unreachable one: ended

    # ------------------------------------------------------------------ end
    def finish(self) -> FleetReport:
        """Stop the server after the final status and evaluation; write the report."""
        from asyncdiloco.fleet.report import ReportSettings, print_summary, write

        assert self.watcher is not None
        outcome = self.watcher.outcome(self.workers)
        log_text = self.get_within(self.server.stop.remote(), 60.0, "the server's actor to stop")
        (self.out / "server.log").write_text(log_text)
        args = tuple(a for g in self.spec.groups for a in g.worker_args)
        settings = ReportSettings(self.spec.server.mode, args, self.spec.job, self.spec.max_seconds)
        result = write(settings, self.out, outcome, self._fleet_fields())
        print_summary(result)
        return result

    def _fleet_fields(self) -> dict:
        return {
            "run_id": self.run_id,
            "ray_address": self.ray_address,
            "max_restarts": self.spec.max_restarts,
            "max_steps": self.spec.max_steps,
            "groups": [dataclasses.asdict(g) for g in self.spec.groups],
        }

    def close(self) -> None:
        """End every actor still there (a launch that failed or was interrupted), the
        driver's client, and this machine's temporary folders of the fleet (the default
        state folders, the server's log folder): the next launch has a new run id, so
        nothing would resume from them."""
        if self.watcher is not None:
            self.watcher.close()
        for name in list(self.actors):
            self.kill_actor(name)
        if self.server is not None:
            self.ray.kill(self.server, no_restart=True)
            self.server = None
        if not self.spec.state_root:
            shutil.rmtree(self.state_root, ignore_errors=True)  # this node's part of the default folder
        if self.where.get("log_path"):
            shutil.rmtree(pathlib.Path(self.where["log_path"]).parent, ignore_errors=True)
