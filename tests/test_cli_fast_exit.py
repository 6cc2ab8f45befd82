"""The ``worker`` and ``server`` commands end without the interpreter's teardown (app.py
``FAST_EXIT``), after flushing the logs and streams; other commands, and a caller's
``main(argv)``, exit normally."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from asyncdiloco.cli import app


class _Exited(Exception):
    pass


def _record_exits(monkeypatch: pytest.MonkeyPatch, command: str, code: int) -> list[tuple[str, int]]:
    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(app, "_run", lambda argv: (code, command))

    def fast(c: int) -> None:
        calls.append(("os._exit", c))
        raise _Exited

    def slow(c: int) -> None:
        calls.append(("sys.exit", c))
        raise _Exited

    monkeypatch.setattr(app.os, "_exit", fast)
    monkeypatch.setattr(app.sys, "exit", slow)
    return calls


@pytest.mark.parametrize("command", ["worker", "server"])
def test_worker_and_server_from_the_command_line_skip_the_teardown(monkeypatch, command):
    calls = _record_exits(monkeypatch, command, 3)
    flushed = []
    handler = logging.StreamHandler()
    monkeypatch.setattr(handler, "flush", lambda: flushed.append(True))
    logging.getLogger().addHandler(handler)
    try:
        with pytest.raises(_Exited):
            app.main()
    finally:
        logging.getLogger().removeHandler(handler)
    assert calls == [("os._exit", 3)]
    assert flushed  # logging.shutdown flushed the handlers first


@pytest.mark.parametrize("command", ["status", "demo", "bench"])
def test_other_commands_exit_normally(monkeypatch, command):
    calls = _record_exits(monkeypatch, command, 0)
    with pytest.raises(_Exited):
        app.main()
    assert calls == [("sys.exit", 0)]


def test_a_callers_argv_exits_normally(monkeypatch):
    calls = _record_exits(monkeypatch, "worker", 0)
    with pytest.raises(_Exited):
        app.main(["worker"])
    assert calls == [("sys.exit", 0)]


@pytest.mark.multiprocess
def test_the_exit_status_and_the_last_lines_survive_the_fast_exit():
    """A real process: what it printed and logged last is there, and so is its status."""
    code = (
        "import logging, sys\n"
        "from asyncdiloco.cli import app\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stderr)\n"
        "def run(argv):\n"
        "    print('last line', end='')\n"
        "    logging.getLogger('x').info('last log')\n"
        "    return 4, 'worker'\n"
        "app._run = run\n"
        "app.main()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 4
    assert done.stdout == "last line"
    assert "last log" in done.stderr
