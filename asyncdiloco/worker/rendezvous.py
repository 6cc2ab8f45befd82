"""A quorum's rendezvous store as a ``torch.distributed.Store``, served by the parameter
server over the worker's own gRPC channel (the ``Store`` RPC; ps/sync/rendezvous.py is the
server's side). docs/worker.md, "The rendezvous store".
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from asyncdiloco.errors import AsyncDiLoCoError
from asyncdiloco.wire._proto import parameter_server_pb2 as pb

#: First and longest pause between two polls of a key not set yet, seconds.
FIRST_POLL_S, MAX_POLL_S = 0.002, 0.05

_StoreError: type[Exception] = getattr(dist, "DistStoreError", RuntimeError)


def _as_bytes(value: Any) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class ServerStore(dist.Store):
    """The rendezvous store of quorum ``quorum_id``, as worker ``worker_id`` sees it.

    Args:
        call: sends one ``StoreRequest`` with a deadline in seconds and returns the
            reply (``ParameterServerClient.store``); raises the library's exceptions.
        worker_id: this member's id (the server checks it is a member).
        quorum_id: the quorum (``QuorumReply.quorum_id``).
        timeout_s: how long ``get`` and ``wait`` wait for a key, seconds (torch's
            ``Store.timeout``; ``set_timeout`` changes it).
        rpc_timeout_s: the deadline of one call, seconds.
        clock, sleep: monotonic seconds and a pause (injectable for tests).
    """

    def __init__(
        self,
        call: Callable[[pb.StoreRequest, float], pb.StoreReply],
        *,
        worker_id: int,
        quorum_id: int,
        timeout_s: float,
        rpc_timeout_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        super().__init__()
        self._call, self.worker_id, self.quorum_id = call, worker_id, quorum_id
        self._rpc_timeout_s, self._clock, self._sleep = rpc_timeout_s, clock, sleep
        self.set_timeout(datetime.timedelta(seconds=timeout_s))
        self.closed = False

    def close(self) -> None:
        """The round is over: every later call raises (``check`` answers False)."""
        self.closed = True

    # ------------------------------------------------------------ torch's Store API
    def set(self, key: str, value: Any) -> None:
        self._ask(pb.STORE_OP_SET, [key], value=_as_bytes(value))

    def get(self, key: str) -> bytes:
        """The value of ``key``, once some member set it (waits up to the timeout)."""
        reply = self._poll(pb.STORE_OP_GET, [key], self._timeout())
        return reply.value

    def add(self, key: str, amount: int) -> int:
        return self._ask(pb.STORE_OP_ADD, [key], amount=int(amount)).count

    def check(self, keys: list[str]) -> bool:
        if self.closed:
            return False
        return self._ask(pb.STORE_OP_CHECK, list(keys)).found

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        """Until every key in ``keys`` is set (up to ``timeout``, else the store's)."""
        self._poll(pb.STORE_OP_CHECK, list(keys), timeout if timeout is not None else self._timeout())

    def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
        desired, expected = _as_bytes(desired_value), _as_bytes(expected_value)
        return self._ask(pb.STORE_OP_COMPARE_SET, [key], value=desired, expected=expected).value

    def delete_key(self, key: str) -> bool:
        return self._ask(pb.STORE_OP_DELETE, [key]).found

    def num_keys(self) -> int:
        return self._ask(pb.STORE_OP_NUM_KEYS, []).count

    # the names torch's C++ side looks the last two up by
    deleteKey = delete_key  # noqa: N815
    getNumKeys = num_keys  # noqa: N815

    # ------------------------------------------------------------------ internals
    def _timeout(self) -> datetime.timedelta:
        return self.timeout  # type: ignore[attr-defined]  # torch's Store.timeout, absent from its stubs

    def _ask(self, op: pb.StoreOp, keys: list[str], deadline_s: float | None = None, **fields: Any) -> pb.StoreReply:
        """One call. Raises DistStoreError: the store is closed or the server refused."""
        what = f"{pb.StoreOp.Name(op).removeprefix('STORE_OP_').lower()} {keys if len(keys) != 1 else keys[0]!r}"
        if self.closed:
            raise _StoreError(f"rendezvous store of quorum {self.quorum_id} is closed (its round is over): {what}")
        request = pb.StoreRequest(worker_id=self.worker_id, quorum_id=self.quorum_id, op=op, keys=keys, **fields)
        try:
            return self._call(request, self._rpc_timeout_s if deadline_s is None else deadline_s)
        except AsyncDiLoCoError as exc:
            raise _StoreError(f"rendezvous store of quorum {self.quorum_id}, {what}: {exc}") from exc

    def _poll(self, op: pb.StoreOp, keys: list[str], timeout: datetime.timedelta) -> pb.StoreReply:
        """Ask until the reply says ``found`` or ``timeout`` passes.

        Raises:
            DistStoreError: not found within the timeout (a member never reached the
                rendezvous), or a call failed.
        """
        timeout_s = timeout.total_seconds()
        end, pause = self._clock() + timeout_s, FIRST_POLL_S
        while True:
            left = end - self._clock()
            reply = self._ask(op, keys, deadline_s=min(self._rpc_timeout_s, max(left, 1.0)))
            if reply.found:
                return reply
            left = end - self._clock()
            if left <= 0:
                raise _StoreError(
                    f"rendezvous of quorum {self.quorum_id}: {keys} not set within {timeout_s:g} s (a member "
                    f"did not reach the rendezvous: it died, hung or is slower; raise --allreduce-timeout-s "
                    f"if members are merely slow)"
                )
            self._sleep(min(pause, left))
            pause = min(2 * pause, MAX_POLL_S)
