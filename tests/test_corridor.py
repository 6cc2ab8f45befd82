"""How far one push travels: the stack frames between the inner optimizer's step hook and
the outer step, counted on a real in-process server and worker (docs/architecture.md,
"One push, frame by frame").

Worker side: the frames from the step hook (the first frame above ``torch.optim``'s step
wrapper) to the last frame before the transport (gRPC's channel or a socket send),
both ends included. Server side: the frames from the first ``asyncdiloco`` frame of the
handler thread to ``OuterOptimizer.step``, both included. Frames of other libraries in
between count too: a corridor is as long as its stack.
"""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch
from torch import nn

from asyncdiloco.algo import outer as outer_module
from asyncdiloco.worker.async_worker import AsyncDiLoCoWorker
from asyncdiloco.worker.config import WorkerConfig

pytestmark = pytest.mark.timeout(60)

#: The most frames one push may pass, worker and server together.
BUDGET = 17

_PACKAGE = os.path.dirname(os.path.dirname(outer_module.__file__))
_SENDS = {"sendall", "send", "sendmsg"}


def _ours(frame) -> bool:
    return frame.f_code.co_filename.startswith(_PACKAGE)


def _chain(frame) -> list:
    out = []
    while frame is not None:
        out.append(frame)
        frame = frame.f_back
    return out  # innermost first


def _worker_frames(caller) -> list[str]:
    """From ``caller`` (the frame that calls the transport) out to the step hook."""
    chain = _chain(caller)
    names = []
    for frame in chain:
        if "torch/optim" in frame.f_code.co_filename:
            return names
        names.append(f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}")
    raise AssertionError("the push was not sent from inside the inner optimizer's step")


def _server_frames(step_frame) -> list[str]:
    chain = _chain(step_frame)
    outermost = max(i for i, frame in enumerate(chain) if _ours(frame))
    return [f"{os.path.basename(f.f_code.co_filename)}:{f.f_code.co_name}" for f in chain[: outermost + 1]]


def test_one_push_passes_at_most_the_budget_of_frames(start_server):
    srv = start_server(local_steps=2)
    seen: dict[str, list[str]] = {}
    steppers = [c for c in vars(outer_module).values() if isinstance(c, type) and "step" in vars(c)]
    real_steps = {c: vars(c)["step"] for c in steppers}

    def counting(real):
        def counting_step(self, *args, **kwargs):
            if threading.current_thread() is not threading.main_thread() and "server" not in seen:
                seen["server"] = _server_frames(sys._getframe(0))
            return real(self, *args, **kwargs)

        return counting_step

    def profile(frame, event, arg):
        if "worker" in seen or frame.f_back is None or not _ours(frame.f_back):
            return
        transport = (event == "call" and f"{os.sep}grpc{os.sep}" in frame.f_code.co_filename) or (
            event == "c_call" and getattr(arg, "__name__", "") in _SENDS
        )
        if transport and "Push" in _rpc_of(frame, event):
            seen["worker"] = _worker_frames(frame.f_back if event == "call" else frame)

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for c in steppers:
        c.step = counting(real_steps[c])
    try:
        with AsyncDiLoCoWorker(model, opt, WorkerConfig(server=srv.address, push_on_close=False)):
            x = torch.ones(8, 4)
            for step in range(2):
                ((model(x) - 1.0) ** 2).mean().backward()
                if step == 1:
                    sys.setprofile(profile)
                try:
                    opt.step()
                finally:
                    sys.setprofile(None)
                opt.zero_grad()
    finally:
        for c in steppers:
            c.step = real_steps[c]
    assert "worker" in seen and "server" in seen, seen.keys()
    total = len(seen["worker"]) + len(seen["server"])
    report = "\n  ".join(["worker (innermost first):", *seen["worker"], "server:", *seen["server"]])
    assert total <= BUDGET, f"one push passes {total} frames, more than {BUDGET}:\n  {report}"


def _rpc_of(frame, event) -> str:
    """The RPC a gRPC call frame invokes ('' when it cannot tell), or 'Push' for a socket send."""
    if event == "c_call":
        return "Push"
    owner = frame.f_locals.get("self")
    method = getattr(owner, "_method", b"")
    return method.decode() if isinstance(method, bytes) else str(method)
