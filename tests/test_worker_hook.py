"""The inner-step hook is installed at join, when H is known: a worker used without
``with`` (``join()`` called explicitly, or not at all: it joins before its first inner
step) syncs after H inner steps, never at step 1 with a push the server refuses."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from asyncdiloco.algo.config import OuterConfig
from asyncdiloco.ps.config import SyncConfig
from asyncdiloco.worker.async_worker import AsyncDiLoCoWorker
from asyncdiloco.worker.config import SyncWorkerConfig, WorkerConfig
from asyncdiloco.worker.sync_worker import SyncDiLoCoWorker

pytestmark = pytest.mark.timeout(60)

H = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 1)


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.ones(8, 4)
    ((model(x) - 1.0) ** 2).mean().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("explicit_join", [True, False], ids=["join-called", "join-on-first-step"])
def test_an_async_worker_without_with_pushes_after_h_steps(start_server, explicit_join):
    srv = start_server(local_steps=H)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    worker = AsyncDiLoCoWorker(model, opt, WorkerConfig(server=srv.address, push_on_close=False))
    try:
        if explicit_join:
            worker.join()
        for _ in range(H - 1):
            _step(model, opt)
        status = srv.state.status()
        assert status.applied_pushes == 0  # (the initial parameters are not counted)
        assert status.rejected_pushes == 0
        _step(model, opt)
        status = srv.state.status()
        assert status.rejected_pushes == 0 and worker.stats.sync_failures == 0
        assert status.applied_pushes == 1  # one pseudo-gradient, of H steps
        (record,) = status.workers
        assert record.applied_pushes == 1 and record.local_steps == H
        assert worker.stats.pushes_applied == 1 and worker.stats.inner_steps == H
    finally:
        worker.close()


def test_a_sync_worker_without_with_joins_on_its_first_step_and_rounds_every_h_steps(start_server):
    srv = start_server(
        port=0,
        mode="sync",
        local_steps=H,
        lease_s=30.0,
        outer=OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0),
        sync=SyncConfig(min_workers=1, join_timeout_s=1.0, round_timeout_s=20.0),
    )
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    worker = SyncDiLoCoWorker(model, opt, WorkerConfig(server=srv.address), sync=SyncWorkerConfig(quorum_timeout_s=5.0))
    try:
        for _ in range(H - 1):
            _step(model, opt)
        assert worker.stats.rounds == [] and srv.state.status().rounds_committed == 0
        _step(model, opt)
        assert [r["committed"] for r in worker.stats.rounds] == [True]
        assert srv.state.status().rounds_committed == 1 and worker.round == 1
    finally:
        worker.close()
