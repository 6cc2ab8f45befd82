"""The fleet's report: the demo's report.json (bench/demo_report.py) written from what the
driver collected, plus each worker's group, resources, node, restarts and fate, and the
Ray address. A worker killed before it wrote its stats file is counted by the server alone
(``fleet.counted_by``: "server", else "worker"); docs/operations.md "A fleet on Ray".
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

from asyncdiloco.bench import demo_report
from asyncdiloco.bench.demo import Outcome
from asyncdiloco.job.config import JobConfig
from asyncdiloco.job.dataset import CharCorpus
from asyncdiloco.wire._proto import parameter_server_pb2 as pb

TITLE = "asyncdiloco fleet"


@dataclasses.dataclass
class FleetWorker:
    """The driver's record of one worker (``demo_report.ReportedWorker``)."""

    name: str
    group: str
    #: Across the fleet: the worker's ``--worker-index`` (its data order).
    index: int
    speed_factor: float
    resources: dict
    #: "starting", "running", "done" (exited 0), "failed" (out of restarts, or a bad flag),
    #: "stopped" (killed past its deadline, never placed by Ray, or interrupted).
    state: str = "starting"
    restarts: int = 0
    #: Why each restart happened, oldest first.
    causes: list[str] = dataclasses.field(default_factory=list)
    exit_code: int | None = None
    node_ip: str = ""
    #: The demo's fields, which a fleet's worker never uses (no leave/rejoin drill).
    rejoin: bool = False
    left_s: float | None = None
    join_at_s: float | None = None

    @property
    def stem(self) -> str:
        return f"worker-{self.name}"

    def keep(self, out: pathlib.Path, result: dict) -> None:
        """Write a run's stats file and log (``WorkerActor.run``'s result) to ``out``; a run
        without one removes an earlier run's stats file (the server then counts the worker)."""
        if result.get("stats") is not None:
            (out / f"{self.stem}.json").write_text(json.dumps(result["stats"]))
        else:
            (out / f"{self.stem}.json").unlink(missing_ok=True)
        (out / f"{self.stem}.log").write_text(result.get("log", ""))
        self.exit_code, self.node_ip = result["exit_code"], result.get("node_ip", self.node_ip)


@dataclasses.dataclass(frozen=True)
class ReportSettings:
    """The fleet as the demo's report reads a run (``demo_report.ReportedRun``)."""

    mode: str
    worker_args: tuple[str, ...]
    job: JobConfig
    max_seconds: float | None
    leave_rejoin: tuple[int, float, float] | None = None


@dataclasses.dataclass(frozen=True)
class FleetReport:
    """What ``launch`` returns: the report (report.json's content) and where it lies."""

    report: dict
    out_dir: pathlib.Path

    @property
    def report_path(self) -> pathlib.Path:
        return self.out_dir / "report.json"

    @property
    def failed(self) -> list[str]:
        """Names of the workers the fleet gave up on."""
        return [w["name"] for w in self.report["workers"] if w["fleet"]["state"] == "failed"]

    @property
    def stopped(self) -> list[str]:
        """Names of the workers the fleet killed before they finished (stopping.py)."""
        return [w["name"] for w in self.report["workers"] if w["fleet"]["state"] == "stopped"]


def write(settings: ReportSettings, out: pathlib.Path, outcome: Outcome, fleet: dict) -> FleetReport:
    """report.json and loss_curve.png in ``out``; ``fleet`` is the report's "fleet" field
    (``ray_address``, ``max_restarts``, ``groups``), and each worker entry gets its own."""
    report = demo_report.report(settings, out, outcome)
    by_name = {w.name: w for w in outcome.workers if isinstance(w, FleetWorker)}
    steps = server_steps(outcome.status)
    for entry in report["workers"]:
        w = by_name[entry["name"]]
        counted_by = "worker" if (out / f"{w.stem}.json").exists() else "server"
        if counted_by == "server":
            entry["inner_steps"] = steps.get(w.name, 0)
        entry["fleet"] = {
            "counted_by": counted_by,
            "group": w.group,
            "resources": w.resources,
            "node_ip": w.node_ip,
            "state": w.state,
            "restarts": w.restarts,
            "restart_causes": w.causes,
        }
    report["fleet"] = fleet
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    vocab = CharCorpus.default().vocab_size
    demo_report.plot(outcome.curve, out / "loss_curve.png", vocab_size=vocab, mode=settings.mode, title=TITLE)
    return FleetReport(report, out)


def server_steps(status: pb.StatusReply) -> dict[str, int]:
    """Per worker name, the inner steps in its applied pushes (every session of the name)."""
    steps: dict[str, int] = {}
    for w in status.workers:
        steps[w.worker_name] = steps.get(w.worker_name, 0) + w.local_steps
    return steps


def print_summary(result: FleetReport) -> None:
    """The demo's summary, then the restarts, failures and stops."""
    demo_report.print_summary(result.report, result.out_dir, title=TITLE)
    workers = result.report["workers"]
    by_server = [w["name"] for w in workers if w["fleet"]["counted_by"] == "server"]
    if by_server:
        print(
            f"  {', '.join(by_server)}: no stats file (killed before writing one): steps, pushes and tokens "
            f"as the server counted them, in applied pushes",
            flush=True,
        )
    restarted = [f"{w['name']} x{w['fleet']['restarts']}" for w in workers if w["fleet"]["restarts"]]
    print(
        f"  restarts: {', '.join(restarted) or 'none'}; failed: {', '.join(result.failed) or 'none'}; "
        f"stopped: {', '.join(result.stopped) or 'none'}",
        flush=True,
    )
