"""Sync mode's allreduce: one process group per quorum membership (gloo or NCCL, over the
quorum's rendezvous store, reused after a commit) and the agreement before the sum.
docs/worker.md, "The quorum's collectives".
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import os
import time
from typing import Any

import torch

from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.worker.flat import synchronize

#: Seconds between the host's checks of an NCCL allreduce in flight.
_NCCL_POLL_S = 0.001


def is_loopback(host: str) -> bool:
    return host.startswith("127.") or host in ("localhost", "::1", "[::1]")


@dataclasses.dataclass(frozen=True)
class QuorumGroup:
    """Who takes part in one quorum's allreduce and where they meet (``QuorumReply``)."""

    quorum_id: int
    rank: int
    world_size: int
    #: The ``torch.distributed.Store`` the members rendezvous over (rendezvous.py ``ServerStore``).
    store: Any
    #: The members' worker ids in rank order (``QuorumReply.members``); empty: never reuse a group.
    members: tuple[int, ...] = ()


class InFlightAllreduce:
    """A launched allreduce (holding its process group); ``wait`` blocks until the sum is in the buffer."""

    def __init__(self, work: Any = None, process_group: Any = None, store: Any = None) -> None:
        self._work, self._process_group = work, process_group
        self._store = store  # the group's rendezvous store lives as long as the group

    def wait(self) -> None:
        """Raises RuntimeError (torch.distributed) when a peer died or hung; the buffer is then garbage."""
        if self._work is None:  # one member: nothing to reduce
            return
        self._work.wait()


class InFlightDeviceAllreduce(InFlightAllreduce):
    """An NCCL allreduce of ``device_buf``: ``wait`` polls it until ``timeout_s`` seconds
    after launch (then aborts the group), and copies the sum into the pinned 1-D float32
    host buffer ``buf``."""

    def __init__(
        self, work: Any, process_group: Any, buf: torch.Tensor, device_buf: torch.Tensor, timeout_s: float
    ) -> None:
        super().__init__(work, process_group)
        self._buf, self._device_buf, self._timeout_s = buf, device_buf, timeout_s
        self._deadline = time.monotonic() + timeout_s

    def wait(self) -> None:
        """Raises RuntimeError: not finished within ``timeout_s`` (group aborted), or a peer died."""
        while not self._work.is_completed():
            if time.monotonic() >= self._deadline:
                self._process_group.abort()
                raise RuntimeError(
                    f"NCCL allreduce did not complete within allreduce_timeout_s={self._timeout_s:g} s "
                    f"(a member hung or is gone); its communicator was aborted"
                )
            time.sleep(_NCCL_POLL_S)
        device = self._device_buf.device
        with _on_device(device):
            self._work.wait()  # raises the collective's error; orders the current stream after the sum
            self._buf.copy_(self._device_buf, non_blocking=True)  # into pinned memory: asynchronous
        synchronize([device])  # before the host reads the sum


class QuorumProcessGroup:
    """One quorum's process group (``QuorumCollectives.open``); None for a quorum of one.

    Every member calls the same collectives in the same order: ``all_max`` (small, to
    agree before the sum), then ``start_allreduce_sum`` (the buffer).
    """

    def __init__(self, collectives: QuorumCollectives, process_group: Any, timeout_s: float, store: Any = None) -> None:
        self._collectives, self._pg, self._timeout_s = collectives, process_group, timeout_s
        self._store = store  # outlives the group (docs/worker.md)

    def all_max(self, values: torch.Tensor) -> None:
        """Element-wise max of ``values`` (1-D float64 CPU, same length on every member, no
        NaN) over the members, in place. Raises RuntimeError when a peer died or hung."""
        if self._pg is None:
            return
        import torch.distributed as dist

        opts: Any = dist.AllreduceOptions()  # reduceOp's stub type differs from ReduceOp.MAX's
        opts.reduceOp = dist.ReduceOp.MAX
        if self._collectives.backend != "nccl":
            self._pg.allreduce([values], opts).wait()
            return
        device = self._collectives.device
        with _on_device(device):
            on_device = values.to(device)
            work = self._pg.allreduce([on_device], opts)
        InFlightDeviceAllreduce(work, self._pg, values, on_device, self._timeout_s).wait()

    def start_allreduce_sum(self, buf: torch.Tensor) -> InFlightAllreduce:
        """Launch the sum of ``buf`` (as ``QuorumCollectives.allreduce_sum``); ``wait`` on it."""
        if self._pg is None:
            return InFlightAllreduce()
        if self._collectives.backend == "nccl":
            work = self._collectives._start_on_device(buf, self._pg, self._timeout_s)
            work._store = self._store
            return work
        return InFlightAllreduce(self._pg.allreduce([buf]), self._pg, self._store)


