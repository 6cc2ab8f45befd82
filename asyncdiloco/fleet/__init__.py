"""A fleet on Ray: the parameter server and groups of workers as Ray actors with their
own resource requests, restarted when they die, and the demo's report at the end
(``asyncdiloco launch``; docs/operations.md "A fleet on Ray").

Ray is imported only when a fleet is launched: this package imports without it, and
``launch`` without it raises ``ConfigError`` naming ``pip install 'asyncdiloco[ray]'``.

    from asyncdiloco.fleet import FleetSpec, WorkerGroup, launch
    spec = FleetSpec(groups=(WorkerGroup(name="big", count=4, num_cpus=8, num_gpus=8),
                             WorkerGroup(name="small", count=8, num_cpus=2, num_gpus=2)),
                     server=ServerConfig(host="0.0.0.0", port=29500), max_seconds=3600)
    report = launch(spec, address="HEAD:6379")   # report.report_path: report.json
"""

from __future__ import annotations

from asyncdiloco.fleet.launch import Fleet, launch
from asyncdiloco.fleet.report import FleetReport
from asyncdiloco.fleet.spec import FleetSpec, WorkerGroup

__all__ = ["Fleet", "FleetReport", "FleetSpec", "WorkerGroup", "launch"]
