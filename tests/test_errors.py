"""Refusals on the wire: every library exception the server raises comes back to the
client as the same class with the same message, over gRPC and over the bulk channel,
picked by its reason code (never by the message); the .proto's table of reasons and
status codes is errors.py's."""

from __future__ import annotations

import pathlib
import re
from concurrent import futures

import grpc
import pytest

import asyncdiloco.errors as errors
from asyncdiloco.errors import AsyncDiLoCoError, from_rpc_error
from asyncdiloco.ps.transport.bulk import BulkServer
from asyncdiloco.ps.transport.grpc_service import _abort
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.bulk_framing import BulkStatus, code_value
from asyncdiloco.worker.bulk_client import BulkChannel
from asyncdiloco.worker.client import ParameterServerClient

pytestmark = pytest.mark.timeout(60)

PROTO = pathlib.Path(__file__).resolve().parents[1] / "proto" / "asyncdiloco" / "v1" / "parameter_server.proto"


def _library_errors() -> list[type[AsyncDiLoCoError]]:
    found, todo = {AsyncDiLoCoError}, [AsyncDiLoCoError]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub.__module__ == errors.__name__ and sub not in found:
                found.add(sub)
                todo.append(sub)
    return sorted(found, key=lambda c: c.__name__)


ERRORS = _library_errors()


def _refusal(cls: type[AsyncDiLoCoError]) -> AsyncDiLoCoError:
    # The message starts like another class's would: the class must come from the reason.
    return cls(f"manifest mismatch: not initialized: value 3 of {cls.__name__} is over the limit 2; lower it")


# -------------------------------------------------------------------- gRPC
class _Refuser:
    """A gRPC server whose Heartbeat aborts with ``self.exc`` through the servicer's ``_abort``."""

    def __init__(self) -> None:
        self.exc: AsyncDiLoCoError | None = None

    def heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatReply:
        assert self.exc is not None
        _abort(context, self.exc)
        raise AssertionError("abort returned")


@pytest.fixture(scope="module")
def grpc_refuser():
    refuser = _Refuser()
    handler = grpc.method_handlers_generic_handler(
        "asyncdiloco.v1.ParameterServer",
        {
            "Heartbeat": grpc.unary_unary_rpc_method_handler(
                refuser.heartbeat,
                request_deserializer=pb.HeartbeatRequest.FromString,
                response_serializer=pb.HeartbeatReply.SerializeToString,
            )
        },
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), handlers=[handler])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    client = ParameterServerClient(f"127.0.0.1:{port}", bulk_channel=False)
    yield refuser, client
    client.close()
    server.stop(None)


@pytest.mark.parametrize("cls", ERRORS, ids=lambda c: c.__name__)
def test_every_refusal_comes_back_as_its_exception_over_grpc(grpc_refuser, cls):
    refuser, client = grpc_refuser
    refuser.exc = sent = _refusal(cls)
    with pytest.raises(AsyncDiLoCoError) as info:
        client.heartbeat(1)
    assert type(info.value) is cls and str(info.value) == str(sent)


# -------------------------------------------------------------------- bulk
class _RefusingState:
    """Enough of the server's state for the bulk server: every pull is refused with ``exc``."""

    def __init__(self) -> None:
        self.exc: AsyncDiLoCoError | None = None

    def open_pull(self, request: pb.PullRequest):
        assert self.exc is not None
        raise self.exc


@pytest.fixture(scope="module")
def bulk_refuser():
    state = _RefusingState()
    server = BulkServer(state, host="127.0.0.1", port=0).start()  # type: ignore[arg-type]
    channel = BulkChannel("127.0.0.1", server.port)
    yield state, channel
    channel.close()
    server.stop()


@pytest.mark.parametrize("cls", ERRORS, ids=lambda c: c.__name__)
def test_every_refusal_comes_back_as_its_exception_over_the_bulk_channel(bulk_refuser, cls):
    state, channel = bulk_refuser
    state.exc = sent = _refusal(cls)
    with pytest.raises(AsyncDiLoCoError) as info:
        channel.pull(pb.PullRequest(worker_id=1), 8, None, 1024, 10.0)
    assert type(info.value) is cls and str(info.value) == str(sent)
    assert channel.fallbacks == 0  # a refusal, not a connection failure


# ------------------------------------------------------- without a reason
@pytest.mark.parametrize(
    ("code", "reason", "expected"),
    [
        (grpc.StatusCode.UNAVAILABLE, "", errors.ServerUnavailableError),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "a_reason_from_a_newer_server", errors.PayloadTooLargeError),
        (grpc.StatusCode.UNAUTHENTICATED, "", errors.UnauthenticatedError),
        (grpc.StatusCode.DATA_LOSS, "", AsyncDiLoCoError),
    ],
)
def test_a_status_without_a_known_reason_maps_by_its_code_not_its_message(code, reason, expected):
    got = from_rpc_error(BulkStatus(code_value(code), "manifest mismatch: not initialized", reason))  # type: ignore[arg-type]
    assert type(got) is expected and "manifest mismatch: not initialized" in str(got)


def test_every_library_error_has_its_own_reason_and_a_refusal_code():
    reasons = [cls.reason for cls in ERRORS]
    assert len(set(reasons)) == len(reasons)
    assert all(re.fullmatch(r"[a-z]+(_[a-z]+)*", r) for r in reasons)
    for cls in ERRORS:
        assert errors.error_for_reason(cls.reason) is cls
        assert cls.grpc_code not in (grpc.StatusCode.OK, grpc.StatusCode.UNKNOWN)
    # what workers retry later are exactly the UNAVAILABLE refusals
    unavailable = {cls for cls in ERRORS if cls.grpc_code == grpc.StatusCode.UNAVAILABLE}
    assert all(any(issubclass(cls, r) for r in errors.RETRY_LATER) for cls in unavailable)
    assert all(r.grpc_code == grpc.StatusCode.UNAVAILABLE for r in errors.RETRY_LATER)


# ----------------------------------------------------- the documented table
_ROW = re.compile(r"^\s*(?://)?\s+([a-z]+(?:_[a-z]+)*)\s{2,}([A-Z]+(?:_[A-Z]+)*)\s{2,}(\S.*)$")


def _table(lines: list[str]) -> dict[str, str]:
    """reason -> status code name, from the rows of a "reason  status code  ..." table."""
    start = next(i for i, line in enumerate(lines) if re.search(r"\breason\s+status code\b", line))
    rows: dict[str, str] = {}
    for line in lines[start + 1 :]:
        m = _ROW.match(line)
        if m is None:
            break
        rows[m.group(1)] = m.group(2)
    return rows


def test_the_proto_and_errors_py_list_the_same_reasons_and_status_codes():
    classes = {cls.reason: cls.grpc_code.name for cls in ERRORS}
    docstring = _table((errors.__doc__ or "").splitlines())
    proto = _table(PROTO.read_text().splitlines())
    assert docstring == classes
    assert proto == classes
    names = {m.group(1): m.group(3) for line in (errors.__doc__ or "").splitlines() if (m := _ROW.match(line))}
    assert all(names[cls.reason].split()[0] == cls.__name__ for cls in ERRORS)


def test_docs_protocol_lists_the_same_reasons_status_codes_and_exceptions():
    doc = pathlib.Path(__file__).resolve().parents[1] / "docs" / "protocol.md"
    rows = re.findall(r"^\| `([a-z_]+)` \| `([A-Z_]+)` \| `(\w+)` \|$", doc.read_text(), re.M)
    assert {r: (code, name) for r, code, name in rows} == {
        cls.reason: (cls.grpc_code.name, cls.__name__) for cls in ERRORS
    }
