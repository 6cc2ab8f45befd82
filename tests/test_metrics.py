"""Prometheus metrics on the metrics port (ps/watch/metrics.py, ps/watch/grpc_metrics.py): scraped over
HTTP from in-process servers on 127.0.0.1 after known pushes, pulls and refusals."""

from __future__ import annotations

import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from asyncdiloco.errors import StalePushError, reason_codes
from asyncdiloco.ps.config import DurabilityConfig
from asyncdiloco.ps.watch.metrics import staleness_family
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.tensors import Manifest
from asyncdiloco.worker.client import ParameterServerClient

pytestmark = pytest.mark.timeout(60)

MANIFEST = Manifest.from_named_tensors([("w", torch.zeros(8))])


def scrape(srv) -> dict[tuple[str, frozenset], float]:
    """{(sample name, its labels): value} of the server's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=10) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    """The sample ``name`` with ``labels`` (0 when absent, as Prometheus reads a missing series)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def rpc(method: str, code: str = "OK", kind: str = "UNARY") -> dict[str, str]:
    return {
        "grpc_type": kind,
        "grpc_service": "asyncdiloco.v1.ParameterServer",
        "grpc_method": method,
        "grpc_code": code,
    }


def initialized(srv, **client_args) -> tuple[ParameterServerClient, int]:
    client = ParameterServerClient(srv.address, **client_args)
    wid = client.join(MANIFEST, "m1").worker_id
    client.push(
        MANIFEST.pack([torch.zeros(8)]), worker_id=wid, push_id=1, base_version=0, kind=pb.PUSH_KIND_INITIAL_PARAMETERS
    )
    return client, wid


@pytest.mark.parametrize("one_message", [False, True], ids=["Push", "PushOne"])
def test_counts_after_three_pushes_a_stale_one_and_a_pull(start_server, one_message):
    srv = start_server(metrics_port=0, grouping="off", dylu=False)
    client, wid = initialized(srv, one_message_pushes=one_message)
    delta = MANIFEST.pack([torch.full((8,), 0.01)])
    for push_id in (2, 3, 4):
        client.push(delta, worker_id=wid, push_id=push_id, base_version=srv.state.version, num_tokens=10)
    with pytest.raises(StalePushError):
        client.push(delta, worker_id=wid, push_id=5, base_version=99)  # from the future: never served
    client.pull(MANIFEST, wid)

    m = scrape(srv)
    assert value(m, "asyncdiloco_version") == 3
    assert value(m, "asyncdiloco_pushes_applied_total") == 3
    assert value(m, "asyncdiloco_pushes_refused_total", reason="unknown_version") == 1
    assert value(m, "asyncdiloco_tokens_total") == 30
    assert value(m, "asyncdiloco_pushed_bytes_total") == 3 * MANIFEST.total_bytes
    assert value(m, "asyncdiloco_pulled_bytes_total") == MANIFEST.total_bytes
    assert value(m, "asyncdiloco_push_staleness_versions_count") == 3
    assert value(m, "asyncdiloco_push_staleness_versions_bucket", le="0.0") == 3
    assert value(m, "asyncdiloco_outer_step_seconds_count") == 3
    assert value(m, "asyncdiloco_workers_live") == 1
    assert value(m, "asyncdiloco_workers", state="training") == 1
    # The gRPC conventions: the initial push and three pseudo-gradients OK, the one from the future refused.
    method, kind = ("PushOne", "UNARY") if one_message else ("Push", "CLIENT_STREAM")
    other = ("Push", "CLIENT_STREAM") if one_message else ("PushOne", "UNARY")
    assert value(m, "grpc_server_handled_total", **rpc(method, "OK", kind)) == 4
    assert value(m, "grpc_server_handled_total", **rpc(method, "INVALID_ARGUMENT", kind)) == 1
    push_labels = {k: v for k, v in rpc(method, kind=kind).items() if k != "grpc_code"}
    assert value(m, "grpc_server_started_total", **push_labels) == 5
    assert value(m, "grpc_server_handling_seconds_count", **push_labels) == 5
    other_labels = {k: v for k, v in rpc(other[0], kind=other[1]).items() if k != "grpc_code"}
    assert value(m, "grpc_server_started_total", **other_labels) == 0
    if not one_message:
        assert value(m, "grpc_server_msg_received_total", **push_labels) >= 10  # a header and a chunk each
    # A server stream is handled once its stream ended; its chunks are counted as sent.
    assert value(m, "grpc_server_handled_total", **rpc("Pull", "OK", "SERVER_STREAM")) == 1
    pull_labels = {k: v for k, v in rpc("Pull", kind="SERVER_STREAM").items() if k != "grpc_code"}
    assert value(m, "grpc_server_msg_sent_total", **pull_labels) == 2  # the header and one chunk
    assert value(m, "grpc_server_handled_total", **rpc("Join")) == 1
    client.close()


