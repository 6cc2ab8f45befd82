"""Sync mode's rendezvous store on the server: the c10d key-value store each quorum builds its
process group over, served through the authenticated ``Store`` RPC. One capped namespace
per quorum (its members only); every operation answers at once (a blocking ``get`` is the
client's loop, worker/rendezvous.py). docs/protocol.md, "The sync round".
"""

from __future__ import annotations

import dataclasses
import threading

from asyncdiloco.errors import InvalidPayloadError, PayloadTooLargeError, RoundRefusedError
from asyncdiloco.wire._proto import parameter_server_pb2 as pb

#: Keys in one quorum's namespace (gloo sets one per rank and device, NCCL a few).
MAX_KEYS = 4096
#: Bytes of one key (UTF-8).
MAX_KEY_BYTES = 1024
#: Bytes of one value (a gloo rank's addresses are a few bytes per peer).
MAX_VALUE_BYTES = 1 << 20
#: Bytes of keys and values in one namespace.
MAX_NAMESPACE_BYTES = 16 << 20

_ONE_KEY = (pb.STORE_OP_SET, pb.STORE_OP_GET, pb.STORE_OP_ADD, pb.STORE_OP_COMPARE_SET, pb.STORE_OP_DELETE)


@dataclasses.dataclass
class _Namespace:
    members: frozenset[int]
    data: dict[str, bytes] = dataclasses.field(default_factory=dict)
    nbytes: int = 0


class RendezvousStore:
    """The quorums' key-value namespaces (see the module docstring). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spaces: dict[int, _Namespace] = {}

    def open(self, quorum_id: int, members: tuple[int, ...]) -> None:
        """Quorum ``quorum_id`` formed with ``members``: its namespace exists from now on
        (a second call changes nothing) and every older one is dropped (a quorum forms
        only after the previous round was decided)."""
        with self._lock:
            if quorum_id in self._spaces:
                return
            for old in [q for q in self._spaces if q < quorum_id]:
                del self._spaces[old]
            self._spaces[quorum_id] = _Namespace(frozenset(members))

    def close(self, quorum_id: int) -> None:
        """The round of ``quorum_id`` is decided: drop its keys."""
        with self._lock:
            self._spaces.pop(quorum_id, None)

    @property
    def open_quorums(self) -> list[int]:
        """Quorum ids with a namespace now (for tests and status)."""
        with self._lock:
            return sorted(self._spaces)

    def serve(self, request: pb.StoreRequest) -> pb.StoreReply:
        """One operation (``StoreOp``) in the namespace of ``request.quorum_id``.

        Raises:
            RoundRefusedError: the quorum has no namespace (unknown, or its round ended),
                or ``request.worker_id`` is not one of its members.
            InvalidPayloadError: an unknown op, or the wrong number of keys for it.
            PayloadTooLargeError: a key, a value or the namespace over its limit.
        """
        self._check_shape(request)
        with self._lock:
            space = self._spaces.get(request.quorum_id)
            if space is None:
                raise RoundRefusedError(
                    f"round refused: the rendezvous store of quorum {request.quorum_id} is closed (the quorum is "
                    f"unknown to this server or its round ended, e.g. after a server restart); ask for a new quorum"
                )
            if request.worker_id not in space.members:
                raise RoundRefusedError(
                    f"round refused: worker {request.worker_id} is not a member of quorum {request.quorum_id} "
                    f"(members {sorted(space.members)}) and may not use its rendezvous store"
                )
            return self._apply(space, request)

    @staticmethod
    def _check_shape(request: pb.StoreRequest) -> None:
        op, keys = request.op, request.keys
        if op not in pb.StoreOp.values() or op == pb.STORE_OP_UNSPECIFIED:
            raise InvalidPayloadError(f"store op {op} is unknown; send one of StoreOp's values (1 to 7)")
        if op in _ONE_KEY and len(keys) != 1:
            raise InvalidPayloadError(
                f"store op {pb.StoreOp.Name(op)} takes exactly one key; the request has {len(keys)}"
            )
        for key in keys:
            if len(key.encode()) > MAX_KEY_BYTES:
                raise PayloadTooLargeError(
                    f"store key of {len(key.encode())} bytes is over the limit of {MAX_KEY_BYTES}; use shorter keys"
                )
        for name, value in (("value", request.value), ("expected", request.expected)):
            if len(value) > MAX_VALUE_BYTES:
                raise PayloadTooLargeError(
                    f"store {name} of {len(value)} bytes is over the limit of {MAX_VALUE_BYTES}; a rendezvous "
                    f"store holds addresses, not payloads"
                )

    def _apply(self, space: _Namespace, request: pb.StoreRequest) -> pb.StoreReply:
        op, data = request.op, space.data
        key = request.keys[0] if request.keys else ""
        if op == pb.STORE_OP_GET:
            value = data.get(key)
            return pb.StoreReply(found=value is not None, value=value or b"")
        if op == pb.STORE_OP_CHECK:
            return pb.StoreReply(found=all(k in data for k in request.keys))
        if op == pb.STORE_OP_NUM_KEYS:
            return pb.StoreReply(count=len(data))
        if op == pb.STORE_OP_DELETE:
            old = data.pop(key, None)
            if old is not None:
                space.nbytes -= len(key.encode()) + len(old)
            return pb.StoreReply(found=old is not None)
        if op == pb.STORE_OP_SET:
            self._put(space, request.quorum_id, key, request.value)
            return pb.StoreReply()
        if op == pb.STORE_OP_ADD:
            current = data.get(key, b"0")
            try:
                total = int(current) + request.amount
            except ValueError:
                raise InvalidPayloadError(
                    f"store key {key!r} holds {current[:32]!r}, not an integer: it cannot be added to"
                ) from None
            self._put(space, request.quorum_id, key, str(total).encode())
            return pb.StoreReply(count=total)
        # STORE_OP_COMPARE_SET, with torch's semantics (TCPStore's compareSet)
        current_or_none = data.get(key)
        if (current_or_none is None and request.expected == b"") or current_or_none == request.expected:
            self._put(space, request.quorum_id, key, request.value)
            return pb.StoreReply(value=request.value)
        return pb.StoreReply(value=request.expected if current_or_none is None else current_or_none)

    @staticmethod
    def _put(space: _Namespace, quorum_id: int, key: str, value: bytes) -> None:
        old = space.data.get(key)
        key_bytes = len(key.encode())
        grown = len(value) - (len(old) if old is not None else -key_bytes)
        if old is None and len(space.data) >= MAX_KEYS:
            raise PayloadTooLargeError(
                f"the rendezvous store of quorum {quorum_id} holds {MAX_KEYS} keys, its limit; a process group "
                f"needs a few per member"
            )
        if space.nbytes + grown > MAX_NAMESPACE_BYTES:
            raise PayloadTooLargeError(
                f"the rendezvous store of quorum {quorum_id} would hold {space.nbytes + grown} bytes, over its "
                f"limit of {MAX_NAMESPACE_BYTES}"
            )
        space.data[key] = bytes(value)
        space.nbytes += grown
