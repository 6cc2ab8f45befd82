"""Every exception the library raises on purpose, and how each one travels on the wire.

Each message names the offending value, the limit it broke and the fix. A refusal
travels as the exception's gRPC status code (``grpc_code``), its message, and its
``reason``: a stable snake_case code in the trailing metadata key ``asyncdiloco-reason``
(on the bulk data channel: ``BulkReply.code``, ``.message`` and ``.reason``). The client
picks the exception class from the reason (``from_rpc_error``), so library users and
remote workers see the same exception with the same words. A status without a reason (a
failure gRPC reports itself: connection lost, deadline exceeded, message too large) falls
back to the status code, never to the message text.

The refusals (parameter_server.proto's "Errors" comment repeats this table; a test
checks that the two agree):

    reason                status code            exception
    internal              INTERNAL               AsyncDiLoCoError (a bug, or no better class)
    invalid_config        INVALID_ARGUMENT       ConfigError
    invalid_payload       INVALID_ARGUMENT       InvalidPayloadError
    payload_corrupted     INVALID_ARGUMENT       PayloadCorruptedError
    payload_too_large     RESOURCE_EXHAUSTED     PayloadTooLargeError
    manifest_mismatch     FAILED_PRECONDITION    ManifestMismatchError
    stale_push            FAILED_PRECONDITION    StalePushError
    unknown_version       INVALID_ARGUMENT       UnknownVersionError
    mode_mismatch         FAILED_PRECONDITION    ModeMismatchError
    round_refused         FAILED_PRECONDITION    RoundRefusedError
    not_initialized       UNAVAILABLE            NotInitializedError
    unknown_worker        NOT_FOUND              UnknownWorkerError
    worker_superseded     FAILED_PRECONDITION    WorkerSupersededError
    server_unavailable    UNAVAILABLE            ServerUnavailableError
    server_busy           UNAVAILABLE            ServerBusyError
    checkpoint_failed     UNAVAILABLE            CheckpointError
    unauthenticated       UNAUTHENTICATED        UnauthenticatedError

UNAVAILABLE refusals may succeed unchanged a moment later: workers retry them with
backoff (``RETRY_LATER``); the policy is in docs/protocol.md "Refusals".
"""

from __future__ import annotations

import os
from typing import ClassVar

import grpc

#: The trailing metadata key that carries a refusal's ``reason``.
REASON_METADATA_KEY = "asyncdiloco-reason"

_BY_REASON: dict[str, type[AsyncDiLoCoError]] = {}


class AsyncDiLoCoError(Exception):
    """Base class. ``grpc_code`` is the status a servicer answers with, ``reason`` the
    machine-readable code it sends beside it (module docstring)."""

    grpc_code: ClassVar[grpc.StatusCode] = grpc.StatusCode.INTERNAL
    reason: ClassVar[str] = "internal"

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        _register(cls)


def _register(cls: type[AsyncDiLoCoError]) -> None:
    """Make ``cls`` the class of the reason it declares (a subclass that declares none
    travels as its parent)."""
    if "reason" not in vars(cls):
        return
    if cls.reason in _BY_REASON:
        raise TypeError(f"{cls.__name__}.reason={cls.reason!r} is taken by {_BY_REASON[cls.reason].__name__}")
    _BY_REASON[cls.reason] = cls


_BY_REASON[AsyncDiLoCoError.reason] = AsyncDiLoCoError


class ConfigError(AsyncDiLoCoError, ValueError):
    """A configuration value is out of range (raised by the config dataclasses)."""

    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "invalid_config"


class InvalidPayloadError(AsyncDiLoCoError, ValueError):
    """A payload is malformed: chunk sequence, sizes, checksum, dtype, non-finite values."""

    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "invalid_payload"


class PayloadCorruptedError(InvalidPayloadError):
    """A payload's CRC-32 differs from the one its header announced, or a push or pull
    header's own ``header_crc32`` differs (wire/header_crc.py): it was corrupted in
    transit. Unlike the other invalid payloads, the same call sent again may succeed: the
    client resends a push (same push_id; the refusal applied nothing) or pulls again, a
    few times with backoff, before it raises this (``ParameterServerClient``)."""

    reason = "payload_corrupted"


class PayloadTooLargeError(AsyncDiLoCoError, ValueError):
    """A payload or chunk is larger than the configured limit."""

    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "payload_too_large"


