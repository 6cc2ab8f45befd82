"""Every exception the library raises on purpose.

Each message names the offending value, the limit it broke and the fix. On the wire each
error maps to one gRPC status code (``grpc_code``); the servicer turns the exception into
that status with the same message, and the client turns the status back into the
exception, so library users and remote workers see the same words.
"""

from __future__ import annotations

import os

import grpc


class AsyncDiLoCoError(Exception):
    """Base class. ``grpc_code`` is the status a servicer answers with."""

    grpc_code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class ConfigError(AsyncDiLoCoError, ValueError):
    """A configuration value is out of range (raised by the config dataclasses)."""

    grpc_code = grpc.StatusCode.INVALID_ARGUMENT


class InvalidPayloadError(AsyncDiLoCoError, ValueError):
    """A payload is malformed: chunk sequence, sizes, checksum, dtype, non-finite values."""

    grpc_code = grpc.StatusCode.INVALID_ARGUMENT


class PayloadTooLargeError(AsyncDiLoCoError, ValueError):
    """A payload or chunk is larger than the configured limit."""

    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class ManifestMismatchError(AsyncDiLoCoError):
    """The worker's model differs from the server's (names, shapes or dtypes)."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION


class StalePushError(AsyncDiLoCoError):
    """A pseudo-gradient's staleness exceeds ``max_staleness``, or its base version is
    from the future."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION


class NotInitializedError(AsyncDiLoCoError):
    """The server holds no global parameters yet (the first worker has not pushed them)."""

    grpc_code = grpc.StatusCode.UNAVAILABLE


class UnknownWorkerError(AsyncDiLoCoError):
    """The worker id is unknown to the server, or its lease expired; rejoin."""

    grpc_code = grpc.StatusCode.NOT_FOUND


class ModeMismatchError(AsyncDiLoCoError):
    """A request for the other mode: a pseudo-gradient push to a sync-mode server, or a
    Quorum/Commit to an async-mode server (messages start with ``"mode mismatch"``)."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION


class RoundRefusedError(AsyncDiLoCoError):
    """Sync mode: a Commit vote or round result for a quorum this worker is not a member
    of, or a round result from a member other than rank 0."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION


class ServerUnavailableError(AsyncDiLoCoError, ConnectionError):
    """The server could not be reached (after the configured retries)."""

    grpc_code = grpc.StatusCode.UNAVAILABLE


class ServerBusyError(ServerUnavailableError):
    """Every receive buffer is taken by other pushes in flight and none came free in
    time; nothing was read or applied. Retry (workers do, with backoff)."""

    grpc_code = grpc.StatusCode.UNAVAILABLE


class CheckpointError(AsyncDiLoCoError):
    """A checkpoint or write-ahead log cannot be read, does not match this server's
    configuration, or cannot be written. At start-up the server refuses to start; on
    the wire (a push that could not be made durable, so it was not applied) it is
    UNAVAILABLE, and the worker retries the push later with the same push_id."""

    grpc_code = grpc.StatusCode.UNAVAILABLE


class UnauthenticatedError(AsyncDiLoCoError):
    """The call carried no token, or a token that differs from the server's."""

    grpc_code = grpc.StatusCode.UNAUTHENTICATED


_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidPayloadError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: PayloadTooLargeError,
    grpc.StatusCode.NOT_FOUND: UnknownWorkerError,
    grpc.StatusCode.UNAVAILABLE: ServerUnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: ServerUnavailableError,
    grpc.StatusCode.CANCELLED: ServerUnavailableError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
}


def from_rpc_error(err: grpc.RpcError) -> AsyncDiLoCoError:
    """Map a ``grpc.RpcError`` back to the library exception with the server's message.

    FAILED_PRECONDITION is told apart by the message prefix the servicer writes
    (``"manifest mismatch"``, ``"mode mismatch"``, ``"round refused"``, ``"not
    initialized"`` or a staleness refusal).
    """
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = (err.details() if hasattr(err, "details") else None) or str(err)
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        if details.startswith("manifest mismatch"):
            return ManifestMismatchError(details)
        if details.startswith("mode mismatch"):
            return ModeMismatchError(details)
        if details.startswith("round refused"):
            return RoundRefusedError(details)
        return StalePushError(details)
    if code == grpc.StatusCode.UNAVAILABLE and details.startswith("not initialized"):
        return NotInitializedError(details)
    cls = _BY_CODE.get(code, AsyncDiLoCoError)
    if cls is ServerUnavailableError:
        return cls(f"{code.name}: {details}")
    return cls(details) if cls is not AsyncDiLoCoError else cls(f"{code.name}: {details}")


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
