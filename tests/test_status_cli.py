"""``asyncdiloco status`` (cli/status.py, tools/status_view.py): the table and the JSON
against a real in-process server with two joined workers, the rendering of every field
on a hand-built StatusReply, --watch, --all, and
a server that cannot be reached."""

from __future__ import annotations

import json
import socket

import pytest
from _default_job import DefaultJobRun

from asyncdiloco.cli import app
from asyncdiloco.cli import status as status_cmd
from asyncdiloco.tools.status_view import render, staleness_summary, status_dict
from asyncdiloco.wire._proto import parameter_server_pb2 as pb

pytestmark = pytest.mark.timeout(120)


def run_status(argv: list[str], capsys) -> tuple[int, str]:
    """``asyncdiloco status ARGV`` in this process: (exit status, stdout)."""
    args = app.build_parser().parse_args(["status", *argv])
    code = args.func(args)
    return code, capsys.readouterr().out


@pytest.fixture
def two_workers(start_server):
    """A server of the default job with workers "alpha" (initialized it, 2 pushes) and "beta" (1 push)."""
    srv = start_server(grouping="off")
    run = DefaultJobRun(srv.address)
    alpha = run.join("alpha", steps_per_s=4.0)
    beta = run.join("beta", steps_per_s=2.0)
    run.push(alpha, seed=1)
    run.push(beta, seed=2)
    run.push(alpha, seed=3)
    yield srv, run, alpha, beta
    run.close()


def test_status_json_lists_the_two_live_workers(two_workers, capsys):
    srv, _, alpha, beta = two_workers
    code, out = run_status(["--server", srv.address, "--json"], capsys)
    assert code == 0
    d = json.loads(out)  # one JSON object
    assert d["version"] == srv.state.version == 3
    assert d["mode"] == "async"
    assert d["applied_pushes"] == 3 and d["run_config"]["local_steps"] == srv.config.local_steps
    assert d["outer_optimizer"].startswith(srv.config.outer.optimizer)
    assert d["staleness"]["pushes"] == 3 and d["staleness"]["max"] == 0
    by_name = {w["name"]: w for w in d["workers"]}
    assert set(by_name) == {"alpha", "beta"}
    assert by_name["alpha"]["id"] == alpha and by_name["beta"]["id"] == beta
    assert by_name["alpha"]["applied_pushes"] == 2 and by_name["beta"]["applied_pushes"] == 1
    assert by_name["alpha"]["steps_per_s"] == pytest.approx(4.0)
    for w in d["workers"]:
        assert {"last_seen_s", "steps_per_s", "local_steps_per_round", "mean_staleness", "state"} <= set(w)
        assert w["last_seen_s"] >= 0 and w["alive"]


def test_status_table_shows_the_run_and_a_row_per_worker(two_workers, capsys):
    srv, _, alpha, beta = two_workers
    code, out = run_status(["--server", srv.address], capsys)
    assert code == 0
    lines = out.splitlines()
    assert "mode async" in lines[0] and srv.address in lines[0]
    assert lines[1].startswith("version 3 |") and "3 pushes applied" in lines[1]
    assert "staleness tau: mean 0.00 | p50 0 | p90 0 | max 0" in out
    header = next(i for i, line in enumerate(lines) if line.startswith("NAME"))
    assert lines[header].split()[:4] == ["NAME", "ID", "STEPS/S", "H_W"]
    rows = {line.split()[0]: line.split() for line in lines[header + 1 :]}
    assert rows["alpha"][1:3] == [str(alpha), "4.00"] and rows["beta"][1:3] == [str(beta), "2.00"]


def test_a_worker_that_left_shows_only_with_all(two_workers, capsys):
    srv, run, _, beta = two_workers
    run.client.leave(beta)
    _, out = run_status(["--server", srv.address, "--json"], capsys)
    assert [w["name"] for w in json.loads(out)["workers"]] == ["alpha"]
    _, out = run_status(["--server", srv.address, "--json", "--all"], capsys)
    workers = {w["name"]: w for w in json.loads(out)["workers"]}
    assert set(workers) == {"alpha", "beta"} and not workers["beta"]["alive"]
    _, out = run_status(["--server", srv.address, "--all"], capsys)
    assert "workers: 1 live, 1 gone" in out


