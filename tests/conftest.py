"""Shared fixtures and the suite's own checks.

Every test:
- that starts a process (``subprocess``, ``multiprocessing``, a fork) must be marked
  ``multiprocess``; one that is not fails, naming the command;
- must leave no child process behind: any left is killed, reaped, and fails the test
  (as hivemind's suite does).

Fixtures: ``start_server`` (in-process servers on 127.0.0.1, port 0, stopped after the
test, optionally on a fake clock), ``cli_exit`` (the ``asyncdiloco`` command run in this
process), ``one_thread`` (torch on one thread).
"""

from __future__ import annotations

import _posixsubprocess
import logging
import os
import signal
import subprocess

import pytest
import torch


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


def _command_of(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip() or "?"
    except OSError:
        return "?"


#: multiprocessing's own helper processes (started by a pool, kept for the interpreter's life).
_MULTIPROCESSING_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


@pytest.fixture(autouse=True)
def reap_children():
    """Kill (SIGKILL) and reap any child process the test left running, and fail the
    test for it: a test waits for the processes it starts."""
    yield
    if not os.path.isdir("/proc"):
        return
    left = []
    for pid in _children(os.getpid()):
        if any(helper in _command_of(pid) for helper in _MULTIPROCESSING_HELPERS):
            continue  # lives as long as this interpreter, by design
        left.append(f"{pid} ({_command_of(pid)})")
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
    if left:
        pytest.fail(f"the test left child processes behind (now killed): {', '.join(left)}", pytrace=False)


#: nodeid of the test being run (setup, call, teardown) -> how it started processes
_started: dict[str, list[str]] = {}
_running: list[str] = []


def _recording(name: str, real):
    """``real`` (a way to start a process), noting the call for the test being run."""

    def wrapper(*args, **kwargs):
        if _running:
            what = f"{name}({args[0]!r})" if args and name != "os.fork" else name
            _started.setdefault(_running[-1], []).append(what)
        return real(*args, **kwargs)

    return wrapper


# Every way Python starts a process goes through one of these: subprocess through its own
# reference to fork_exec (or os.posix_spawn), multiprocessing's spawn and forkserver
# through _posixsubprocess.fork_exec, its fork through os.fork. Wrapped for the whole
# session, so a module-scoped fixture that starts one is charged to the test it is set up for.
if getattr(subprocess, "_fork_exec", None) is not None:
    subprocess._fork_exec = _recording("subprocess", subprocess._fork_exec)
_posixsubprocess.fork_exec = _recording("fork_exec", _posixsubprocess.fork_exec)
os.fork = _recording("os.fork", os.fork)
if hasattr(os, "posix_spawn"):
    os.posix_spawn = _recording("os.posix_spawn", os.posix_spawn)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _running.append(item.nodeid)
    try:
        yield
    finally:
        _running.pop()
        _started.pop(item.nodeid, None)


@pytest.fixture(autouse=True)
def processes_need_the_marker(request):
    """Fail a test that starts a process (in the test or in a fixture set up for it)
    without ``@pytest.mark.multiprocess``; the process still runs, so the test's own
    outcome comes first and this message after."""
    yield
    started = _started.get(request.node.nodeid, [])
    if started and request.node.get_closest_marker("multiprocess") is None:
        pytest.fail(
            f"the test started a process but is not marked @pytest.mark.multiprocess: {started[0]}", pytrace=False
        )


@pytest.fixture
def start_server():
    """``start_server(clock=None, **ServerConfig fields) -> ParameterServer``: a started
    in-process server on 127.0.0.1 (port 0, a free one, unless given); every server a test
    started is stopped after it. With ``clock`` (e.g. a ``helpers.FakeClock``) the state
    judges leases, rates and windows by that clock instead of ``time.monotonic``."""
    from asyncdiloco.ps import ParameterServer, ParameterServerState
    from asyncdiloco.ps.config import ServerConfig

    started = []

    def start(clock=None, **fields) -> ParameterServer:
        fields.setdefault("port", 0)
        srv = ParameterServer(ServerConfig(**fields))
        if clock is not None:
            srv.state = ParameterServerState(srv.config, clock=clock)
        started.append(srv)
        return srv.start()

    yield start
    for srv in started:
        srv.stop(None)


@pytest.fixture
def cli_exit(monkeypatch, capsys):
    """``cli_exit(argv) -> (exit status, standard error)``: ``asyncdiloco -q ARGV`` in this
    process, for refusals (they happen before anything starts). The command's
    process-wide settings (SIGINT/SIGTERM handlers, torch threads, the allocator, the
    root logger) are kept from the test process."""
    import asyncdiloco._malloc
    from asyncdiloco.cli.app import main

    real_signal = signal.signal

    def signal_but_not_stop_signals(sig, handler):
        return None if sig in (signal.SIGINT, signal.SIGTERM) else real_signal(sig, handler)

    monkeypatch.setattr(asyncdiloco._malloc, "keep_large_blocks", lambda: None)
    monkeypatch.setattr(signal, "signal", signal_but_not_stop_signals)
    monkeypatch.setattr(torch, "set_num_threads", lambda _: None)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level

    def run(argv: list[str]) -> tuple[int, str]:
        try:
            with pytest.raises(SystemExit) as exc:
                main(["-q", *argv])
        finally:
            for h in root.handlers[:]:
                if h not in handlers:
                    root.removeHandler(h)
            root.setLevel(level)
        return exc.value.code, capsys.readouterr().err

    return run


@pytest.fixture
def one_thread():
    """torch on one thread for the test: bit-reproducible CPU kernels, and kind to a
    machine whose cores other tests share."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
