"""The evaluator (tools/evaluator.py) and ``asyncdiloco eval`` (cli/eval.py): the loss it
reports is the held-out loss of the server's global model computed directly; a version
already evaluated is skipped; a model
that is not the server's is refused."""

from __future__ import annotations

import logging
import socket

import pytest
from _default_job import DefaultJobRun, model_with

from asyncdiloco.cli import app
from asyncdiloco.errors import AsyncDiLoCoError, NotInitializedError
from asyncdiloco.job.config import JobConfig
from asyncdiloco.job.dataset import CharCorpus
from asyncdiloco.job.models import evaluate
from asyncdiloco.tools.evaluator import Evaluator, evaluate_every
from asyncdiloco.worker.client import ParameterServerClient

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def trained(start_server):
    """A server of the default job at version 2 (an initial push, two pseudo-gradients)."""
    srv = start_server(grouping="off")
    run = DefaultJobRun(srv.address)
    a = run.join("a")
    run.push(a, seed=1, scale=0.05)
    run.push(a, seed=2, scale=0.05)
    yield srv, run, a
    run.close()


def direct_loss(srv) -> float:
    """The held-out loss of the server's θ, computed here without the evaluator."""
    job = JobConfig()
    return evaluate(model_with(srv.state.params.clone()), job.eval_set(CharCorpus.default()))


class Reports:
    """Stands in for ``client.report_eval``: records each report, or fails it."""

    def __init__(self, fail: Exception | None = None) -> None:
        self.calls: list[tuple] = []
        self.fail = fail

    def __call__(self, version, loss, num_tokens, evaluator=""):
        self.calls.append((version, loss, num_tokens, evaluator))
        if self.fail is not None:
            raise self.fail


def test_the_reported_loss_is_the_global_models_held_out_loss(trained, one_thread):
    srv, _, _ = trained
    with ParameterServerClient(srv.address) as client:
        ev = Evaluator(client, name="probe")
        seed_loss = ev.held_out_loss()
        result = ev.evaluate_global()
    expected = direct_loss(srv)
    assert result.version == srv.state.version == 2
    assert result.loss == pytest.approx(expected, rel=1e-6) and result.loss != pytest.approx(seed_loss, rel=1e-3)
    assert result.num_tokens == 8 * 32 * 64 and result.reported  # eval_batches x batch_size x context_len
    (point,) = srv.state.status().evals  # the report reached the server's status (and so its dashboard)
    assert (point.version, point.loss, point.num_tokens) == (2, result.loss, result.num_tokens)
    assert point.evaluator == "probe"


def test_evaluate_every_skips_a_version_already_evaluated(trained):
    srv, run, a = trained
    waits = []

    def wait(seconds):  # between attempts: nothing new, then one more push
        waits.append(seconds)
        if len(waits) == 2:
            run.push(a, seed=3)
        return False

    seen = []
    with ParameterServerClient(srv.address) as client:
        client.report_eval = reports = Reports()
        done = evaluate_every(Evaluator(client), 7.0, seen.append, max_evals=2, wait=wait)
    assert done == 2 and [e.version for e in seen] == [2, 3]
    assert waits == [7.0, 7.0] and [c[0] for c in reports.calls] == [2, 3]  # attempt 2 found version 2 again


def test_a_failed_report_is_logged_and_the_next_one_is_tried(trained, caplog):
    srv, _, _ = trained
    with ParameterServerClient(srv.address) as client:
        client.report_eval = reports = Reports(AsyncDiLoCoError("UNAVAILABLE: gone for a moment"))
        ev = Evaluator(client)
        with caplog.at_level(logging.WARNING, logger="asyncdiloco.tools.evaluator"):
            assert not ev.evaluate_global().reported
            assert not ev.evaluate_global().reported
    assert len(reports.calls) == 2 and "was not taken" in caplog.records[0].message


def test_no_global_model_yet_is_a_clear_refusal(start_server):
    srv = start_server()
    with ParameterServerClient(srv.address) as client, pytest.raises(NotInitializedError, match="start a worker"):
        Evaluator(client).evaluate_global()


# ---------------------------------------------------------------------- the CLI
def run_eval(argv: list[str], capsys) -> tuple[int, str]:
    args = app.build_parser().parse_args(["eval", *argv])
    code = args.func(args)
    return code, capsys.readouterr().out


def test_eval_prints_the_loss_once(trained, capsys, one_thread):
    srv, _, _ = trained
    code, out = run_eval(["--server", srv.address], capsys)
    assert code == 0
    assert out == f"version 2: held-out loss {direct_loss(srv):.4f} nats/char\n"


def test_eval_json_every_stops_after_max_evals(trained, capsys, one_thread):
    import json

    srv, _, _ = trained
    code, out = run_eval(["--server", srv.address, "--every", "0.01", "--max-evals", "1", "--json"], capsys)
    line = json.loads(out)
    assert code == 0 and line["version"] == 2 and line["num_tokens"] == 16384
    assert line["loss_nats_per_char"] == pytest.approx(direct_loss(srv), rel=1e-6)


def test_a_model_other_than_the_servers_is_refused_naming_the_parameter(trained, cli_exit):
    srv, _, _ = trained
    code, err = cli_exit(["eval", "--server", srv.address, "--n-embd", "64"])
    assert code == 1
    assert "does not match the global model" in err and "'tok_emb.weight': shape" in err


def test_bad_eval_flags_are_refused(cli_exit):
    assert "--max-evals needs --every" in cli_exit(["eval", "--server", "127.0.0.1:1", "--max-evals", "2"])[1]
    assert "give seconds > 0" in cli_exit(["eval", "--server", "127.0.0.1:1", "--every", "-1"])[1]


def test_a_server_that_cannot_be_reached_is_one_line_like_status(cli_exit):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, err = cli_exit(["eval", "--server", f"127.0.0.1:{port}"])
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err
    assert f"cannot reach the server at 127.0.0.1:{port}" in err and "check --server" in err
