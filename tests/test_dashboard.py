"""The dashboard, /status.json and ReportEval (ps/watch/dashboard.py, ps/watch/monitor.py, the
state's report_eval), over HTTP and gRPC on 127.0.0.1, and the version history's bounds."""

from __future__ import annotations

import logging
import math
import urllib.error
import urllib.request

import grpc
import pytest
import torch
from google.protobuf import json_format
from helpers import assert_same, fingerprint
from prometheus_client.parser import text_string_to_metric_families

from asyncdiloco.errors import InvalidPayloadError
from asyncdiloco.ps.watch.dashboard import RunHistory, render
from asyncdiloco.tools.status_view import status_dict
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire._proto import parameter_server_pb2_grpc as pb_grpc
from asyncdiloco.wire.tensors import Manifest
from asyncdiloco.worker.client import ParameterServerClient

pytestmark = pytest.mark.timeout(60)

MANIFEST = Manifest.from_named_tensors([("w", torch.zeros(4))])
NASTY = '<script>alert("x")</script>'


def get(srv, path: str) -> tuple[int, str, str]:
    """(status, content type, body) of GET ``path`` on the metrics port."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}{path}", timeout=10) as reply:
            return reply.status, reply.headers["Content-Type"], reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.headers["Content-Type"], err.read().decode()


@pytest.fixture
def run(start_server):
    """A server with the metrics port, initialized by a worker named ``NASTY``, one push applied."""
    srv = start_server(metrics_port=0, grouping="off", dylu=False)
    client = ParameterServerClient(srv.address)
    wid = client.join(MANIFEST, NASTY).worker_id
    client.push(
        MANIFEST.pack([torch.zeros(4)]), worker_id=wid, push_id=1, base_version=0, kind=pb.PUSH_KIND_INITIAL_PARAMETERS
    )
    client.push(MANIFEST.pack([torch.ones(4)]), worker_id=wid, push_id=2, base_version=0)
    yield srv, client
    client.close()


def test_the_page_shows_the_run_escaped_with_svg_and_no_external_reference(run):
    srv, client = run
    client.report_eval(1, 2.5, 1000, evaluator="held-out")
    status, content_type, page = get(srv, "/")
    assert status == 200 and content_type.startswith("text/html")
    assert NASTY not in page and "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in page
    assert page.count("<svg") == 3  # version over time, held-out loss, staleness histogram
    assert "Held-out loss" in page and "no evaluator has reported yet" not in page
    assert '<meta http-equiv="refresh"' in page
    assert "http://" not in page and "https://" not in page and "<script" not in page


def test_status_json_is_the_status_reply(run):
    srv, client = run
    client.report_eval(1, 2.5, 1000)
    status, content_type, body = get(srv, "/status.json")
    assert status == 200 and content_type == "application/json"
    st = json_format.Parse(body, pb.StatusReply())
    assert st.version == 1 and st.workers[0].worker_name == NASTY and st.evals[0].loss == 2.5
    assert st.server_version and st.workers[0].state == "training"


def test_other_paths_are_not_found(run):
    srv, _ = run
    assert get(srv, "/nope")[0] == 404


def test_a_valid_report_is_kept_in_the_status(run):
    srv, client = run
    client.report_eval(0, 3.0, 10, evaluator="e")
    client.report_eval(1, 2.0, 10, evaluator="e")
    evals = client.status().evals
    assert [(e.version, e.loss, e.num_tokens, e.evaluator) for e in evals] == [(0, 3.0, 10, "e"), (1, 2.0, 10, "e")]


@pytest.mark.parametrize(
    "version, loss, num_tokens, needle",
    [
        (1, math.nan, 10, "must be finite"),
        (1, math.inf, 10, "must be finite"),
        (1, 2.0, 0, "num_tokens is 0"),
        (2, 2.0, 10, "must be in [0, 1]"),  # the server is at version 1
        (-1, 2.0, 10, "must be in [0, 1]"),
        (1, -0.5, 10, "loss is -0.5 nats per token; it must be in [0, 10000]"),
        (1, 2e4, 10, "loss is 20000 nats per token; it must be in [0, 10000]"),
    ],
)
def test_an_invalid_report_is_refused_and_changes_nothing(run, version, loss, num_tokens, needle):
    srv, client = run
    before, status_before = fingerprint(srv.state), client.status()
    stub = pb_grpc.ParameterServerStub(grpc.insecure_channel(srv.address))
    with pytest.raises(grpc.RpcError) as refused:
        stub.ReportEval(pb.EvalReport(version=version, loss=loss, num_tokens=num_tokens), timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in refused.value.details()
    with pytest.raises(InvalidPayloadError):  # the client raises the library's exception
        client.report_eval(version, loss, num_tokens)
    assert_same(before, fingerprint(srv.state))
    assert not client.status().evals and client.status().applied_pushes == status_before.applied_pushes


def test_the_version_history_stays_bounded_and_covers_the_whole_run():
    history = RunHistory(max_points=8, spacing_s=1.0)
    for t in range(100):
        history.sample(float(t), t // 2)
    points = history.points()
    assert len(points) <= 8 and points[0] == (0.0, 0)
    assert points[-1][0] >= 100 - 2 * history.spacing_s  # the newest stretch is still there
    assert all(b[0] - a[0] >= 1.0 for a, b in zip(points, points[1:], strict=False))


def test_a_page_without_workers_or_evals_says_so():
    page = render(pb.StatusReply(run_config=pb.RunConfig(mode="async")), [])
    assert "no worker has joined yet" in page and "no evaluator has reported yet" in page
    assert "waiting for the first worker" in page


def test_the_run_table_shows_what_the_mode_uses_with_short_numbers():
    config = pb.RunConfig(mode="async", group_window_s=2.75534782131024, round_timeout_s=60.0, min_workers=1)
    page = render(pb.StatusReply(run_config=config), [])
    assert "2.755" in page and "2.7553478" not in page
    assert "round_timeout_s" not in page and "min_workers" not in page  # sync settings, not an async run's
    config.mode, config.grouping = "sync", "off"
    page = render(pb.StatusReply(run_config=config, staleness_weighting="constant"), [])
    assert "round_timeout_s" in page and "contributions/s" in page
    assert "pushes/s" not in page and "staleness weighting" not in page and "grouping" not in page
    workers = [pb.WorkerStatus(worker_id=1, worker_name="s0", state="training", applied_pushes=7, alive=True)]
    page = render(pb.StatusReply(run_config=config, workers=workers, staleness_histogram=[7, 0]), [])
    assert "Staleness τ" not in page and "mean τ" not in page and "v_w" not in page and "contributions" in page


def _eval_gauges(srv) -> tuple[float, float]:
    """(asyncdiloco_eval_loss_nats, asyncdiloco_eval_version) of the server's /metrics."""
    text = get(srv, "/metrics")[2]
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return samples["asyncdiloco_eval_loss_nats"], samples["asyncdiloco_eval_version"]


