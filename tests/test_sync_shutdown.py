"""SIGTERM on a sync server with a Quorum call blocked in it: the call is answered at
shutdown and the process exits within its drain and grace, not at the call's timeout."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import torch
from helpers import STUCK_S, wait_until

from asyncdiloco.cli.server import GRACE_S
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.tensors import Manifest
from asyncdiloco.worker.client import ParameterServerClient

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

MANIFEST = Manifest.from_named_tensors([("w", torch.zeros(8))])
#: The blocked call's own timeout: far beyond the grace, so only a wake-up ends it in time.
QUORUM_TIMEOUT_S = 40.0


def _quorum_calls_started(metrics_url: str) -> float:
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("grpc_server_started_total{") and 'grpc_method="Quorum"' in line
    )


def test_sigterm_with_a_quorum_call_blocked_exits_within_the_grace():
    server = subprocess.Popen(
        [sys.executable, "-m", "asyncdiloco", "-q", "server", "--mode", "sync", "--min-workers", "2"]
        + ["--port", "0", "--metrics-port", "0", "--host", "127.0.0.1", "--drain-s", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines = [server.stdout.readline() for _ in range(2)]  # listening, dashboard
        address = lines[0].rsplit(" ", 1)[1].strip()
        metrics_url = lines[1].rsplit(" ", 1)[1].strip()
        client = ParameterServerClient(address)
        wid = client.join(MANIFEST, "lonely").worker_id
        client.push(
            MANIFEST.pack([torch.ones(8)]),
            worker_id=wid,
            push_id=1,
            base_version=0,
            kind=pb.PUSH_KIND_INITIAL_PARAMETERS,
        )
        replies: list[pb.QuorumReply | Exception] = []

        def ask() -> None:
            try:
                replies.append(
                    client.quorum(
                        worker_id=wid, round=0, manifest_hash=MANIFEST.manifest_hash, timeout_s=QUORUM_TIMEOUT_S
                    )
                )
            except Exception as exc:  # noqa: BLE001 - recorded: UNAVAILABLE is an acceptable answer too
                replies.append(exc)

        asking = threading.Thread(target=ask, daemon=True)
        asking.start()
        wait_until(lambda: _quorum_calls_started(metrics_url) >= 1, "the Quorum call to reach the server")
        started = time.monotonic()
        server.terminate()
        server.wait(timeout=STUCK_S)
        exited_s = time.monotonic() - started
        asking.join(timeout=STUCK_S)
        assert server.returncode == 0, server.stderr.read()[-2000:]
        assert exited_s < GRACE_S + 5.0, f"exited after {exited_s:.1f} s"  # slack for a loaded machine
        assert replies and not asking.is_alive()  # the call was answered, not left to its timeout
        assert isinstance(replies[0], Exception) or not replies[0].formed
        client.close()
    finally:
        server.kill()
        server.wait(timeout=30)