class ManifestMismatchError(AsyncDiLoCoError):
    """The worker's model differs from the server's (names, shapes or dtypes)."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "manifest_mismatch"


class StalePushError(AsyncDiLoCoError):
    """A pseudo-gradient's staleness exceeds ``max_staleness``."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "stale_push"


class UnknownVersionError(StalePushError):
    """A push's base_version is one the server never served: negative, or above its
    version (from the future; e.g. the server restarted from an older checkpoint than
    the worker pulled). The request is wrong as sent, so INVALID_ARGUMENT; it is a
    ``StalePushError`` because a worker does what it does for a stale push: drop the
    pseudo-gradient and pull the global model."""

    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "unknown_version"


class ModeMismatchError(AsyncDiLoCoError):
    """A request for the other mode: a pseudo-gradient push to a sync-mode server, or a
    Quorum/Commit to an async-mode server."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "mode_mismatch"


class RoundRefusedError(AsyncDiLoCoError):
    """Sync mode: a Commit vote or round result for a quorum this worker is not a member
    of, or a round result from a member other than rank 0."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "round_refused"


class NotInitializedError(AsyncDiLoCoError):
    """The server holds no global parameters yet (the first worker has not pushed them);
    retry shortly (joining workers poll)."""

    grpc_code = grpc.StatusCode.UNAVAILABLE
    reason = "not_initialized"


class UnknownWorkerError(AsyncDiLoCoError):
    """The worker id is unknown to the server, or its lease expired; rejoin."""

    grpc_code = grpc.StatusCode.NOT_FOUND
    reason = "unknown_worker"


class WorkerSupersededError(AsyncDiLoCoError):
    """Another process joined under this worker's name since this one joined (a
    restarted worker took its id back): this session's calls are refused. Two live
    processes shared one name; stop one, or give each its own name."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "worker_superseded"


class ServerUnavailableError(AsyncDiLoCoError, ConnectionError):
    """The server could not be reached (after the configured retries)."""

    grpc_code = grpc.StatusCode.UNAVAILABLE
    reason = "server_unavailable"


class ServerBusyError(ServerUnavailableError):
    """Every receive buffer is taken by other pushes in flight and none came free in
    time; nothing was read or applied. Retry (workers do, with backoff)."""

    grpc_code = grpc.StatusCode.UNAVAILABLE
    reason = "server_busy"


class CheckpointError(AsyncDiLoCoError):
    """A checkpoint or write-ahead log cannot be read, does not match this server's
    configuration, or cannot be written. At start-up the server refuses to start; on
    the wire (a push that could not be made durable, so it was not applied) it is
    UNAVAILABLE, and the worker retries the push later with the same push_id."""

    grpc_code = grpc.StatusCode.UNAVAILABLE
    reason = "checkpoint_failed"


class UnauthenticatedError(AsyncDiLoCoError):
    """The call carried no token, or a token that differs from the server's."""

    grpc_code = grpc.StatusCode.UNAUTHENTICATED
    reason = "unauthenticated"


#: Refusals after which the same call may succeed unchanged later: a worker keeps
#: training and retries them with backoff (the same push_id for a push).
RETRY_LATER: tuple[type[AsyncDiLoCoError], ...] = (ServerUnavailableError, NotInitializedError, CheckpointError)

#: Refusals of a pseudo-gradient push after which the worker drops that pseudo-gradient
#: (counted, with the reason) and goes on from the global model: the push is wrong as
#: sent (too stale, a version the server never served, non-finite or out-of-range values,
#: too large), so sending it again cannot help, and a fresh start from the global model
#: can. ``PayloadCorruptedError`` is an ``InvalidPayloadError`` but is not dropped: the
#: client resends it. The worker modules' docstrings hold the whole policy.
DROP_AND_REPULL: tuple[type[AsyncDiLoCoError], ...] = (StalePushError, InvalidPayloadError, PayloadTooLargeError)

#: The class of a status gRPC reports itself, without a reason (``from_rpc_error``).
_BY_CODE: dict[grpc.StatusCode, type[AsyncDiLoCoError]] = {
    grpc.StatusCode.RESOURCE_EXHAUSTED: PayloadTooLargeError,
    grpc.StatusCode.UNAVAILABLE: ServerUnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: ServerUnavailableError,
    grpc.StatusCode.CANCELLED: ServerUnavailableError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
}


