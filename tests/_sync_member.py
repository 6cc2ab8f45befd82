"""A sync member in its own process: ``python _sync_member.py ADDRESS INDEX STEPS [EXTRA_FLOATS]``.

Trains a small linear regression as a SyncDiLoCoWorker for STEPS inner steps and prints
its ``stats.rounds`` as one JSON line. With EXTRA_FLOATS > 0 its allreduce buffer is that
many floats longer than the protocol's ``[w·Δ, w]`` (a member built with another buffer
layout, e.g. another asyncdiloco version): its peers must fail the round, not abort.
"""

from __future__ import annotations

import json
import sys

import torch
from torch import nn

from asyncdiloco.worker.config import SyncWorkerConfig, WorkerConfig
from asyncdiloco.worker.sync_worker import SyncDiLoCoWorker


class LongerBufferSyncWorker(SyncDiLoCoWorker):
    """A sync worker whose allreduce buffer holds ``extra`` floats more than its peers'."""

    def __init__(self, *args, extra: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._buf = self.flat.host_buffer(self._numel + 1 + extra)


def main() -> None:
    address, index, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    extra = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    cfg = WorkerConfig(server=address, worker_name=f"member-{index}", heartbeat_s=0.5)
    sync = SyncWorkerConfig(allreduce_timeout_s=5.0, quorum_timeout_s=30.0)
    cls, kwargs = (LongerBufferSyncWorker, {"extra": extra}) if extra else (SyncDiLoCoWorker, {})
    gen = torch.Generator().manual_seed(index)
    w_true = torch.arange(8.0).unsqueeze(0)
    with cls(model, opt, cfg, sync=sync, **kwargs) as worker:
        for _ in range(steps):
            x = torch.randn(16, 8, generator=gen)
            nn.functional.mse_loss(model(x), x @ w_true.T).backward()
            opt.step()
            opt.zero_grad()
        print(json.dumps(worker.stats.rounds), flush=True)


if __name__ == "__main__":
    main()
