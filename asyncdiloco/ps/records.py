"""What the parameter server remembers per push and per worker (plain records)."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

#: Outcomes remembered per worker for answering retried pushes.
PUSH_MEMORY = 256


@dataclasses.dataclass(frozen=True)
class PushOutcome:
    applied: bool
    duplicate: bool
    version: int
    staleness: int
    staleness_weight: float
    local_steps: int
    #: The push group whose release the reply waits for (0: none).
    group_id: int = 0


@dataclasses.dataclass
class WorkerRecord:
    worker_id: int
    name: str
    joined_at: float
    last_seen: float
    alive: bool = True
    applied_pushes: int = 0
    rejected_pushes: int = 0
    tokens: int = 0
    local_steps: int = 0
    #: Server clock of the last applied pseudo-gradient (0: none yet; grouping expects a
    #: worker that pushed within about two of its rounds, or joined since).
    last_push: float = 0.0
    outcomes: OrderedDict[int, PushOutcome] = dataclasses.field(default_factory=OrderedDict)
