"""What a fleet is: the parameter server's settings and the groups of workers, each
worker a Ray actor with its own resource request (``WorkerGroup``), and the run's bounds
(``FleetSpec``). Plain dataclasses, checked on construction; Ray is not needed to build
or check them.
"""

from __future__ import annotations

import dataclasses
import math
import re

from asyncdiloco.errors import ConfigError
from asyncdiloco.job.config import JobConfig
from asyncdiloco.ps.config import ServerConfig
from asyncdiloco.wire.security import TRUSTED_NETWORK_FLAG, is_loopback_host

#: A group's name: it starts the worker names (``<group>-<i>``), which name state folders.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,31}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkerGroup:
    """``count`` workers with the same resource request and speed.

    Worker i of group g is named ``g-i`` on the server (``--worker-name``) and keeps its
    state in its own folder (``--state-dir``), so a restarted actor resumes as itself.
    """

    #: Group name, e.g. "big" (letters, digits, ``_.-``; at most 32 characters).
    name: str = "cpu"
    #: Workers in the group (≥ 1).
    count: int = 1
    #: CPU cores Ray reserves per worker (fractions share a core; ≥ 0).
    num_cpus: float = 1.0
    #: GPUs Ray reserves per worker (Ray sets CUDA_VISIBLE_DEVICES to them; ≥ 0).
    num_gpus: float = 0.0
    #: Custom Ray resources per worker, e.g. {"node:big": 1} (name → amount).
    resources: dict[str, float] = dataclasses.field(default_factory=dict)
    #: ``--device`` of the workers; "" = cuda when the group reserves GPUs, else cpu.
    device: str = ""
    #: F ≥ 1: the workers run F times slower (``--slowdown``, emulates weaker machines).
    slowdown: float = 1.0
    #: Extra ``asyncdiloco worker`` flags for every worker of the group, e.g. ("--overlap",).
    worker_args: tuple[str, ...] = ()
    #: Processes per worker: 1 runs ``asyncdiloco worker`` in the actor; N > 1 runs it
    #: under ``torchrun --standalone --nproc-per-node N``, one worker of N ranks training
    #: with DDP (docs/operations.md "A torchrun group as one worker"); 0 (default): one
    #: rank per whole GPU when the worker reserves 2 or more, else 1 (``ranks``).
    nproc_per_worker: int = 0

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise ConfigError(
                f"worker group name {self.name!r} is invalid: use 1-32 letters, digits, '_', '.' or '-', "
                f"starting with a letter or digit (it starts the worker names and their state folders)"
            )
        if self.count < 1:
            raise ConfigError(f"worker group {self.name!r}: count={self.count} is invalid: give 1 or more workers")
        for what, value in (("num_cpus", self.num_cpus), ("num_gpus", self.num_gpus), *self.resources.items()):
            if not 0 <= value < math.inf:
                raise ConfigError(f"worker group {self.name!r}: {what}={value} is invalid: give an amount >= 0")
        if not self.slowdown >= 1:
            raise ConfigError(f"worker group {self.name!r}: slowdown={self.slowdown} is invalid: must be >= 1")
        if self.nproc_per_worker < 0:
            raise ConfigError(
                f"worker group {self.name!r}: nproc_per_worker={self.nproc_per_worker} is invalid: give 1 or more "
                f"processes, or 0 for one per reserved GPU"
            )

    @property
    def ranks(self) -> int:
        """Processes of each worker: ``nproc_per_worker``, or by default one per whole GPU
        the worker reserves when that is 2 or more (an 8-GPU worker is a torchrun group of
        8 ranks), else 1."""
        if self.nproc_per_worker:
            return self.nproc_per_worker
        return int(self.num_gpus) if self.num_gpus >= 2 else 1

    @property
    def worker_device(self) -> str:
        """The ``--device`` the group's workers run with."""
        return self.device or ("cuda" if self.num_gpus > 0 else "cpu")

    def worker_names(self) -> list[str]:
        return [f"{self.name}-{i}" for i in range(self.count)]

    @classmethod
    def parse(cls, text: str) -> WorkerGroup:
        """A group from ``NAME:COUNT:CPUS:GPUS[:SLOWDOWN]`` (``asyncdiloco launch --group``),
        e.g. ``big:4:8:8`` (4 workers of 8 CPUs and 8 GPUs each) or ``cpu:3:0.5:0:2``.

        Raises:
            ConfigError: not of that form, or a value out of range.
        """
        parts = text.split(":")
        if len(parts) not in (4, 5):
            raise ConfigError(
                f"--group {text!r} is invalid: give NAME:COUNT:CPUS:GPUS[:SLOWDOWN], e.g. big:4:8:8 or cpu:3:1:0:2"
            )
        try:
            count, cpus, gpus = int(parts[1]), float(parts[2]), float(parts[3])
            slowdown = float(parts[4]) if len(parts) == 5 else 1.0
        except ValueError:
            raise ConfigError(
                f"--group {text!r} is invalid: COUNT is a whole number, CPUS, GPUS and SLOWDOWN are numbers "
                f"(e.g. big:4:8:8 or cpu:3:0.5:0:2)"
            ) from None
        return cls(name=parts[0], count=count, num_cpus=cpus, num_gpus=gpus, slowdown=slowdown)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FleetSpec:
    """A parameter server and groups of workers on a Ray cluster (``launch``).

    The server runs the default job's configuration from ``server`` (its host and port
    are where it listens on its node; ``port=0`` picks a free one); every worker trains
    ``job``. Token and TLS files of ``server.security`` are not used: the fleet's token
    is ``token`` (TLS through the fleet is not supported yet), so a server host beyond
    the loopback (a fleet of several nodes) needs ``insecure_trusted_network``.
    """

    #: The parameter server's settings (mode, H, outer optimizer, host, port, metrics port).
    server: ServerConfig = dataclasses.field(default_factory=lambda: ServerConfig(host="127.0.0.1", port=0))
    #: Ray resources of the server's actor.
    server_num_cpus: float = 1.0
    server_resources: dict[str, float] = dataclasses.field(default_factory=dict)
    groups: tuple[WorkerGroup, ...] = (WorkerGroup(count=3),)
    #: The default job every worker trains (model, data, inner optimizer).
    job: JobConfig = dataclasses.field(default_factory=JobConfig)
    #: Seconds each worker trains (a restarted worker trains what is left of them); None: no bound.
    max_seconds: float | None = 120.0
    #: Inner steps each worker trains, its runs before a restart counted in; None: no bound.
    max_steps: int | None = None
    #: Restarts per worker after its actor died (or its process failed); then it is reported failed.
    max_restarts: int = 3
    #: The shared token every call to the server carries; None: a fresh random one per launch.
    token: str | None = None
    #: The cluster's network is trusted end to end: the fleet's token may travel over
    #: plaintext to a server host beyond the loopback (the fleet has no TLS yet). False:
    #: such a fleet is refused (wire/security.py, "A token goes over TLS").
    insecure_trusted_network: bool = False
    #: Folder on each worker's node for the workers' state folders (``<state_root>/<name>``);
    #: "" = ``<temp dir>/asyncdiloco-fleet-<run id>``. Give a shared filesystem for restarts on other nodes.
    state_root: str = ""
    #: Folder (on the driver) for report.json, loss_curve.png, the workers' logs and stats.
    out_dir: str = "fleet-out"
    #: Seconds between held-out evaluations of the global model (the report's loss curve).
    eval_every_s: float = 5.0
    #: Seconds between two of the driver's progress lines (log INFO).
    progress_every_s: float = 10.0
    #: Seconds the server's actor may take to start and listen (Ray may first have to start a process).
    startup_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if not self.groups:
            raise ConfigError("a fleet needs at least one worker group; give --workers N or --group NAME:COUNT:...")
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise ConfigError(f"worker group names {names} repeat: give each group its own name")
        if self.max_seconds is None and self.max_steps is None:
            raise ConfigError("give max_seconds or max_steps (or both), or the workers would train forever")
        if self.max_seconds is not None and not 0 < self.max_seconds < math.inf:
            raise ConfigError(f"max_seconds={self.max_seconds} is invalid: give a positive number of seconds")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"max_steps={self.max_steps} is invalid: give 1 or more inner steps")
        if self.max_restarts < 0:
            raise ConfigError(f"max_restarts={self.max_restarts} is invalid: give 0 (never restart) or more")
        if self.token is not None and (not self.token.strip() or "\n" in self.token):
            raise ConfigError(
                "the fleet's token is empty or spans lines: give one line of text, or None for a fresh one"
            )
        if not self.insecure_trusted_network and not is_loopback_host(self.server.host):
            raise ConfigError(
                f"a fleet's server on {self.server.host} (not a loopback address) would take the fleet's token over "
                f"plaintext: the fleet has no TLS yet. On a cluster network you trust end to end add "
                f"{TRUSTED_NETWORK_FLAG}; otherwise run the fleet on one machine (no --address, or --server-host "
                f"127.0.0.1)"
            )
        if not self.eval_every_s > 0 or not self.progress_every_s > 0:
            raise ConfigError(
                f"eval_every_s={self.eval_every_s}, progress_every_s={self.progress_every_s} are invalid: "
                f"give seconds > 0"
            )

    @property
    def num_workers(self) -> int:
        return sum(g.count for g in self.groups)
