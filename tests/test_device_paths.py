"""The CUDA paths' host-side logic, on a CPU: which device is waited for, when copies are
asynchronous, that the host buffers are reused across syncs, and the NCCL allreduce's
device buffer, copies and deadline (with a stand-in process group).

What needs a GPU (pinned memory, NCCL itself) is `python -m asyncdiloco.bench.gpu_check`'s; these tests
fake the device flag (``FlatParams.on_cuda`` / ``devices``) or the backend instead.
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch
from torch import nn

from asyncdiloco.worker import collectives, flat
from asyncdiloco.worker.async_worker import AsyncDiLoCoWorker
from asyncdiloco.worker.collectives import QuorumCollectives, QuorumGroup
from asyncdiloco.worker.config import WorkerConfig
from asyncdiloco.worker.flat import FlatParams


@pytest.fixture
def cuda_syncs(monkeypatch):
    """Every ``torch.cuda.synchronize`` call's argument (None: the current device)."""
    calls: list[object] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    return calls


def _as_if_on(fp: FlatParams, *devices: torch.device) -> FlatParams:
    """Pretend the parameters live on ``devices`` (the fake device flag)."""
    fp.devices = list(devices)
    return fp


def test_copies_wait_on_the_parameters_device_not_the_current_one(cuda_syncs):
    """A model on cuda:1 is waited for on cuda:1: ``torch.cuda.synchronize()`` would
    wait on the current device (cuda:0) while the copies from the host buffer still run."""
    model = nn.Linear(3, 2)
    fp = _as_if_on(FlatParams(model), torch.device("cuda", 1))
    buf = torch.arange(fp.numel, dtype=torch.float32)
    fp.load(buf)
    fp.add(buf)
    assert cuda_syncs == [torch.device("cuda", 1)] * 2
    assert torch.equal(fp.copy_into(torch.empty(fp.numel)), 2 * buf)


def test_every_device_of_a_model_split_over_gpus_is_waited_for(cuda_syncs):
    fp = _as_if_on(FlatParams(nn.Linear(2, 2)), torch.device("cuda", 0), torch.device("cpu"), torch.device("cuda", 3))
    fp.load(torch.zeros(fp.numel))
    assert cuda_syncs == [torch.device("cuda", 0), torch.device("cuda", 3)]


def test_cpu_models_never_touch_cuda(cuda_syncs):
    fp = FlatParams(nn.Linear(3, 2))
    assert (fp.on_cuda, fp.devices, fp.device) == (False, [torch.device("cpu")], torch.device("cpu"))
    buf = fp.host_buffer()
    assert not buf.is_pinned()
    fp.load(buf)
    fp.add(fp.copy_into(buf))
    assert cuda_syncs == []


def test_a_copy_into_pageable_memory_is_synchronous_and_not_waited_for_again(cuda_syncs):
    """Only a pinned destination gets ``non_blocking`` copies (and the wait after them)."""
    fp = _as_if_on(FlatParams(nn.Linear(3, 2)), torch.device("cuda", 0))
    out = fp.copy_into(torch.empty(fp.numel))  # pageable: is_pinned() is False
    assert cuda_syncs == []
    assert torch.equal(out, torch.cat([p.detach().reshape(-1) for p in fp.params]))


def test_the_model_device_picks_the_first_cuda_device():
    fp = _as_if_on(FlatParams(nn.Linear(2, 2)), torch.device("cpu"), torch.device("cuda", 2))
    assert fp.on_cuda and fp.device == torch.device("cuda", 2)
    assert QuorumCollectives("127.0.0.1", None, fp.device).device == torch.device("cuda", 2)
    assert QuorumCollectives("127.0.0.1", None, torch.device("cuda", 2)).backend == "nccl"
    assert QuorumCollectives("127.0.0.1", None, torch.device("cpu")).backend == "gloo"


