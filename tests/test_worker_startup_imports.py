"""A worker process's start-up does not load the parameter server's modules (ps/__init__.py
loads its names on first use), and those names still resolve."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.multiprocess
def test_the_worker_command_path_leaves_the_server_unloaded():
    code = (
        "import sys\n"
        "import asyncdiloco.cli.app, asyncdiloco.cli.train, asyncdiloco.cli.worker\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('asyncdiloco.ps'))))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = set(done.stdout.split())
    assert "asyncdiloco.ps.config" in loaded  # the flag tables need it
    assert not loaded & {"asyncdiloco.ps.server", "asyncdiloco.ps.state", "asyncdiloco.ps.transport.grpc_service"}


def test_the_server_package_names_load_on_first_use():
    import asyncdiloco.ps as ps
    from asyncdiloco.ps.pull.encoded import Snapshot
    from asyncdiloco.ps.server import ParameterServer
    from asyncdiloco.ps.state import ParameterServerState, PushOutcome

    assert ps.ParameterServer is ParameterServer
    assert (ps.ParameterServerState, ps.PushOutcome, ps.Snapshot) == (ParameterServerState, PushOutcome, Snapshot)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = ps.Nope