def test_watch_prints_one_json_line_per_refresh_until_ctrl_c(two_workers, capsys, monkeypatch):
    srv = two_workers[0]
    waits = []

    def sleep(seconds):  # the watch's pause: two refreshes, then Ctrl-C
        waits.append(seconds)
        if len(waits) > 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(status_cmd, "_sleep", sleep)
    code, out = run_status(["--server", srv.address, "--watch", "0.5", "--json"], capsys)
    assert code == 0 and waits == [0.5, 0.5, 0.5]
    lines = out.splitlines()
    assert len(lines) == 3 and all(json.loads(line)["version"] == 3 for line in lines)


def test_watch_without_seconds_refreshes_every_two(capsys, monkeypatch):
    args = app.build_parser().parse_args(["status", "--server", "127.0.0.1:1", "--watch"])
    assert args.watch == 2.0
    assert app.build_parser().parse_args(["status", "--server", "127.0.0.1:1"]).watch is None


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_server_that_cannot_be_reached_is_one_line_and_exit_1(cli_exit):
    port = _closed_port()
    code, err = cli_exit(["status", "--server", f"127.0.0.1:{port}"])
    assert code == 1
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"cannot reach the server at 127.0.0.1:{port}" in err and "check --server" in err


def test_bad_flags_are_refused(cli_exit):
    assert "give seconds > 0" in cli_exit(["status", "--server", "127.0.0.1:1", "--watch", "0"])[1]
    code, err = cli_exit(["status", "--server", "nohost"])
    assert code == 2 and "HOST:PORT" in err


# ------------------------------------------------------------ rendering alone
def _reply(**over) -> pb.StatusReply:
    st = pb.StatusReply(
        version=120,
        applied_pushes=130,
        rejected_pushes=2,
        staleness_histogram=[10, 60, 40, 20, 0, 0, 0, 0],
        tokens=2_500_000,
        uptime_s=754.0,
        initialized=True,
        run_config=pb.RunConfig(mode="async", local_steps=20, wire_codec="bf16", grouping="window", dylu=True),
        outer_optimizer="delayed_nesterov(lr=0.7, momentum=0.6)",
        staleness_weighting="constant",
        pushes_per_s=3.25,
        server_version="0.1.0",
        evals=[
            pb.EvalPoint(version=100, loss=2.5, num_tokens=16384, evaluator="ev", at_s=700.0),
            pb.EvalPoint(version=118, loss=2.25, num_tokens=16384, evaluator="ev", at_s=750.0),
        ],
        workers=[
            pb.WorkerStatus(
                worker_id=1,
                worker_name="fast",
                applied_pushes=90,
                last_seen_s=0.25,
                alive=True,
                local_steps_per_round=20,
                steps_per_s=8.0,
                mean_staleness=1.5,
                last_staleness=2,
                state="training",
            ),
            pb.WorkerStatus(worker_id=2, worker_name="slow", applied_pushes=40, alive=True, state="silent"),
            pb.WorkerStatus(worker_id=3, worker_name="old", applied_pushes=0, alive=False, state="expired"),
        ],
    )
    for k, v in over.items():
        if isinstance(v, list):
            del getattr(st, k)[:]
            getattr(st, k).extend(v)
        else:
            setattr(st, k, v)
    return st