def test_refusals_on_the_bulk_channel_are_counted_by_reason(start_server):
    srv = start_server(metrics_port=0, bulk_port=0, grouping="off", dylu=False)
    client, wid = initialized(srv)
    assert client.bulk_port == srv.bulk_port > 0
    with pytest.raises(StalePushError):
        client.push(MANIFEST.pack([torch.ones(8)]), worker_id=wid, push_id=2, base_version=7)
    m = scrape(srv)
    assert value(m, "asyncdiloco_pushes_refused_total", reason="unknown_version") == 1
    assert value(m, "grpc_server_handled_total", **rpc("Push", "INVALID_ARGUMENT", "CLIENT_STREAM")) == 0
    assert value(m, "grpc_server_handled_total", **rpc("PushOne", "INVALID_ARGUMENT")) == 0
    client.close()


def test_two_servers_in_one_process_keep_their_own_registries(start_server):
    a = start_server(metrics_port=0, grouping="off")
    b = start_server(metrics_port=0, grouping="off")
    client, _ = initialized(a)
    assert a.metrics_port != b.metrics_port
    assert value(scrape(a), "grpc_server_handled_total", **rpc("Join")) == 1
    assert value(scrape(b), "grpc_server_handled_total", **rpc("Join")) == 0
    client.close()


def test_log_writes_and_checkpoints_are_timed(start_server, tmp_path):
    durability = DurabilityConfig(checkpoint_dir=str(tmp_path), checkpoint_every=1)
    srv = start_server(metrics_port=0, grouping="off", durability=durability)
    client, wid = initialized(srv)
    client.push(MANIFEST.pack([torch.ones(8)]), worker_id=wid, push_id=2, base_version=0)
    m = scrape(srv)
    assert value(m, "asyncdiloco_log_write_seconds_count") == 3  # the Join and two pushes
    assert value(m, "asyncdiloco_checkpoint_seconds_count") == 3  # at start-up and after each push
    client.close()


def test_metrics_are_off_by_default(start_server):
    srv = start_server()
    assert srv.metrics_port == 0 and srv.monitor is None


def test_the_staleness_histogram_keeps_its_buckets_and_counts_the_last_at_its_index():
    family = staleness_family([2, 0, 1, 3])  # τ = 0, 0, 2, and three of τ >= 3
    samples = {(s.name, s.labels.get("le")): s.value for s in family.samples}
    assert samples[("asyncdiloco_push_staleness_versions_bucket", "0.0")] == 2
    assert samples[("asyncdiloco_push_staleness_versions_bucket", "2.0")] == 3
    assert samples[("asyncdiloco_push_staleness_versions_bucket", "+Inf")] == 6
    assert samples[("asyncdiloco_push_staleness_versions_count", None)] == 6
    assert samples[("asyncdiloco_push_staleness_versions_sum", None)] == 2 + 9


def test_every_refusal_reason_is_exposed_at_zero_before_any_refusal(start_server):
    srv = start_server(metrics_port=0)
    m = scrape(srv)
    name = "asyncdiloco_pushes_refused_total"
    refused = {dict(labels)["reason"]: v for (sample, labels), v in m.items() if sample == name}
    assert set(refused) == {*reason_codes(), "cut_off"} and set(refused.values()) == {0.0}
    assert "stale_push" in refused and "invalid_payload" in refused
