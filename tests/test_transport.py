"""Transport hygiene: a worker whose data loader forks processes keeps talking to the server."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from asyncdiloco.algo.config import OuterConfig
from asyncdiloco.ps import ParameterServer
from asyncdiloco.ps.config import ServerConfig

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

HERE = pathlib.Path(__file__).parent


def test_worker_with_a_forking_dataloader_keeps_syncing():
    # gRPC Python leaves fork support off by default: a forked child must not use the
    # parent's channels, and the DataLoader's children never do; the parent's channel
    # and heartbeat thread go on working across the forks (one pair per epoch here).
    with ParameterServer(
        ServerConfig(port=0, local_steps=4, outer=OuterConfig(optimizer="sgd", lr=0.5, momentum=0.0))
    ) as srv:
        proc = subprocess.run(
            [sys.executable, str(HERE / "_tiny_worker.py"), srv.address, "0", "48", "--dataloader"],
            capture_output=True,
            text=True,
            timeout=90,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "done: 12 pushes applied, 0 failed syncs" in proc.stdout
        st = srv.state.status()
        assert st.version == 12 and st.rejected_pushes == 0
