"""One fresh torch.distributed process group per quorum, for sync mode's allreduce.

The server hosts one ``TCPStore`` for its lifetime; each quorum rendezvouses under its
own prefix ``q<quorum_id>`` and builds a new group with ``torch.distributed``'s
backend classes directly, never touching the default process group (PERF-NOTES,
"Re-formable gloo groups": successive quorums of 3, 3, then 2 members in one store
without interference). A member that dies fails the collective on the others at once
("Connection closed by peer"); one that hangs fails it after exactly ``timeout_s``,
which also bounds the rendezvous.

Backend: gloo for CPU tensors, on the address ``collective_host`` (127.0.0.1 when the
server is reached on loopback, else torch's default: ``GLOO_SOCKET_IFNAME`` or the host
name). NCCL for CUDA tensors: the branch is written but untested, the project has no
GPU in CI.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable

import torch


def is_loopback(host: str) -> bool:
    return host.startswith("127.") or host in ("localhost", "::1", "[::1]")


class QuorumCollectives:
    """Builds each quorum's process group and runs its allreduce.

    Args:
        server_host: host of the server address (used when the store host is empty, and
            to pick loopback for gloo).
        collective_host: address gloo binds and advertises; None: see the module docstring.
        cuda: True when the tensors to reduce live on CUDA (NCCL; untested).
    """

    def __init__(self, server_host: str, collective_host: str | None, cuda: bool) -> None:
        self.server_host = server_host
        self.collective_host = collective_host
        self.cuda = cuda
        self._store = None  # TCPStore client, reused across quorums
        self._store_addr: tuple[str, int] | None = None
        self._device = None  # gloo device, created once

    def allreduce_sum(
        self,
        buf: torch.Tensor,
        *,
        quorum_id: int,
        rank: int,
        world_size: int,
        store_host: str,
        store_port: int,
        timeout_s: float,
        in_flight: Callable[[], None] | None = None,
    ) -> None:
        """Sum ``buf`` in place over the quorum's members (a no-op for one member).

        Args:
            buf: 1-D float32 CPU tensor, identical shape on every member.
            in_flight: called after the allreduce is launched and before it is awaited
                (fault injection: die with the collective in flight).
        Raises:
            RuntimeError (from torch.distributed): a peer died, hung past ``timeout_s``,
            or the rendezvous failed. ``buf`` then holds no meaningful result.
        """
        if world_size == 1:
            return
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.PrefixStore(f"q{quorum_id}", self._rendezvous_store(store_host, store_port, timeout))
        if self.cuda:  # NCCL for CUDA tensors. Untested: the project has no GPU CI.
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
            device_buf = buf.to(torch.device("cuda", torch.cuda.current_device()), non_blocking=True)
            work = pg.allreduce([device_buf])
        else:
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            opts._devices = [self._gloo_device()]
            pg = dist.ProcessGroupGloo(store, rank, world_size, opts)
            device_buf = None
            work = pg.allreduce([buf])
        if in_flight is not None:
            in_flight()
        work.wait()
        if device_buf is not None:
            buf.copy_(device_buf)
            torch.cuda.synchronize()

    def close(self) -> None:
        self._store = None

    def _rendezvous_store(self, host: str, port: int, timeout: datetime.timedelta):
        import torch.distributed as dist

        addr = (host or self.server_host, port)
        if self._store is None or self._store_addr != addr:
            self._store = dist.TCPStore(addr[0], addr[1], is_master=False, timeout=timeout)
            self._store_addr = addr
        else:
            self._store.set_timeout(timeout)
        return self._store

    def _gloo_device(self):
        import torch.distributed as dist

        if self._device is None:
            host = self.collective_host
            if host is None and is_loopback(self.server_host):
                host = "127.0.0.1"
            self._device = (
                dist.ProcessGroupGloo.create_device(hostname=host) if host
                else dist.ProcessGroupGloo.create_default_device()
            )  # fmt: skip
        return self._device
