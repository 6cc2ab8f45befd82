"""Deadlines follow the waits the server announces (issue 15, item 6).

Scaled down from the issue's 15 s grouping wait and 10 s deadline to seconds: every wait
a call can meet on the server ends within the call's deadline, and a push whose deadline
expired anyway is answered as applied when retried with its push id.

- a push reply is held at most the ``group_max_wait_s`` the worker was told in its
  previous PushReply (or its JoinReply), which its deadline covers, even once the window
  grew past it (an auto window announced before the rates were known), over gRPC and
  over the bulk channel (which carries no deadline);
- a pull that finds every snapshot slot taken waits for one no longer than its deadline
  allows, then is served the newest snapshot there is;
- the push a closing worker sends is retried with its push id when its deadline expired
  while the server applied it (a slow apply of another push ahead of it): it is counted
  applied, once, and the CLI's final line says so.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
from helpers import STUCK_S
from torch import nn

from asyncdiloco.algo.config import OuterConfig
from asyncdiloco.errors import ServerUnavailableError
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.tensors import Manifest
from asyncdiloco.worker.async_worker import AsyncDiLoCoWorker
from asyncdiloco.worker.client import ParameterServerClient
from asyncdiloco.worker.config import WorkerConfig
from asyncdiloco.worker.stats import WorkerStats

pytestmark = pytest.mark.timeout(60)

MANIFEST = Manifest.from_named_tensors([("w", torch.zeros(1000))])
#: A worker's deadline for small calls in these tests, seconds (10 s by default).
RPC_TIMEOUT_S = 2.0


def _initialized(srv) -> tuple[ParameterServerClient, int]:
    """A client joined as the first worker of ``srv``, the initial parameters pushed."""
    client, reply = _joined(srv)
    assert reply.initialize
    _push_initial(client, reply.worker_id)
    return client, reply.worker_id


def _push_initial(client: ParameterServerClient, worker_id: int) -> None:
    initial = MANIFEST.pack([torch.zeros(1000)])
    client.push(initial, worker_id=worker_id, push_id=1, base_version=0, kind=pb.PUSH_KIND_INITIAL_PARAMETERS)


def _joined(srv) -> tuple[ParameterServerClient, pb.JoinReply]:
    client = ParameterServerClient(srv.address, rpc_timeout_s=RPC_TIMEOUT_S)
    return client, client.join(MANIFEST, "a")


@pytest.mark.parametrize("transport", ["grpc", "bulk"])
def test_a_reply_is_held_no_longer_than_the_wait_the_worker_was_told(start_server, transport):
    # Auto window: 1 s while no rate is known, which is what a's Join announces. a reports
    # 2 inner steps/s, b 0.3: the window becomes 1.5 / 0.3 = 5 s, longer than a's push
    # deadline (RPC_TIMEOUT_S + the 1 s it was told). Before the fix the bulk channel held
    # the reply the whole 5 s: the call timed out and was resent over gRPC as a duplicate.
    srv = start_server(grouping="window", dylu=False, local_steps=5, bulk_port=0 if transport == "bulk" else None)
    a, joined = _joined(srv)
    a_id, told_s = joined.worker_id, joined.run_config.group_max_wait_s
    assert told_s == pytest.approx(1.0)
    _push_initial(a, a_id)
    b = ParameterServerClient(srv.address, rpc_timeout_s=RPC_TIMEOUT_S)
    b_id = b.join(MANIFEST, "b").worker_id
    a.heartbeat(a_id, steps_per_s=2.0)  # b's 0.3 is within RATE_SPREAD (10x) of it: not clamped
    assert b.heartbeat(b_id, steps_per_s=0.3).group_max_wait_s == pytest.approx(5.0)
    assert (a.bulk_port > 0) == (transport == "bulk")

    delta = torch.zeros(MANIFEST.total_bytes, dtype=torch.uint8)
    reply = a.push(delta, worker_id=a_id, push_id=2, base_version=0, num_local_steps=5)

    assert reply.applied and not reply.duplicate, "the push was answered on its first attempt"
    assert reply.held_s <= told_s + 0.5  # not the 5 s window (the 0.5 s: scheduling slack)
    assert reply.group_max_wait_s == pytest.approx(5.0)  # the next push may be held that long
    if transport == "bulk":
        assert a._bulk is not None and a._bulk.fallbacks == 0  # noqa: SLF001
    assert srv.state.status().version == 1 and srv.state.status().duplicate_pushes == 0
    for client in (a, b):
        client.close()


@pytest.mark.parametrize("codec", ["bf16", "raw"])
def test_a_pull_waits_for_a_snapshot_slot_no_longer_than_its_deadline(start_server, codec):
    # An encoded model: one snapshot slot, held by an observer's pull of version 0 that has
    # not finished; version 1 cannot be encoded until it does. The server waited up to 10 s
    # for the slot (its own constant), past the worker's deadline: the pull failed
    # DEADLINE_EXCEEDED. A raw fp32 model's pulls read θ in place (ps/pull/live_view.py): no slot,
    # the newest version at once.
    outer = OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0)
    srv = start_server(grouping="off", pull_snapshots=1, outer=outer, wire_codec=codec)
    a, a_id = _initialized(srv)
    slow_pull = srv.state.open_pull(pb.PullRequest(worker_id=0))
    try:
        assert slow_pull.header.version == 0
        delta = torch.full((1000,), 0.5)
        payload = MANIFEST.pack([delta]) if codec == "raw" else delta.to(torch.bfloat16).view(torch.uint8)
        assert a.push(payload, worker_id=a_id, push_id=2, base_version=0, num_local_steps=1).version == 1
        started = time.monotonic()
        pulled = a.pull(MANIFEST, a_id)
        took_s = time.monotonic() - started
    finally:
        srv.state.snapshots.close_pull(slow_pull)
    assert pulled.version == (0 if codec == "bf16" else 1), "served the newest snapshot there is"
    assert took_s < a._payload_timeout(MANIFEST.total_bytes)  # noqa: SLF001 - within its deadline
    assert a.pull(MANIFEST, a_id).version == 1  # the slot is free again: the newest version
    a.close()


def test_a_final_push_whose_deadline_expired_while_it_was_applied_counts_as_applied(start_server, caplog):
    # Another push's outer step holds the apply lock longer than the closing worker's push
    # deadline: the final push expires on the worker, then the server applies it. Before the
    # fix close() logged "final push failed" and counted it as not applied.
    srv = start_server(grouping="off", dylu=False, local_steps=100, outer=OuterConfig(optimizer="sgd", lr=1.0))
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = WorkerConfig(server=srv.address, rpc_timeout_s=1.0, initial_backoff_s=0.05, max_backoff_s=0.2)
    worker = AsyncDiLoCoWorker(model, opt, config)
    worker.join()
    for _ in range(3):  # fewer than H: the final push carries them
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()

    expired = threading.Event()
    send = worker.client.push

    def push(*args, **kwargs):
        try:
            return send(*args, **kwargs)
        except ServerUnavailableError:
            expired.set()
            raise

    worker.client.push = push  # type: ignore[method-assign]
    apply_lock = srv.state.locks.apply
    assert apply_lock.acquire(timeout=STUCK_S)  # a slow outer step of another push
    closing = threading.Thread(target=worker.close, daemon=True)
    with caplog.at_level(logging.INFO, logger="asyncdiloco"):
        closing.start()
        try:
            assert expired.wait(STUCK_S), "the final push's deadline never expired"
        finally:
            apply_lock.release()  # the server applies the push now
        closing.join(STUCK_S)
    assert not closing.is_alive()

    st = srv.state.status()
    assert st.version == 1 and st.applied_pushes == 1  # the final push, once
    assert st.duplicate_pushes == 1  # its retry, answered with its outcome
    assert worker.stats.pushes_applied == 1 and worker.stats.pushes_refused == 0
    assert worker.stats.final_push == "applied"
    assert "final push failed" not in caplog.text and "not acknowledged" not in caplog.text


def test_the_cli_final_line_says_what_became_of_the_final_push():
    from asyncdiloco.cli.worker import _final_line

    stats = WorkerStats(inner_steps=3, pushes_applied=1, final_push="applied")
    assert _final_line("w", stats).endswith(", final push applied")
    assert "final push" not in _final_line("w", WorkerStats(inner_steps=3))


def test_every_reply_that_announces_the_wait_is_learnt(start_server):
    # Join, Heartbeat, Pull and Push replies all carry group_max_wait_s; a push's deadline
    # covers the one of the worker's newest Join/Push reply (what the server holds it to)
    # and any longer one announced since.
    srv = start_server(grouping="window", grace_s=1.5, dylu=False)
    a, a_id = _initialized(srv)
    payload_s = a._payload_timeout(MANIFEST.total_bytes)  # noqa: SLF001
    assert a._push_timeout(MANIFEST.total_bytes, a_id) == pytest.approx(payload_s + 1.5)  # noqa: SLF001
    assert a.heartbeat(a_id).group_max_wait_s == pytest.approx(1.5)
    assert a.pull(MANIFEST, a_id).run_config.group_max_wait_s == pytest.approx(1.5)
    a.close()
