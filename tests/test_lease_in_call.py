"""A push in progress keeps its worker's lease (registry.py ``begin_call``).

The server's clock is a ``FakeClock`` moved by hand; the held reply waits in a thread
(``GroupGate.wait`` rechecks every ``RECHECK_S`` real seconds, reading the fake clock).
The client here never heartbeats: only its own calls renew its lease, as for a client
written from the protocol alone.
"""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import FakeClock

from asyncdiloco.errors import PayloadCorruptedError, UnknownWorkerError
from asyncdiloco.ps.config import ServerConfig
from asyncdiloco.ps.state import ParameterServerState
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.header_crc import seal
from asyncdiloco.wire.tensors import Manifest

LEASE_S = 60.0
H = 20
MANIFEST = Manifest.from_named_tensors([("w", torch.zeros(4))])


def _state() -> tuple[ParameterServerState, FakeClock]:
    clock = FakeClock()
    state = ParameterServerState(ServerConfig(port=0, local_steps=H, lease_s=LEASE_S, grouping="window"), clock=clock)
    return state, clock


def _push(state: ParameterServerState, worker_id: int, push_id: int, compute_s: float):
    payload = MANIFEST.pack([torch.full((4,), 0.01)])
    version = state.version
    return state.intake.push(
        payload, worker_id=worker_id, push_id=push_id, base_version=version, num_local_steps=H, compute_s=compute_s
    )


def _alive(state: ParameterServerState, worker_id: int) -> bool:
    return next(w.alive for w in state.status().workers if w.worker_id == worker_id)  # leases checked now


@pytest.mark.timeout(60)
@pytest.mark.parametrize("window_s", [58.0, 90.0], ids=["just-under-the-lease", "over-the-lease"])
def test_a_reply_held_by_a_window_from_a_slow_rate_keeps_the_pushers_lease(window_s):
    state, clock = _state()
    rate = H / window_s  # the auto window: one round of the fastest worker, H / v
    slow, _, _ = state.join(MANIFEST, "slow", steps_per_s=rate)  # expected in the group, never pushes
    state.intake.push(MANIFEST.pack([torch.zeros(4)]), worker_id=slow, push_id=1, kind=pb.PUSH_KIND_INITIAL_PARAMETERS)
    client, _, _ = state.join(MANIFEST, "client", steps_per_s=rate)
    assert state.run_config(client).group_window_s == pytest.approx(window_s)
    out = _push(state, client, 2, compute_s=window_s)  # its lease renewed now, at t = 0
    replies: list[pb.PushReply] = []
    held = threading.Thread(target=lambda: replies.append(state.intake.reply(out, client)))
    held.start()
    try:
        clock.now = LEASE_S / 2
        state.heartbeat(slow)  # the worker the group waits for heartbeats (the client does not)
        clock.now = LEASE_S + 1.0  # past the lease from the push, the reply still held when window_s > lease
        assert _alive(state, client), "a worker whose reply the server holds keeps its lease"
        clock.now = window_s + 1.0  # the window ended: the reply goes out
        held.join(timeout=30)
        assert not held.is_alive() and replies[0].applied
    finally:
        state.groups.close()  # releases a reply still held (a failed assertion above)
        held.join(timeout=30)
    clock.advance(0.9 * LEASE_S)  # the lease runs from the reply, not from the push's arrival
    assert _alive(state, client)
    state.heartbeat(client)  # still registered: no UnknownWorkerError
    clock.advance(LEASE_S + 1.0)
    assert not _alive(state, slow), "silence still ends a lease"


def test_an_upload_longer_than_the_lease_keeps_the_pushers_lease(monkeypatch):
    state, clock = _state()
    worker, _, _ = state.join(MANIFEST, "w")
    state.intake.push(
        MANIFEST.pack([torch.zeros(4)]), worker_id=worker, push_id=1, kind=pb.PUSH_KIND_INITIAL_PARAMETERS
    )
    receive = state.intake.receive

    def slow_upload(header, fill, drain, is_active=None):
        def slowly(assembler):
            clock.advance(LEASE_S + 10.0)  # the payload's bytes take longer than a lease to arrive
            fill(assembler)

        return receive(header, slowly, drain, is_active)

    monkeypatch.setattr(state.intake, "receive", slow_upload)
    assert _push(state, worker, 2, compute_s=1.0).applied
    assert _alive(state, worker)
    monkeypatch.undo()
    clock.advance(LEASE_S + 1.0)  # a lease that lapsed before a push stays lapsed
    with pytest.raises(UnknownWorkerError, match="no longer registered"):
        _push(state, worker, 3, compute_s=1.0)


def test_a_push_whose_header_is_corrupted_does_not_renew_the_lease_of_the_worker_it_names():
    """The worker id of a header whose CRC fails is not trusted: its lease is not kept or
    renewed by the refused call (every transport hands the header to ``intake.receive``)."""
    state, clock = _state()
    wid, _, _ = state.join(MANIFEST, "w")
    clock.now = LEASE_S - 1.0
    header = seal(pb.PushHeader(worker_id=wid, push_id=1, kind=pb.PUSH_KIND_INITIAL_PARAMETERS, total_bytes=16))
    header.num_tokens = 7  # changed after the seal: corrupted in transit
    with pytest.raises(PayloadCorruptedError):
        state.intake.receive(header, fill=lambda _: None, drain=lambda: None)
    clock.now = LEASE_S + 1.0
    assert not _alive(state, wid)
