"""Push and pull headers carry a CRC-32 of their own (wire/header_crc.py): a flipped bit
in a header is refused as ``payload_corrupted`` and resent, on gRPC and on the bulk
channel; push ids below 1 are refused; a bulk channel that corrupts every resend of a
push hands it to gRPC."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from asyncdiloco import AsyncDiLoCoWorker, WorkerConfig
from asyncdiloco.errors import InvalidPayloadError, PayloadCorruptedError, UnknownVersionError
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.header_crc import check_header, header_crc, seal
from asyncdiloco.worker import bulk_client

pytestmark = pytest.mark.timeout(120)

H = 2


def _worker(start_server, bulk: bool) -> tuple:
    srv = start_server(bulk_port=0, local_steps=H, grouping="off", dylu=False)
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    worker = AsyncDiLoCoWorker(
        model, opt, WorkerConfig(server=srv.address, worker_name="a", join_timeout_s=10, bulk_channel=bulk)
    )
    worker.client.resend_backoff_s = 0.001
    return srv, model, opt, worker


def _steps(model: nn.Module, opt: torch.optim.Optimizer, n: int) -> None:
    for _ in range(n):
        model(torch.randn(3, 8)).sum().backward()
        opt.step()
        opt.zero_grad()


def _in_step(srv, model: nn.Module) -> bool:
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    return torch.equal(flat, srv.state.params)


# ------------------------------------------------------------------- unit
def _sealed_headers() -> list:
    run_config = pb.RunConfig(local_steps=4, chunk_bytes=1 << 20, mode="async", wire_codec="raw", bulk_port=9)
    push = pb.PushHeader(worker_id=3, push_id=6, base_version=5, total_bytes=4096, num_chunks=1, crc32=77, kind=1)
    pull = pb.PullHeader(version=24, total_bytes=4096, num_chunks=1, crc32=77, run_config=run_config, round=0)
    return [seal(push), seal(pull)]


@pytest.mark.parametrize("header", _sealed_headers(), ids=["push", "pull"])
def test_every_single_flipped_bit_of_a_header_is_caught(header):
    raw = header.SerializeToString()
    check_header(type(header).FromString(raw), "intact")  # no refusal
    for bit in range(8 * len(raw)):
        bad = bytearray(raw)
        bad[bit // 8] ^= 1 << (bit % 8)
        try:
            parsed = type(header).FromString(bytes(bad))
        except Exception:  # noqa: BLE001 - does not parse: refused anyway
            continue
        with pytest.raises(PayloadCorruptedError, match="corrupted in transit"):
            check_header(parsed, f"bit {bit}")


def test_a_header_without_a_crc_is_refused_as_corrupted():
    header = pb.PushHeader(worker_id=3, push_id=6)
    with pytest.raises(PayloadCorruptedError, match="no header_crc32"):
        check_header(header, "an unsealed one")  # every sender seals: a missing CRC was lost in transit
    assert header_crc(seal(header)) == header.header_crc32 != 0
    check_header(header, "the sealed one")
    # A flip that turns a tag into a length-delimited field swallowing the CRC's own field.
    swallowed = pb.PushHeader.FromString(pb.PushHeader(worker_id=3).SerializeToString() + b"\x7a\x02\x10\x06")
    assert swallowed.header_crc32 == 0
    with pytest.raises(PayloadCorruptedError, match="corrupted in transit"):
        check_header(swallowed, "a swallowed one")


# ----------------------------------------------------------- header flips
def _flip_push_id_over_bulk(monkeypatch, left: dict) -> None:
    real = bulk_client.BulkChannel._push

    def flipping(self, sock, deadline, header, view):
        if left["n"] > 0 and header.kind == pb.PUSH_KIND_PSEUDO_GRADIENT:
            left["n"] -= 1
            bad = pb.PushHeader()
            bad.CopyFrom(header)
            bad.push_id ^= 64  # push 6 travels as push 70 (header_crc32 still the sender's)
            header = bad
        return real(self, sock, deadline, header, view)

    monkeypatch.setattr(bulk_client.BulkChannel, "_push", flipping)


class _FlippingPush:
    """Wraps the client's Push callable: the first header of the next ``left["n"]`` pushes
    arrives with push_id ^ 64."""

    def __init__(self, real, left: dict) -> None:
        self._real, self._left = real, left

    def with_call(self, messages, **kw):
        def flipped():
            for msg in messages:
                if isinstance(msg, pb.PushMessage) and msg.WhichOneof("body") == "header" and self._left["n"] > 0:
                    if msg.header.kind == pb.PUSH_KIND_PSEUDO_GRADIENT:
                        self._left["n"] -= 1
                        bad = pb.PushMessage()
                        bad.CopyFrom(msg)
                        bad.header.push_id ^= 64
                        msg = bad
                yield msg

        return self._real.with_call(flipped(), **kw)


class _FlippingPushOne:
    """Wraps the client's PushOne callable: the next ``left["n"]`` pseudo-gradient pushes
    arrive with push_id ^ 64."""

    def __init__(self, real, left: dict) -> None:
        self._real, self._left = real, left

    def with_call(self, request: bytes, **kw):
        parsed = pb.PushRequest.FromString(request)
        if parsed.header.kind == pb.PUSH_KIND_PSEUDO_GRADIENT and self._left["n"] > 0:
            self._left["n"] -= 1
            parsed.header.push_id ^= 64
            request = parsed.SerializeToString()
        return self._real.with_call(request, **kw)


@pytest.mark.parametrize("path", ["bulk", "grpc-stream", "grpc-one"])
def test_a_flipped_push_id_is_resent_and_the_worker_goes_on(start_server, monkeypatch, path):
    bulk = path == "bulk"
    srv, model, opt, worker = _worker(start_server, bulk)
    left = {"n": 0}
    if bulk:
        _flip_push_id_over_bulk(monkeypatch, left)
    elif path == "grpc-stream":
        worker.client._push_one = None  # noqa: SLF001 - as for a server without PushOne
        worker.client._push = _FlippingPush(worker.client._push, left)  # noqa: SLF001
    else:
        worker.client._push_one = _FlippingPushOne(worker.client._push_one, left)  # noqa: SLF001
    with worker:
        assert (worker.client.bulk_port > 0) == bulk
        _steps(model, opt, 4 * H)
        rec = srv.state.registry.workers.get(worker.worker_id)
        mark, applied = rec.last_push_id, worker.stats.pushes_applied
        left["n"] = 1
        _steps(model, opt, 4 * H)
        assert left["n"] == 0, "the flip was not injected"
        assert worker.stats.pushes_applied == applied + 4 and worker.stats.drops == {}
        assert worker.stats.corrupted_transfers == 1 and rec.last_push_id == mark + 4
        assert srv.state.status().rejected_pushes == 1
        if bulk:  # resent on a fresh bulk connection, not handed to gRPC
            assert worker.client._bulk.fallbacks == 0  # noqa: SLF001
        assert _in_step(srv, model)


def _flip_pull_version_over_bulk(monkeypatch, left: dict) -> None:
    real = bulk_client.BulkChannel._reply

    def flipping(self, sock, deadline, body):
        reply = real(self, sock, deadline, body)
        if body == "pull" and left["n"] > 0:
            left["n"] -= 1
            reply.pull.version ^= 4  # version 3 arrives as version 7
        return reply

    monkeypatch.setattr(bulk_client.BulkChannel, "_reply", flipping)


class _FlippingPullStream:
    def __init__(self, stream, left: dict) -> None:
        self._stream, self._left, self._first = stream, left, True

    def __iter__(self):
        return self

    def __next__(self):
        msg = next(self._stream)
        if self._first and self._left["n"] > 0:
            self._left["n"] -= 1
            msg = pb.PullMessage.FromString(msg.SerializeToString())
            msg.header.version ^= 4
        self._first = False
        return msg

    def cancel(self) -> None:
        self._stream.cancel()


@pytest.mark.parametrize("bulk", [True, False], ids=["bulk", "grpc"])
def test_a_flipped_pull_version_is_pulled_again_and_the_worker_goes_on(start_server, monkeypatch, bulk):
    srv, model, opt, worker = _worker(start_server, bulk)
    left = {"n": 0}
    if bulk:
        _flip_pull_version_over_bulk(monkeypatch, left)
    else:
        real = worker.client._pull_stream  # noqa: SLF001
        worker.client._pull_stream = lambda *a, **k: _FlippingPullStream(real(*a, **k), left)  # noqa: SLF001
    with worker:
        assert (worker.client.bulk_port > 0) == bulk
        _steps(model, opt, 4 * H)
        applied = worker.stats.pushes_applied
        left["n"] = 1
        _steps(model, opt, 4 * H)
        assert left["n"] == 0, "the flip was not injected"
        assert worker.stats.pushes_applied == applied + 4 and worker.stats.drops == {}
        assert worker.stats.corrupted_transfers == 1 and worker.version == srv.state.version
        assert srv.state.status().rejected_pushes == 0
        assert _in_step(srv, model)


# -------------------------------------------------------------- push ids
@pytest.mark.parametrize("push_id", [0, -5])
def test_a_push_id_below_1_is_refused_with_nothing_changed(start_server, push_id):
    srv, model, opt, worker = _worker(start_server, bulk=False)
    with worker:
        _steps(model, opt, 2 * H)
        rec = srv.state.registry.workers.get(worker.worker_id)
        mark, version, theta = rec.last_push_id, srv.state.version, srv.state.params.clone()
        payload = worker.manifest.pack_flat(torch.zeros(worker.manifest.numel))
        with pytest.raises(InvalidPayloadError, match=f"push_id is {push_id}; the smallest is 1") as info:
            worker.client.push(payload, worker_id=worker.worker_id, push_id=push_id, base_version=version)
        assert info.value.grpc_code.name == "INVALID_ARGUMENT"
        assert rec.last_push_id == mark and srv.state.version == version and torch.equal(srv.state.params, theta)


# ------------------------------------------------------ bulk -> gRPC fallback
def test_a_bulk_channel_that_corrupts_every_push_hands_it_to_grpc(start_server, monkeypatch):
    srv, model, opt, worker = _worker(start_server, bulk=True)
    real = bulk_client.BulkChannel._push
    corrupted = {"n": 0}

    def corrupting(self, sock, deadline, header, view):
        if header.kind == pb.PUSH_KIND_PSEUDO_GRADIENT:
            corrupted["n"] += 1
            bad = bytearray(view)
            bad[len(bad) // 3] ^= 0x04
            view = memoryview(bytes(bad))
        return real(self, sock, deadline, header, view)

    monkeypatch.setattr(bulk_client.BulkChannel, "_push", corrupting)
    with worker:
        assert worker.client.bulk_port > 0
        _steps(model, opt, 3 * H)  # no exception escapes opt.step()
        tries = 1 + worker.client.corrupted_resends
        assert corrupted["n"] >= tries and worker.stats.pushes_applied == 3 and worker.stats.drops == {}
        assert worker.client._bulk._down  # noqa: SLF001 - marked as when it is down
        assert _in_step(srv, model)


def test_the_push_after_a_refused_one_is_applied_though_the_mark_did_not_move(start_server):
    """Why the server bounds push ids from below only: the mark moves on applied pushes, so
    a worker's next id after a refusal is 2 past it (docs/protocol.md, duplicate replies)."""
    srv, model, opt, worker = _worker(start_server, bulk=False)
    with worker:
        _steps(model, opt, H)
        rec = srv.state.registry.workers.get(worker.worker_id)
        mark, version = rec.last_push_id, srv.state.version
        payload = worker.manifest.pack_flat(torch.zeros(worker.manifest.numel))
        with pytest.raises(UnknownVersionError):  # a base version from the future
            worker.client.push(payload, worker_id=worker.worker_id, push_id=mark + 1, base_version=version + 5)
        assert rec.last_push_id == mark
        reply = worker.client.push(payload, worker_id=worker.worker_id, push_id=mark + 2, base_version=version)
        assert reply.applied and rec.last_push_id == mark + 2
