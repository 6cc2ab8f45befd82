"""The two kinds of Ray actor of a fleet, as plain classes (launch.py wraps them with
``ray.remote``; nothing here imports Ray): ``ServerActor``, the parameter server in the
actor's process, and ``WorkerActor``, ``asyncdiloco worker`` as the actor's child process
(under ``torchrun`` for a group of N > 1 ranks), which Ray ends with its actor
(docs/operations.md "A fleet on Ray").
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

from asyncdiloco.ps.config import ServerConfig
from asyncdiloco.wire.security import ServerSecurityConfig

#: Bytes of a worker's log handed back to the driver at most (the newest).
LOG_TAIL_BYTES = 1 << 20


def write_token_file(token: str) -> str:
    """``token`` in a new file only this user can read; returns its path."""
    folder = tempfile.mkdtemp(prefix="asyncdiloco-token-")  # mode 0700
    path = os.path.join(folder, "token")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return path


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


class ServerActor:
    """The parameter server in a Ray actor (threaded: ``serve`` blocks while the other
    methods answer).

    Args:
        config: the server's settings; ``security`` is replaced by the fleet's token.
        token: the shared token every call must carry (None: none).
        trusted_network: the token may be served over plaintext beyond the loopback
            (``FleetSpec.insecure_trusted_network``).
    Raises:
        ConfigError / CheckpointError: from ``ParameterServer.start`` (port in use, ...).
    """

    def __init__(self, config: ServerConfig, token: str | None, trusted_network: bool = False) -> None:
        import torch

        from asyncdiloco.ps.server import ParameterServer

        torch.set_num_threads(1)  # the outer step competes with the RPC threads (as `asyncdiloco server`)
        self._log_path = pathlib.Path(tempfile.mkdtemp(prefix="asyncdiloco-server-")) / "server.log"
        handler = logging.FileHandler(self._log_path)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logging.getLogger("asyncdiloco").addHandler(handler)  # this actor's process is the server's
        logging.getLogger("asyncdiloco").setLevel(logging.INFO)
        token_file = write_token_file(token) if token is not None else None
        security = None
        if token_file is not None:
            security = ServerSecurityConfig(token_file=token_file, insecure_trusted_network=trusted_network)
        self._stopped = threading.Event()
        try:
            self.server = ParameterServer(dataclasses.replace(config, security=security)).start()
        finally:  # the server read the token at start: no copy of it stays on the node's disk
            if token_file is not None:
                shutil.rmtree(os.path.dirname(token_file), ignore_errors=True)

    def where(self) -> dict:
        """Where workers reach the server: ``address`` "HOST:PORT", ``metrics_port`` (0:
        off), ``node_ip``, the IP address of the actor's node, and ``log_path``, the
        server's log file on that node."""
        host, node = self.server.config.host, _node_ip()
        reachable = node if host in ("0.0.0.0", "::", "") else host
        shown = f"[{reachable}]" if ":" in reachable else reachable
        return {
            "address": f"{shown}:{self.server.port}",
            "metrics_port": self.server.metrics_port,
            "node_ip": node,
            "log_path": str(self._log_path),
        }

    def serve(self) -> None:
        """Block until ``stop``: the driver waits on this call to learn that the actor died."""
        self._stopped.wait()

    def stop(self, grace_s: float = 2.0) -> str:
        """Stop serving (a final checkpoint with ``checkpoint_dir``); returns the server's log."""
        self.server.stop(grace_s=grace_s)
        self._stopped.set()
        return self._log_path.read_text(errors="replace")


def worker_launcher(nproc: int) -> list[str]:
    """The command before ``worker ...``: ``python -m asyncdiloco``, or, for N > 1
    processes, ``python -m torch.distributed.run --standalone --nproc-per-node N -m asyncdiloco``
    (torchrun, with this node's Python)."""
    if nproc == 1:
        return [sys.executable, "-m", "asyncdiloco"]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "asyncdiloco",
    ]


class WorkerActor:
    """One worker of a fleet in a Ray actor (threaded: ``stop`` answers while ``run`` waits).

    Args:
        name: the worker's name on the server (``--worker-name``).
        state_dir: its state folder on this node, made if missing (``--state-dir``).
        nproc: processes of the worker (``worker_launcher``).
    """

    def __init__(self, name: str, state_dir: str, nproc: int = 1) -> None:
        self.name, self.state_dir, self.nproc = name, pathlib.Path(state_dir), nproc
        self._proc: subprocess.Popen | None = None
        self._stopping = threading.Event()

    def run(self, argv: list[str], token: str | None) -> dict:
        """Run ``asyncdiloco worker ARGV`` with this worker's name, state folder, stats
        file and token until it exits.

        Returns:
            ``exit_code`` (negative: the signal that ended it), ``stats`` (its stats file,
            None if it wrote none), ``log`` (the newest ``LOG_TAIL_BYTES`` of worker.log,
            every run of the worker on this node), ``node_ip``.
        """
        self.state_dir.mkdir(parents=True, exist_ok=True)
        stats = self.state_dir / "stats.json"
        stats.unlink(missing_ok=True)
        cmd = [*worker_launcher(self.nproc), "worker", *argv, "--worker-name", self.name]
        cmd += ["--state-dir", str(self.state_dir), "--stats-file", str(stats)]
        token_file = write_token_file(token) if token is not None else None
        if token_file is not None:
            cmd += ["--token-file", token_file]
        log_path = self.state_dir / "worker.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        try:
            with open(log_path, "ab") as log:
                self._proc = subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
                )
            if self._stopping.is_set():  # stopped while starting
                self._proc.terminate()
            code = self._proc.wait()
        finally:
            if token_file is not None:
                shutil.rmtree(os.path.dirname(token_file), ignore_errors=True)
        with open(log_path, "rb") as f:
            f.seek(max(0, log_path.stat().st_size - LOG_TAIL_BYTES))
            text = f.read().decode(errors="replace")
        return {
            "exit_code": code,
            "stats": json.loads(stats.read_text()) if stats.exists() else None,
            "log": text,
            "node_ip": _node_ip(),
        }

    def stop(self) -> None:
        """SIGTERM the worker: it ends training after the current inner step, pushes its
        last steps and leaves; ``run`` then returns."""
        self._stopping.set()
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)

    def pid(self) -> int:
        """The worker process's id (0 before it started)."""
        return self._proc.pid if self._proc is not None else 0