def test_the_newest_eval_is_the_highest_version_everywhere(run):
    """A slow evaluator's late report of an older version does not replace a newer one
    (ties: the later report), in the status, the metrics and the dashboard's chart."""
    srv, client = run
    client.report_eval(1, 2.0, 10, evaluator="fast")
    client.report_eval(0, 3.0, 10, evaluator="slow")  # measured before, received after
    assert status_dict(client.status())["eval"]["version"] == 1
    assert _eval_gauges(srv) == (2.0, 1.0)
    page = get(srv, "/")[2]
    loss_chart = page.split("Held-out loss by version")[1].split("</svg>")[0]
    xs = [float(pair.split(",")[0]) for pair in loss_chart.split('points="')[1].split('"')[0].split()]
    assert xs == sorted(xs) and xs[0] < xs[-1]  # version 0 drawn left of version 1
    client.report_eval(1, 2.25, 10, evaluator="again")
    assert status_dict(client.status())["eval"]["evaluator"] == "again" and _eval_gauges(srv) == (2.25, 1.0)


def test_a_refused_reports_log_line_shows_a_short_escaped_name(run, caplog):
    srv, client = run
    huge = "x" * 5000 + "\nINFO forged line"
    with caplog.at_level(logging.INFO, logger="asyncdiloco.ps"), pytest.raises(InvalidPayloadError):
        client.report_eval(1, 2.0, 10, evaluator=huge)
    (line,) = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(line) < 400 and "\n" not in line and "x" * 81 not in line and "5017 characters" in line
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="asyncdiloco.ps"):
        client.report_eval(1, 2.0, 10, evaluator="two\nlines")
    assert any("'two\\nlines'" in r.getMessage() for r in caplog.records)