def _on_device(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """``torch.cuda.device(device)`` for a CUDA device: CUDA calls inside go to it."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class QuorumCollectives:
    """Builds each quorum's process group and runs its allreduce.

    Args:
        server_host: host of the server address (to pick loopback for gloo).
        collective_host: address gloo binds and advertises; None: 127.0.0.1 for a loopback server, else torch's default.
        device: where the model lives: CUDA sums over NCCL, the CPU over gloo.
    """

    def __init__(self, server_host: str, collective_host: str | None, device: torch.device) -> None:
        self.server_host = server_host
        self.collective_host = collective_host
        self.device = torch.device(device)
        #: The backend of every quorum's group: "nccl" for a CUDA device, else "gloo".
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        self._store: Any = None  # the current quorum's rendezvous store, kept until the next one
        self._device: Any = None  # gloo device, created once
        self._device_buf: torch.Tensor | None = None  # NCCL's buffer on ``device``, reused across quorums
        #: (members, rank) and group of the quorum opened last, and of the one kept for reuse.
        self._current: tuple[tuple[tuple[int, ...], int], QuorumProcessGroup] | None = None
        self._kept: tuple[tuple[tuple[int, ...], int], QuorumProcessGroup] | None = None
        #: Groups built and reused so far (a reuse skips the rendezvous).
        self.groups_built = 0
        self.groups_reused = 0

    def allreduce_sum(self, buf: torch.Tensor, group: QuorumGroup, timeout_s: float) -> None:
        """Sum ``buf`` (1-D float32 CPU, pinned for NCCL, same shape on every member) in place
        over the quorum, within ``timeout_s`` seconds for the rendezvous and the sum.

        Raises:
            RuntimeError (from torch.distributed): a peer died, hung or the rendezvous failed.
        """
        self.open(group, timeout_s).start_allreduce_sum(buf).wait()

    def open(self, group: QuorumGroup, timeout_s: float) -> QuorumProcessGroup:
        """The quorum's process group: the kept one when its members are this quorum's
        (``keep``), else a new one. Raises RuntimeError when the rendezvous failed."""
        self._current = None
        if group.world_size == 1:
            self._kept = None
            return QuorumProcessGroup(self, None, timeout_s)
        key = (group.members, group.rank)
        if group.members and len(group.members) == group.world_size and self._kept is not None:
            if self._kept[0] == key:
                self.groups_reused += 1
                self._current, self._kept = self._kept, None  # kept again only if this round commits
                return self._current[1]
        self._kept = None  # another membership: the old group is let go
        pg = self._build(group, timeout_s)
        self.groups_built += 1
        if group.members and len(group.members) == group.world_size:
            self._current = (key, pg)
        return pg

    def keep(self) -> None:
        """The round of the quorum opened last committed: keep its group for the same members."""
        self._kept = self._current

    def drop(self) -> None:
        """The round aborted: the next quorum builds a fresh group, whoever its members."""
        self._kept = self._current = None

    def _build(self, group: QuorumGroup, timeout_s: float) -> QuorumProcessGroup:
        """A new process group for the quorum, over its rendezvous store."""
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        base = self._rendezvous_store(group, timeout)
        store = dist.PrefixStore(f"q{group.quorum_id}", base)
        if self.backend == "nccl":
            return QuorumProcessGroup(self, self._nccl_group(store, group, timeout), timeout_s, base)
        gloo: Any = dist.ProcessGroupGloo  # its _Options are not in torch's type stubs
        gloo_opts = gloo._Options()
        gloo_opts._timeout = timeout
        gloo_opts._devices = [self._gloo_device()]
        return QuorumProcessGroup(
            self, dist.ProcessGroupGloo(store, group.rank, group.world_size, gloo_opts), timeout_s, base
        )

    def _start_on_device(self, buf: torch.Tensor, pg: Any, timeout_s: float) -> InFlightDeviceAllreduce:
        """Copy the host buffer into the reused device buffer and launch the sum there."""
        if self._device_buf is None or self._device_buf.shape != buf.shape:
            self._device_buf = torch.empty(buf.shape, dtype=buf.dtype, device=self.device)
        device_buf = self._device_buf
        with _on_device(self.device):
            device_buf.copy_(buf, non_blocking=True)
            work = pg.allreduce([device_buf])
        return InFlightDeviceAllreduce(work, pg, buf, device_buf, timeout_s)

    def _nccl_group(self, store: Any, group: QuorumGroup, timeout: datetime.timedelta) -> Any:
        """A new NCCL group whose errors abort its communicator only (unless the caller set
        ``TORCH_NCCL_ASYNC_ERROR_HANDLING``)."""
        import torch.distributed as dist

        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        key, before = "TORCH_NCCL_ASYNC_ERROR_HANDLING", os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
        os.environ[key] = before if before is not None else "2"  # read by the constructor
        try:
            with _on_device(self.device):
                return dist.ProcessGroupNCCL(store, group.rank, group.world_size, opts)
        finally:
            if before is None:
                del os.environ[key]

    def end_round(self) -> None:
        """The quorum's round is over: close its rendezvous store (later calls on it are
        answered without the server); the object is kept until the next quorum's."""
        close = getattr(self._store, "close", None)
        if close is not None:
            close()

    def _rendezvous_store(self, group: QuorumGroup, timeout: datetime.timedelta) -> Any:
        """The quorum's store (kept: see ``end_round``), its timeout set to ``timeout``."""
        if self._store is not group.store:
            self.end_round()
            self._store = group.store
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


