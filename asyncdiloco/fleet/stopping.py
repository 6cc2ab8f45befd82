"""How a fleet's runs end when they do not end by themselves: a worker past its budget
(stopped, then killed), an actor Ray never places (killed), and Ctrl-C (every worker
stopped, its log kept where its state folder is on this machine). Kills are
``ray.kill``: a remote call never runs on an actor Ray has not placed (docs/operations.md
"A fleet on Ray").
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import shutil
import time
from typing import Any, Protocol

from asyncdiloco.errors import AsyncDiLoCoError
from asyncdiloco.fleet.report import FleetWorker

log = logging.getLogger(__name__)

#: Seconds a worker gets past its budget (start-up, the last push) before it is stopped
#: (SIGTERM); an actor Ray has not placed while nothing of the fleet runs: killed after as long.
OVERDUE_S = 120.0
#: Seconds a stopped worker gets for its last push and Leave before its actor is killed.
STOP_GRACE_S = 15.0
#: Seconds Ctrl-C waits for the workers' last runs and for the server's log.
INTERRUPT_GRACE_S = 10.0


@dataclasses.dataclass
class WorkerRun:
    """One run call of a worker's actor, as the driver watches it."""

    worker: FleetWorker
    actor: Any
    #: ObjectRef of ``actor.pid``: ready once Ray placed the actor and it started.
    ready: Any
    #: Training seconds the run was given (None: no bound).
    budget_s: float | None
    requested_at: float
    placed_at: float | None = None
    stop_sent_at: float | None = None


class Driver(Protocol):
    """What of the driver (launch.py ``Fleet``) the functions here read and change."""

    ray: Any
    run_id: str
    out: pathlib.Path
    state_root: str
    runs: dict[Any, WorkerRun]
    ready: dict[Any, WorkerRun]
    last_end: float
    server: Any
    where: dict

    def kill_actor(self, name: str) -> None: ...

    def get_within(self, ref: Any, timeout_s: float, what: str) -> Any: ...


def overdue(fleet: Driver, now: float) -> None:
    """Stop the runs past their deadline. A placed worker's deadline is its budget plus
    ``OVERDUE_S`` from when Ray placed it: then SIGTERM (its last push and Leave), and
    ``STOP_GRACE_S`` later its actor is killed. An actor Ray never placed, while no
    placed run of the fleet is left to free resources, is killed ``OVERDUE_S`` after it
    was requested or the fleet's last run ended. A killed run is reported ``stopped``."""
    placed = any(r.placed_at is not None for r in fleet.runs.values())
    for ref, run in list(fleet.runs.items()):
        w = run.worker
        if run.placed_at is None:
            waited = now - max(run.requested_at, fleet.last_end)
            if not placed and waited > OVERDUE_S:
                kill_run(fleet, ref, f"Ray never placed its actor ({w.resources}); killed after {waited:.0f} s")
        elif run.stop_sent_at is not None:
            if now - run.stop_sent_at > STOP_GRACE_S:
                kill_run(fleet, ref, f"still running {STOP_GRACE_S:g} s after SIGTERM past its budget; killed")
        elif run.budget_s is not None and now > run.placed_at + run.budget_s + OVERDUE_S:
            log.warning(
                "fleet %s: worker %s still running %g s past its budget of %.0f s; stopping it",
                fleet.run_id,
                w.name,
                OVERDUE_S,
                run.budget_s,
            )
            run.actor.stop.remote()
            run.stop_sent_at = now


def kill_run(fleet: Driver, ref: Any, cause: str) -> None:
    """End a run for good: its actor killed, the worker ``stopped`` with ``cause``."""
    run = fleet.runs.pop(ref)
    fleet.ready.pop(run.ready, None)
    w = run.worker
    w.state = "stopped"
    w.causes.append(cause)
    log.error("fleet %s: worker %s: %s", fleet.run_id, w.name, cause)
    fleet.kill_actor(w.name)
    salvage(fleet, w)
    fleet.last_end = time.monotonic()


def salvage(fleet: Driver, w: FleetWorker) -> None:
    """The worker's log and stats file from its state folder, where that is on this
    machine (a local Ray, or the driver's node), for a run whose result never came (no
    stats file there: none in the output folder, and the server counts the worker)."""
    folder = pathlib.Path(fleet.state_root) / w.name
    log_file, stats = folder / "worker.log", folder / "stats.json"
    if log_file.is_file():
        shutil.copyfile(log_file, fleet.out / f"{w.stem}.log")
    if stats.is_file():  # the actor removes it as a run starts: this one is the last run's
        shutil.copyfile(stats, fleet.out / f"{w.stem}.json")
    else:
        (fleet.out / f"{w.stem}.json").unlink(missing_ok=True)


def interrupted(fleet: Driver) -> None:
    """Ctrl-C: SIGTERM every worker, keep what their runs return within
    ``INTERRUPT_GRACE_S``, kill the rest (``stopped``, their logs from their state
    folders where those are on this machine) and keep the server's log (bounded waits)."""
    log.warning("interrupted: stopping the fleet")
    fleet.out.mkdir(parents=True, exist_ok=True)
    for run in fleet.runs.values():
        run.actor.stop.remote()
    done = []
    if fleet.runs:
        done, _ = fleet.ray.wait(list(fleet.runs), num_returns=len(fleet.runs), timeout=INTERRUPT_GRACE_S)
    for ref in done:
        run = fleet.runs.pop(ref)
        try:
            run.worker.keep(fleet.out, fleet.ray.get(ref, timeout=1.0))
            run.worker.state = "stopped"
            run.worker.causes.append("interrupted; stopped")
        except fleet.ray.exceptions.RayError:
            fleet.runs[ref] = run  # its actor died (Ctrl-C reaches Ray's processes too): as below
    for ref in list(fleet.runs):
        kill_run(fleet, ref, "interrupted; killed")
    if fleet.server is not None:
        keep_server_log(fleet, INTERRUPT_GRACE_S)


def keep_server_log(fleet: Driver, timeout_s: float) -> None:
    """server.log in the output folder: from the server's actor as it stops, or, when
    that fails, from its file where that is on this machine."""
    try:
        text = fleet.get_within(fleet.server.stop.remote(), timeout_s, "the server's actor to stop")
    except AsyncDiLoCoError as exc:
        path = pathlib.Path(fleet.where.get("log_path", ""))
        if not path.is_file():
            log.warning("fleet %s: the server's log is lost: %s", fleet.run_id, exc)
            return
        text = path.read_text(errors="replace")
    (fleet.out / "server.log").write_text(text)
