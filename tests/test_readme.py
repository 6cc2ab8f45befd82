"""The README's API example runs as written against an in-process server.

Only the names the README leaves to the user (``MyModel``, ``loader``, ``loss_fn``,
``tokens_per_batch``) and the server address are filled in; the block itself is executed
verbatim, so an example that drifts from the API fails here.
"""

from __future__ import annotations

import pathlib
import re

import torch
from torch import nn

from asyncdiloco.algo.config import OuterConfig
from asyncdiloco.ps.config import ServerConfig
from asyncdiloco.ps.server import ParameterServer

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
#: the address the README's example connects to
README_ADDRESS = "ps-host:29500"


def _python_block() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) == 1, f"README.md should hold exactly one python block (the API example), found {len(blocks)}"
    return blocks[0]


def test_the_readme_holds_the_two_commands_first():
    text = README.read_text()
    first = [line for line in text.splitlines() if line.startswith("bash scripts/setup.sh")]
    assert first[:2] == [
        "bash scripts/setup.sh && .venv/bin/asyncdiloco demo",
        'bash scripts/setup.sh && .venv/bin/python -m pytest -m "not heavy"',
    ]
    assert text.index(first[1]) < text.index("```python")


def test_the_readme_api_example_trains_against_a_server():
    code = _python_block()
    assert README_ADDRESS in code and "loss.backward()" in code and "inner_opt.step()" in code
    local_steps, batches = 2, 7
    srv = ParameterServer(
        ServerConfig(port=0, local_steps=local_steps, dylu=False, outer=OuterConfig(optimizer="sgd", lr=1.0))
    ).start()
    try:
        torch.manual_seed(0)
        data = [(torch.randn(8, 4), torch.randn(8, 2)) for _ in range(batches)]  # x (B, 4), y (B, 2)
        namespace = {
            "MyModel": lambda: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)),
            "loader": data,
            "loss_fn": nn.functional.mse_loss,
            "tokens_per_batch": 8,
        }
        exec(compile(code.replace(README_ADDRESS, f"127.0.0.1:{srv.port}"), str(README), "exec"), namespace)
        stats = namespace["worker"].stats
        assert stats.inner_steps == batches
        # one push every H steps, and the last steps pushed on close
        assert stats.pushes_applied == -(-batches // local_steps)
        assert srv.state.version == stats.pushes_applied
    finally:
        srv.stop(None)
