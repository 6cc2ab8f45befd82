"""Shared helpers of the benchmarks: JSON lines, medians, server processes and ports, RSS.

Benchmarks measure and print; they assert nothing and are not collected by pytest.
Every ratio is taken against a baseline measured in the same run, because the machines
are shared and noisy.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

from asyncdiloco.errors import AsyncDiLoCoError

MIB = 1024 * 1024


def emit(record: dict, out: os.PathLike | None = None) -> None:
    """Print one JSON line (and append it to ``out`` if given)."""
    line = json.dumps(record, sort_keys=True)
    print(line, flush=True)
    if out is not None:
        with open(out, "a") as f:
            f.write(line + "\n")


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def median_seconds(fn, repeats: int) -> float:
    """Median wall seconds of ``repeats`` calls of ``fn()``, after one untimed call that
    warms it up (first touch of buffers, lazily allocated state)."""
    return median_seconds_interleaved([fn], repeats)[0]


def median_seconds_interleaved(fns, repeats: int) -> list[float]:
    """``median_seconds`` of each of ``fns``, their calls interleaved (a, b, a, b, ...)
    so that the machine's drift over the run (other jobs, clock speed) falls on all alike."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return [median(t) for t in times]


def parse_sizes(text: str) -> list[int]:
    """ "4,64,256" (MiB) -> byte counts."""
    return [int(float(s) * MIB) for s in text.split(",") if s]


@contextmanager
def server_process(*flags: str, env: dict | None = None) -> Iterator[tuple[subprocess.Popen, str]]:
    """Run ``asyncdiloco server --port 0 FLAGS`` on 127.0.0.1; yields (process, address)."""
    with tempfile.TemporaryDirectory() as tmp:
        port_file = pathlib.Path(tmp) / "port"
        proc = subprocess.Popen(
            [sys.executable, "-m", "asyncdiloco", "-q", "server", "--port", "0", "--port-file", str(port_file), *flags],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env={**os.environ, **(env or {})},
        )
        try:
            deadline = time.monotonic() + 60
            while not port_file.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"server did not start: {proc.stderr.read().decode() if proc.stderr else ''}")
                time.sleep(0.05)
            yield proc, f"127.0.0.1:{int(port_file.read_text())}"
        finally:
            reap([proc], timeout_s=20)


def free_ports(n: int = 1) -> list[int]:
    """``n`` free loopback ports, for servers whose clients must know the port before it
    listens (another process could take one in between: the run then fails loudly)."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def wait_for_port(proc: subprocess.Popen, port_file: pathlib.Path, timeout_s: float, log_path: pathlib.Path) -> int:
    """The port a server process wrote to ``port_file`` (``--port-file``) once it listens.

    Raises:
        AsyncDiLoCoError: the process exited first, or did not listen within ``timeout_s``
            seconds; the message names ``log_path``.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if port_file.exists() and port_file.read_text().strip():
            return int(port_file.read_text())
        if proc.poll() is not None:
            raise AsyncDiLoCoError(f"the server exited with status {proc.returncode}; see {log_path}")
        time.sleep(0.01)
    raise AsyncDiLoCoError(f"the server did not listen within {timeout_s:g} s; see {log_path}")


def reap(procs: list[subprocess.Popen], timeout_s: float = 10.0) -> None:
    """SIGTERM every process of ``procs`` still running; SIGKILL those not gone within ``timeout_s``."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def exit_on_sigterm(*_: object) -> None:
    """A SIGTERM handler that exits (status 143) through the ``finally`` blocks, which reap the children."""
    raise SystemExit(143)


def cpu_seconds(pid: int) -> float:
    """CPU time a process used so far, user + system, all its threads (Linux /proc), seconds."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14, 15


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    """Resident set size (``VmRSS``) or its peak (``VmHWM``) of a process, in bytes."""
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/{pid}/status")


def reset_peak_rss(pid: int) -> None:
    """Reset ``VmHWM`` to the current RSS (Linux: write 5 to /proc/PID/clear_refs)."""
    pathlib.Path(f"/proc/{pid}/clear_refs").write_text("5")
