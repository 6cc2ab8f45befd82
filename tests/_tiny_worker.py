"""A small worker process for the fault tests: ``python _tiny_worker.py ADDRESS INDEX STEPS``.

Trains a linear regression as an AsyncDiLoCoWorker; prints "joined" once it holds the
global model and "done" when it finished its steps.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from asyncdiloco import AsyncDiLoCoWorker, WorkerConfig


def main() -> None:
    address, index, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(index)
    w_true = torch.arange(8.0).unsqueeze(0)
    cfg = WorkerConfig(server=address, worker_name=f"tiny-{index}", heartbeat_s=0.2, rpc_timeout_s=5)
    with AsyncDiLoCoWorker(model, opt, cfg, tokens_per_step=16):
        print("joined", flush=True)
        for _ in range(steps):
            x = torch.randn(16, 8, generator=gen)
            nn.functional.mse_loss(model(x), x @ w_true.T).backward()
            opt.step()
            opt.zero_grad()
    print("done", flush=True)


if __name__ == "__main__":
    main()