# ------------------------------------------------------- wire buffers, real server
@pytest.mark.parametrize("overlap", [False, True])
def test_host_buffers_are_reused_across_syncs(start_server, overlap):
    """Every sync pulls into the same wire buffer (the client fills it, allocating
    nothing), pushes from the same one, and θ_base / the scratch / the snapshot are the
    buffers made at construction: on CUDA these are the pinned ones."""
    srv = start_server(local_steps=1, wire_codec="bf16")
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with AsyncDiLoCoWorker(model, opt, WorkerConfig(server=srv.address, overlap=overlap)) as worker:
        host = {t.data_ptr() for t in (worker._base, worker._scratch)}
        if worker._overlap is not None:
            host.add(worker._overlap.snapshot.data_ptr())
        real_pull, filled = worker.client.pull, []

        def pull(manifest, worker_id=0, buffer=None):
            got = real_pull(manifest, worker_id, buffer=buffer)
            filled.append(buffer is not None and got.payload.data_ptr() == buffer.data_ptr())
            return got

        worker.client.pull = pull
        wires = set()
        for _ in range(6):
            model(torch.ones(1, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            wires.add((worker.wire.buffer("push").data_ptr(), worker.wire.buffer("pull").data_ptr()))
            now = {worker._base.data_ptr(), worker._scratch.data_ptr()}
            assert now <= host
        worker.close()
        assert len(wires) == 1
        assert filled and all(filled)
        assert worker.stats.pulls >= 3


# --------------------------------------------------------- NCCL's host-side logic
class _Work:
    """A stand-in for an NCCL Work: sums as if ``members`` identical members took part."""

    def __init__(self, tensor: torch.Tensor, members: int = 2, completes: bool = True, error: str = "") -> None:
        self.tensor, self.members, self.completes, self.error = tensor, members, completes, error

    def is_completed(self) -> bool:
        return self.completes

    def wait(self) -> bool:
        if self.error:
            raise RuntimeError(self.error)
        self.tensor.mul_(self.members)
        return True


class _Group:
    def __init__(self, **work) -> None:
        self.work, self.aborted, self.buffers = work, False, []

    def allreduce(self, tensors):
        self.buffers.append(tensors[0])
        return _Work(tensors[0], **self.work)

    def abort(self) -> None:
        self.aborted = True


def _device_collectives(monkeypatch, group: _Group) -> QuorumCollectives:
    """The NCCL branch of ``QuorumCollectives`` with its device buffer on the CPU."""
    import torch.distributed as dist

    qc = QuorumCollectives("127.0.0.1", None, torch.device("cpu"))
    qc.backend = "nccl"
    monkeypatch.setattr(qc, "_rendezvous_store", lambda *_: dist.HashStore())
    monkeypatch.setattr(qc, "_nccl_group", lambda *_: group)
    return qc


def _quorum(quorum_id: int) -> QuorumGroup:
    import torch.distributed as dist

    return QuorumGroup(quorum_id=quorum_id, rank=0, world_size=2, store=dist.HashStore())


def test_nccl_sums_in_one_reused_device_buffer_and_copies_back(monkeypatch):
    group = _Group()
    qc = _device_collectives(monkeypatch, group)
    for quorum_id in (1, 2):
        buf = torch.arange(5, dtype=torch.float32)
        qc.allreduce_sum(buf, _quorum(quorum_id), timeout_s=5.0)
        assert torch.equal(buf, 2 * torch.arange(5, dtype=torch.float32))
    first, second = group.buffers
    assert first.data_ptr() == second.data_ptr()  # allocated once, reused by the next quorum
    qc.allreduce_sum(torch.ones(7), _quorum(3), timeout_s=5.0)
    assert group.buffers[2].shape == (7,)  # another size (another model): a new buffer


def test_an_nccl_allreduce_past_its_timeout_aborts_the_group_and_raises(monkeypatch):
    group = _Group(completes=False)
    qc = _device_collectives(monkeypatch, group)
    buf = torch.ones(3)
    with pytest.raises(RuntimeError, match=r"allreduce_timeout_s=0 s.*aborted"):
        qc.allreduce_sum(buf, _quorum(1), timeout_s=0.0)
    assert group.aborted
    assert torch.equal(buf, torch.ones(3))  # the host buffer was not overwritten


def test_an_nccl_peer_failure_is_raised_from_wait(monkeypatch):
    qc = _device_collectives(monkeypatch, _Group(error="NCCL error: remote process exited"))
    with pytest.raises(RuntimeError, match="remote process exited"):
        qc.allreduce_sum(torch.ones(3), _quorum(1), timeout_s=5.0)


class _FakeNcclGroup:
    """Records the error-handling mode a ProcessGroupNCCL would read at construction."""

    class Options:
        _timeout: datetime.timedelta

    seen: list[str | None] = []

    def __init__(self, store, rank, size, opts) -> None:
        self.seen.append(os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"))
        self.timeout = opts._timeout


@pytest.mark.parametrize("callers", [None, "1"])
def test_nccl_groups_abort_only_their_communicator_unless_the_caller_chose(monkeypatch, callers):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "ProcessGroupNCCL", _FakeNcclGroup, raising=False)
    if callers is None:
        monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    else:
        monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", callers)
    _FakeNcclGroup.seen = []
    qc = QuorumCollectives("127.0.0.1", None, torch.device("cpu"))
    pg = qc._nccl_group(dist.HashStore(), _quorum(1), datetime.timedelta(seconds=3))
    assert _FakeNcclGroup.seen == [callers or "2"]
    assert pg.timeout == datetime.timedelta(seconds=3)
    assert os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING") == callers  # restored


def test_synchronize_skips_cpu_devices(cuda_syncs):
    flat.synchronize([torch.device("cpu"), torch.device("cuda", 1)])
    assert cuda_syncs == [torch.device("cuda", 1)]
    assert collectives._on_device(torch.device("cpu")).__enter__() is None


# ------------------------------------------------------------------ --device auto
@pytest.mark.parametrize(("local_rank", "expected"), [(None, "cuda"), ("2", "cuda:2"), ("7", "cuda")])
def test_device_auto_takes_the_gpu_of_a_torchrun_rank(monkeypatch, local_rank, expected):
    """With 4 GPUs: a plain process takes cuda (its current device), torchrun's rank with
    LOCAL_RANK=2 takes cuda:2 (not all ranks on cuda:0), a LOCAL_RANK past the GPUs cuda."""
    from asyncdiloco.cli.worker import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert resolve_device("auto") == expected
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"