class RoundFailed(Exception):
    """A phase of this member's round failed; the message is the reason it votes failure with."""


#: The largest finite float32, the sum's overflow threshold.
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def non_finite_sum_reason(announced: list[float], total_weight: float, q: pb.QuorumReply) -> str:
    """Why a round's sum ``[Σ w·Δ, Σ w]`` came out non-finite, given each rank's announced
    finite ‖Δ‖∞ (``announced``). Every |Σ_r w_r Δ_r,i| ≤ Σ w · max_r ‖Δ_r‖∞: below half of
    float32's maximum, a contribution did not match its announcement (no member blamed);
    above it, the sum overflowed and the member with the largest ‖Δ‖∞ is named.
    """
    largest = max(announced, default=0.0)
    rank = announced.index(largest) if announced else 0
    bound = total_weight * largest
    if not math.isfinite(total_weight) or bound <= _FLOAT32_MAX / 2:
        return (
            f"the round's sum is not finite although every member announced a finite pseudo-gradient (Σw = "
            f"{total_weight:.6g}, largest ‖Δ‖∞ announced {largest:.3g}, so the sum is at most {bound:.3g}, far from "
            f"float32's overflow at {_FLOAT32_MAX:.3g}): a member's contribution did not match its announcement; "
            f"every member skips the round and restarts from round {q.round}. Check that every member runs the same "
            f"asyncdiloco version, and the members' memory and hardware"
        )
    who = f"worker {int(q.members[rank])}'s (‖Δ‖∞ = {largest:.3g})" if announced else "unknown"
    return (
        f"the round's mean pseudo-gradient is not finite (the sum overflowed float32); the largest "
        f"pseudo-gradient was {who}: lower that worker's inner learning rate"
    )


def largest_magnitude(x: torch.Tensor) -> float:
    """max |x| of a 1-D float tensor; inf when it holds a NaN or ±inf (0 when empty)."""
    if not x.numel():
        return 0.0
    lo, hi = (float(v) for v in torch.aminmax(x))
    return math.inf if math.isnan(lo) or math.isnan(hi) else max(-lo, hi)


def agree(pg: QuorumProcessGroup, q: pb.QuorumReply, n: int, largest: float) -> list[float]:
    """Before the sum, every member learns every member's buffer size and ‖Δ‖∞ in one
    MAX-allreduce of ``[n, −n, a_0 … a_{W−1}]`` (float64, (2+W,)), and all decide alike.

    Args:
        n: this member's allreduce buffer size, floats.
        largest: this member's ‖Δ‖∞ (inf when not finite, never NaN).
    Returns:
        Every member's ‖Δ‖∞, by rank.
    Raises:
        RoundFailed: the sizes differ, or a member's Δ is not finite.
        RuntimeError (from torch.distributed): a peer died or hung.
    """
    facts = torch.zeros(2 + q.world_size, dtype=torch.float64)
    facts[0], facts[1] = n, -n
    facts[2 + q.rank] = largest
    pg.all_max(facts)
    most, least = int(facts[0]), -int(facts[1])
    if most != least:
        raise RoundFailed(
            f"the members' allreduce buffers differ in size ({least} to {most} floats; this member's "
            f"is {n}): the sum is not run; every member must run the same asyncdiloco version on the same model"
        )
    by_rank = facts[2:].tolist()
    bad = [int(q.members[r]) for r, a in enumerate(by_rank) if not math.isfinite(a)]
    if bad:
        who = (
            f"worker {bad[0]} sent a non-finite pseudo-gradient"
            if len(bad) == 1
            else f"workers {bad} sent non-finite pseudo-gradients"
        )
        raise RoundFailed(
            f"{who} (NaN/Inf): every member skips the round and restarts from round {q.round}; "
            f"lower that worker's inner learning rate or clip its gradients"
        )
    return by_rank