def test_every_new_field_is_rendered():
    d = status_dict(_reply(), address="h:1")
    assert d["server_version"] == "0.1.0" and d["pushes_per_s"] == 3.25
    assert d["eval"] == {
        "version": 118,
        "loss_nats_per_token": 2.25,
        "num_tokens": 16384,
        "evaluator": "ev",
        "age_s": 4.0,
    }
    assert [w["name"] for w in d["workers"]] == ["fast", "slow"] and d["live_workers"] == 2
    assert d["workers"][0]["mean_staleness"] == 1.5 and d["workers"][1]["state"] == "silent"
    text = render(d)
    assert text.splitlines()[0] == "asyncdiloco server 0.1.0 at h:1: mode async, up 12m34s"
    assert "3.25 pushes/s" in text and "2.5M tokens" in text
    assert "codec bf16 | grouping window | dylu on" in text
    assert "held-out loss 2.2500 nats/char at version 118 (4s ago, by ev)" in text
    row = next(line for line in text.splitlines() if line.startswith("fast"))
    assert row.split() == ["fast", "1", "8.00", "20", "90", "0.2s", "ago", "1.50", "training"]
    assert "old" not in text
    assert [w["name"] for w in status_dict(_reply(), all_workers=True)["workers"]] == ["fast", "slow", "old"]


def test_the_staleness_summary_reads_the_histogram():
    # 10 at τ=0, 60 at 1, 40 at 2, 20 at 3: mean (60 + 80 + 60) / 130
    s = staleness_summary([10, 60, 40, 20, 0])
    assert s == {"pushes": 130, "mean": 200 / 130, "p50": 1, "p90": 3, "max": 3, "max_is_lower_bound": False}
    assert staleness_summary([1, 0, 2])["max_is_lower_bound"]  # the last bucket counts every larger τ
    assert staleness_summary([0, 0])["mean"] is None
    assert "max >=2" in render(status_dict(_reply(staleness_histogram=[1, 0, 2])))


def test_the_token_flag_is_the_workers(start_server, tmp_path, capsys, cli_exit):
    from asyncdiloco.wire.security import ServerSecurityConfig

    token = tmp_path / "token"
    token.write_text("s3cret\n")
    token.chmod(0o600)
    srv = start_server(security=ServerSecurityConfig(token_file=str(token)))
    code, err = cli_exit(["status", "--server", srv.address])
    assert code == 1 and "token" in err and err.count("\n") == 1
    code, out = run_status(["--server", srv.address, "--token-file", str(token), "--json"], capsys)
    assert code == 0 and json.loads(out)["workers"] == []


def test_a_reader_that_closed_the_pipe_ends_status_quietly(start_server, monkeypatch, capsys):
    """``asyncdiloco status | head -1``: the reader is gone before the table is written."""
    import os
    import sys

    srv = start_server()
    read_end, write_end = os.pipe()
    os.close(read_end)
    with os.fdopen(write_end, "w") as closed_pipe:
        monkeypatch.setattr(sys, "stdout", closed_pipe)
        with pytest.raises(SystemExit) as done:
            app.main(["status", "--server", srv.address])
        monkeypatch.undo()
        assert done.value.code == 1 and capsys.readouterr().err == ""
    # closing it flushed nothing into the broken pipe: its descriptor is /dev/null now


def test_a_sync_run_is_told_in_rounds_and_member_contributions():
    st = _reply(
        staleness_histogram=[130, 0, 0, 0],
        rounds_committed=65,
        rounds_failed=2,
        outer_optimizer="nesterov(lr=0.7, momentum=0.9)",
    )
    st.run_config.CopyFrom(
        pb.RunConfig(
            mode="sync", local_steps=20, wire_codec="raw", dylu=True, max_staleness=8, sync_local_steps="adaptive"
        )
    )
    text = render(status_dict(st))
    assert "65 rounds committed, 2 aborted" in text and "130 member contributions applied" in text
    assert "H 20 | local steps adaptive |" in text  # each member's H_w is in the H_W column
    for async_only in ("pushes/s", "pushes applied", "dylu", "staleness weighting", "max_staleness", "staleness tau"):
        assert async_only not in text, async_only
    header = next(line for line in text.splitlines() if line.startswith("NAME"))
    assert header.split() == ["NAME", "ID", "STEPS/S", "H_W", "CONTRIBUTIONS", "LAST", "SEEN", "STATE"]
    async_text = render(status_dict(_reply()))
    assert "3.25 pushes/s" in async_text and "MEAN TAU" in async_text and "rounds" not in async_text
