"""``asyncdiloco launch``: the flags of a fleet on Ray (fleet/launch.py runs it; needs the
``ray`` extra), the server's run flags (flags.SERVER_RUN) and the model flags (flags.JOB),
all checked before Ray starts (docs/operations.md "A fleet on Ray").
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import signal
from typing import TYPE_CHECKING

from asyncdiloco.errors import ConfigError
from asyncdiloco.flags.settings import JOB, SERVER_RUN

if TYPE_CHECKING:
    from asyncdiloco.fleet.spec import FleetSpec

#: ``--max-restarts``' default: restarts per worker before it is reported failed.
MAX_RESTARTS = 3


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "launch",
        help="a server and N workers as Ray actors (a local Ray, or a cluster), with a report",
        description="A parameter server and groups of workers as Ray actors, each worker with its own resource "
        "request; dead workers are restarted and resume as themselves; the demo's report is written to --out. "
        "Needs Ray: pip install 'asyncdiloco[ray]'.",
    )
    g = p.add_argument_group("the fleet")
    g.add_argument(
        "--address",
        default=None,
        metavar="HEAD:PORT",
        help="the Ray cluster to run on (ray start --head ...), or auto (default: a new Ray of this machine alone, "
        "on 127.0.0.1)",
    )
    g.add_argument("--workers", type=int, default=3, help="CPU workers of 1 core each, without --group (default 3)")
    g.add_argument(
        "--group",
        action="append",
        default=[],
        metavar="NAME:COUNT:CPUS:GPUS[:SLOWDOWN]",
        help="a group of COUNT workers, each reserving CPUS cores and GPUS GPUs (cuda when GPUS > 0), SLOWDOWN "
        "times slower; repeat for more groups, e.g. --group big:4:8:8 --group small:8:2:2 (default: --workers)",
    )
    _add_bounds_args(g)
    g.add_argument(
        "--token-file",
        default=None,
        help="the shared token (first line) for the server and every worker (default: a fresh random one)",
    )
    g.add_argument(
        "--insecure-trusted-network",
        action="store_true",
        help="the cluster's network is trusted end to end: send the fleet's token over plaintext to a server "
        "beyond the loopback (the fleet has no TLS yet; without it a fleet with --address is refused)",
    )
    g.add_argument("--out", default="fleet-out", help="folder for report.json, plot and logs (default %(default)s)")
    _add_placement_args(g)
    SERVER_RUN.add_to(p)
    JOB.add_to(p)
    p.set_defaults(func=run)


def _add_bounds_args(g: argparse._ArgumentGroup) -> None:
    """How long each worker trains and how often it is restarted."""
    g.add_argument(
        "--max-restarts",
        type=int,
        default=MAX_RESTARTS,
        help="restarts per worker after its actor died or its process failed; then it is reported failed and "
        "the fleet goes on (default %(default)s)",
    )
    g.add_argument("--max-seconds", type=float, default=120.0, help="training seconds per worker (default %(default)g)")
    g.add_argument(
        "--max-steps", type=int, default=None, help="inner steps per worker, restarts counted in (default: no bound)"
    )


def _add_placement_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--server-host",
        default=None,
        help="interface the server binds on its node (default: 127.0.0.1 on a local Ray, 0.0.0.0 with --address)",
    )
    g.add_argument("--server-port", type=int, default=0, help="the server's port; 0 = a free one (default 0)")
    g.add_argument(
        "--metrics-port", type=int, default=None, help="serve the dashboard and /metrics here (default: off)"
    )
    g.add_argument("--server-cpus", type=float, default=1.0, help="cores Ray reserves for the server (default 1)")
    g.add_argument(
        "--local-cpus",
        type=float,
        default=None,
        help="cores of the local Ray (default: the machine's; not with --address)",
    )
    g.add_argument(
        "--state-root",
        default="",
        metavar="DIR",
        help="folder on each node for the workers' state folders; a shared filesystem lets a worker restarted on "
        "another node resume (default: a new folder in the node's temp dir)",
    )
    g.add_argument(
        "--worker-args",
        default="",
        metavar="'FLAGS'",
        help="more asyncdiloco worker flags for every worker, one quoted string, e.g. '--overlap' (default: none)",
    )
    g.add_argument(
        "--eval-every",
        type=float,
        default=5.0,
        help="seconds between held-out evaluations of the global model (default %(default)g)",
    )


def spec(args: argparse.Namespace) -> FleetSpec:
    """The ``FleetSpec`` of the parsed flags; every refusal happens here, before Ray starts.

    Raises:
        ConfigError: a flag's value is invalid.
    """
    from asyncdiloco.fleet.spec import FleetSpec, WorkerGroup
    from asyncdiloco.wire.security import read_token

    extra = tuple(shlex.split(args.worker_args))
    if args.group:
        groups = [WorkerGroup.parse(text) for text in args.group]
    else:
        groups = [WorkerGroup(name="cpu", count=args.workers)]
    groups = [dataclasses.replace(g, worker_args=extra) for g in groups]
    host = args.server_host or ("0.0.0.0" if args.address else "127.0.0.1")
    server = SERVER_RUN.build(SERVER_RUN.given(args), host=host, port=args.server_port, metrics_port=args.metrics_port)
    if server.mode == "sync" and "--overlap" in extra:
        raise ConfigError("--worker-args '--overlap' is invalid with --mode sync: a sync round is a barrier")
    return FleetSpec(
        server=server,
        server_num_cpus=args.server_cpus,
        groups=tuple(groups),
        job=JOB.build(JOB.given(args)),
        max_seconds=args.max_seconds,
        max_steps=args.max_steps,
        max_restarts=args.max_restarts,
        token=read_token(args.token_file) if args.token_file else None,
        state_root=args.state_root,
        out_dir=args.out,
        eval_every_s=args.eval_every,
        insecure_trusted_network=args.insecure_trusted_network,
    )


def run(args: argparse.Namespace) -> int:
    from asyncdiloco.fleet import launch

    fleet = spec(args)
    if args.local_cpus is not None and args.address:
        raise ConfigError(f"--local-cpus is invalid with --address {args.address}: drop one of them")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM ends the actors like Ctrl-C
    result = launch(fleet, address=args.address, local_cpus=args.local_cpus)
    print(f"asyncdiloco launch: report at {result.report_path}", flush=True)
    report = result.report
    finished = not result.failed and not result.stopped
    return 0 if finished and report["final_eval_loss"] < report["initial_eval_loss"] else 1
