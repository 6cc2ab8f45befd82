"""A small worker process for the fault tests: ``python _tiny_worker.py ADDRESS INDEX STEPS [--dataloader]``.

Trains a linear regression as an AsyncDiLoCoWorker; prints "joined" once it holds the
global model and "done" when it finished its steps. With ``--dataloader`` the batches
come from a torch DataLoader with num_workers=2, which forks two loader processes per
epoch while the worker's gRPC channel and heartbeat thread are live.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from asyncdiloco import AsyncDiLoCoWorker, WorkerConfig


def main() -> None:
    address, index, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    use_loader = "--dataloader" in sys.argv
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(index)
    w_true = torch.arange(8.0).unsqueeze(0)
    cfg = WorkerConfig(server=address, worker_name=f"tiny-{index}", heartbeat_s=0.2, rpc_timeout_s=5)
    with AsyncDiLoCoWorker(model, opt, cfg, tokens_per_step=16) as worker:
        print("joined", flush=True)
        if use_loader:
            xs = torch.randn(16 * 8, 8, generator=gen)
            data = torch.utils.data.TensorDataset(xs, xs @ w_true.T)
            loader = torch.utils.data.DataLoader(data, batch_size=16, num_workers=2, shuffle=True)
            batches = (batch for _ in range(-(-steps // len(loader))) for batch in loader)  # a new fork per epoch
        else:
            batches = ((x, x @ w_true.T) for x in (torch.randn(16, 8, generator=gen) for _ in range(steps)))
        for _, (x, y) in zip(range(steps), batches):
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        print(
            f"done: {worker.stats.pushes_applied} pushes applied, {worker.stats.sync_failures} failed syncs", flush=True
        )


if __name__ == "__main__":
    main()
