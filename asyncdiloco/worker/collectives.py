"""One fresh torch.distributed process group per quorum, for sync mode's allreduce.

The server hosts one ``TCPStore`` for its lifetime; each quorum rendezvouses under its
own prefix ``q<quorum_id>`` and builds a new group with ``torch.distributed``'s
backend classes directly, never touching the default process group, so successive
quorums of different members (3, 3, then 2) share one store without interfering. A
member that dies fails the collective on the others at once
("Connection closed by peer"); one that hangs fails it after exactly ``timeout_s``,
which also bounds the rendezvous.

Backend: gloo for CPU tensors, on the address ``collective_host`` (127.0.0.1 when the
server is reached on loopback, else torch's default: ``GLOO_SOCKET_IFNAME`` or the host
name). NCCL for CUDA tensors: the branch is written but not run by the test suite,
which has no GPU.

``start_allreduce_sum`` launches the collective and returns it in flight; the sum is in
the buffer once ``InFlightAllreduce.wait`` returns. ``allreduce_sum`` is both.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

import torch


def is_loopback(host: str) -> bool:
    return host.startswith("127.") or host in ("localhost", "::1", "[::1]")


@dataclasses.dataclass(frozen=True)
class QuorumGroup:
    """Who takes part in one quorum's allreduce and where they meet (``QuorumReply``)."""

    quorum_id: int
    rank: int
    world_size: int
    #: The rendezvous TCPStore (the server's; an empty host means the server's host).
    store_host: str
    store_port: int


class InFlightAllreduce:
    """A launched allreduce; ``wait`` blocks until the sum is in the caller's buffer.

    Holds the process group until then (it must outlive its collective)."""

    def __init__(
        self,
        work: Any = None,
        process_group: Any = None,
        buf: torch.Tensor | None = None,
        device_buf: torch.Tensor | None = None,
    ) -> None:
        self._work, self._process_group = work, process_group
        self._buf, self._device_buf = buf, device_buf

    def wait(self) -> None:
        """Raises:
        RuntimeError (from torch.distributed): a peer died, hung past the timeout, or
            the rendezvous failed. The buffer then holds no meaningful result.
        """
        if self._work is None:  # one member: nothing to reduce
            return
        self._work.wait()
        if self._device_buf is not None and self._buf is not None:
            self._buf.copy_(self._device_buf)
            torch.cuda.synchronize()


class QuorumCollectives:
    """Builds each quorum's process group and runs its allreduce.

    Args:
        server_host: host of the server address (used when the store host is empty, and
            to pick loopback for gloo).
        collective_host: address gloo binds and advertises; None: see the module docstring.
        cuda: True when the tensors to reduce live on CUDA (NCCL).
    """

    def __init__(self, server_host: str, collective_host: str | None, cuda: bool) -> None:
        self.server_host = server_host
        self.collective_host = collective_host
        self.cuda = cuda
        self._store: Any = None  # TCPStore client, reused across quorums
        self._store_addr: tuple[str, int] | None = None
        self._device: Any = None  # gloo device, created once

    def allreduce_sum(self, buf: torch.Tensor, group: QuorumGroup, timeout_s: float) -> None:
        """Sum ``buf`` in place over the quorum's members (a no-op for one member).

        Args:
            buf: 1-D float32 CPU tensor, identical shape on every member.
            group: the quorum.
            timeout_s: bound on the rendezvous and on the collective, seconds.
        Raises:
            RuntimeError (from torch.distributed): a peer died, hung past ``timeout_s``,
            or the rendezvous failed. ``buf`` then holds no meaningful result.
        """
        self.start_allreduce_sum(buf, group, timeout_s).wait()

    def start_allreduce_sum(self, buf: torch.Tensor, group: QuorumGroup, timeout_s: float) -> InFlightAllreduce:
        """Build the quorum's process group and launch the sum of ``buf``; ``wait`` on the
        result for it (arguments and errors as ``allreduce_sum``)."""
        if group.world_size == 1:
            return InFlightAllreduce()
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.PrefixStore(f"q{group.quorum_id}", self._rendezvous_store(group, timeout))
        if self.cuda:  # NCCL for CUDA tensors
            nccl_opts = dist.ProcessGroupNCCL.Options()
            nccl_opts._timeout = timeout
            pg: Any = dist.ProcessGroupNCCL(store, group.rank, group.world_size, nccl_opts)
            device_buf = buf.to(torch.device("cuda", torch.cuda.current_device()), non_blocking=True)
            return InFlightAllreduce(pg.allreduce([device_buf]), pg, buf, device_buf)
        gloo: Any = dist.ProcessGroupGloo  # its _Options are not in torch's type stubs
        gloo_opts = gloo._Options()
        gloo_opts._timeout = timeout
        gloo_opts._devices = [self._gloo_device()]
        pg = dist.ProcessGroupGloo(store, group.rank, group.world_size, gloo_opts)
        return InFlightAllreduce(pg.allreduce([buf]), pg)

    def close(self) -> None:
        self._store = None

    def _rendezvous_store(self, group: QuorumGroup, timeout: datetime.timedelta) -> Any:
        import torch.distributed as dist

        addr = (group.store_host or self.server_host, group.store_port)
        if self._store is None or self._store_addr != addr:
            self._store = dist.TCPStore(addr[0], addr[1], is_master=False, timeout=timeout)
            self._store_addr = addr
        else:
            self._store.set_timeout(timeout)
        return self._store

    def _gloo_device(self) -> Any:
        import torch.distributed as dist

        if self._device is None:
            host = self.collective_host
            if host is None and is_loopback(self.server_host):
                host = "127.0.0.1"
            if host:
                self._device = dist.ProcessGroupGloo.create_device(hostname=host)
            else:
                self._device = dist.ProcessGroupGloo.create_default_device()
        return self._device