def error_for_reason(reason: str) -> type[AsyncDiLoCoError] | None:
    """The exception class of a reason code (None: not a reason this library knows)."""
    return _BY_REASON.get(reason)


def reason_metadata(exc: AsyncDiLoCoError) -> tuple[tuple[str, str]]:
    """The trailing metadata a servicer sends with ``exc``'s status: its reason code."""
    return ((REASON_METADATA_KEY, exc.reason),)


def from_rpc_error(err: grpc.RpcError) -> AsyncDiLoCoError:
    """Map a ``grpc.RpcError`` (or the bulk channel's ``BulkStatus``) back to the library
    exception, with the server's message.

    The class is the one of the ``asyncdiloco-reason`` trailing metadata; without a known one (a
    failure gRPC reports itself) it follows the status code: RESOURCE_EXHAUSTED (a message
    over gRPC's limit) → PayloadTooLargeError, UNAUTHENTICATED → UnauthenticatedError,
    UNAVAILABLE / DEADLINE_EXCEEDED / CANCELLED → ServerUnavailableError, anything else
    AsyncDiLoCoError; the last two carry the code's name before the message.
    """
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = (err.details() if hasattr(err, "details") else None) or str(err)
    cls = error_for_reason(_reason_of(err))
    if cls is not None:
        return cls(details)
    cls = _BY_CODE.get(code, AsyncDiLoCoError)
    if cls is ServerUnavailableError or cls is AsyncDiLoCoError:
        return cls(f"{code.name}: {details}")
    return cls(details)


def _reason_of(err: grpc.RpcError) -> str:
    """The ``asyncdiloco-reason`` trailing metadata value of ``err`` ("" when none)."""
    try:
        metadata = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    except Exception:  # noqa: BLE001 - a call that never got trailers
        metadata = None
    for key, value in metadata or ():
        if key == REASON_METADATA_KEY:
            return value.decode() if isinstance(value, bytes) else str(value)
    return ""


def reason_codes() -> tuple[str, ...]:
    """Every reason code of the table above, sorted."""
    return tuple(sorted(_BY_REASON))


#: Words of gRPC's connection error when the TLS handshake failed, or when a plaintext
#: client met a TLS server (the server closes the socket: "Socket closed").
_TLS_FAILURE_WORDS = ("socket closed", "handshake", "ssl", "certificate")


def unreachable_message(server: str, exc: Exception, *, tls: bool) -> str:
    """The CLI's one line for a server that cannot be reached at ``server`` (HOST:PORT),
    with ``exc``'s text and the fix; where that text has the words of a failed TLS
    handshake, a hint: give ``--tls-ca`` (a plaintext client, ``tls`` false), or check
    that it holds the CA that signed the server's certificate (``tls`` true)."""
    line = f"cannot reach the server at {server} ({exc}); check --server and that the server is running"
    if any(word in str(exc).lower() for word in _TLS_FAILURE_WORDS):
        if tls:
            line += "; check that --tls-ca holds the CA that signed the server's certificate"
        else:
            line += "; if the server uses TLS, give --tls-ca (the CA that signed its certificate)"
    return line


#: Characters of an outside string ``quoted`` keeps.
QUOTED_CHARS = 80


def quoted(text: str, limit: int = QUOTED_CHARS) -> str:
    """``text`` from outside (a worker's or evaluator's name) as it may go into a log line
    or message: ``repr()``, so a newline or control character cannot forge another line,
    cut to ``limit`` characters with the full length said (``'xx…'… (5017 chars)``)."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}… ({len(text)} chars)"


def require(ok: bool, field: str, value: object, rule: str) -> None:
    """Raise ``ConfigError("<field>=<value> is invalid: <rule>")`` unless ``ok``.

    The configuration dataclasses' ``__post_init__`` checks; ``rule`` states the allowed
    range and the fix.
    """
    if not ok:
        raise ConfigError(f"{field}={value!r} is invalid: {rule}")


def require_file(path: str | None, field: str) -> None:
    """Raise ``ConfigError`` unless ``path`` is None or names an existing file."""
    require(path is None or os.path.isfile(path), field, path, "no such file; give the path of an existing file")
