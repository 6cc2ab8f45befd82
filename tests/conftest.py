"""Shared fixtures: every test reaps the child processes it left behind."""

from __future__ import annotations

import os
import signal

import pytest


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(entry))
    return kids


@pytest.fixture
def start_server():
    """``start_server(**ServerConfig fields) -> ParameterServer``: a started in-process
    server on 127.0.0.1 (port 0, a free one, unless given); every server a test started
    is stopped after it."""
    from asyncdiloco.ps import ParameterServer
    from asyncdiloco.ps.config import ServerConfig

    started = []

    def start(**fields) -> ParameterServer:
        fields.setdefault("port", 0)
        srv = ParameterServer(ServerConfig(**fields)).start()
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop(None)


@pytest.fixture(autouse=True)
def reap_children():
    """Kill (SIGKILL) and wait for any child process a test did not clean up."""
    yield
    if not os.path.isdir("/proc"):
        return
    for pid in _children(os.getpid()):
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
