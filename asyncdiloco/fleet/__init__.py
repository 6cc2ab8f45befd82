"""A fleet on Ray: the parameter server and groups of workers as Ray actors with their own
resource requests, restarted when they die, and the demo's report at the end
(``launch(FleetSpec(...))``, ``asyncdiloco launch``; docs/operations.md "A fleet on Ray").
Ray is imported only when a fleet is launched; without it ``launch`` raises
``ConfigError`` naming ``pip install 'asyncdiloco[ray]'``.
"""

from __future__ import annotations

from asyncdiloco.fleet.launch import Fleet, launch
from asyncdiloco.fleet.report import FleetReport
from asyncdiloco.fleet.spec import FleetSpec, WorkerGroup

__all__ = ["Fleet", "FleetReport", "FleetSpec", "WorkerGroup", "launch"]
