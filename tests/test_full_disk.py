"""A full disk (issue 15, item 9), injected as a file whose writes fail with ENOSPC once
its free bytes run out (the kernel's behaviour: a partial write, then ENOSPC), never a
real full disk. An applied push is answered as applied; a push whose log append failed
is refused before it is applied; the log and the checkpoints recover once space returns;
no temporary file is left behind; the failures are counted for the metrics."""

from __future__ import annotations

import errno
import io
import json
import math

import pytest
import torch
from helpers import assert_same, crash, fingerprint, open_durable

import asyncdiloco._atomic as atomic_module
import asyncdiloco.ps.durable.store as store_module
from asyncdiloco.algo.config import OuterConfig
from asyncdiloco.errors import CheckpointError
from asyncdiloco.ps.config import DurabilityConfig, ServerConfig
from asyncdiloco.ps.watch.metrics import ServerMetrics
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.tensors import Manifest

pytestmark = pytest.mark.timeout(60)

MANIFEST = Manifest.from_named_tensors([("w", torch.zeros(64))])


class Disk:
    """The free bytes of a fake disk shared by the files opened on it (inf: plenty)."""

    def __init__(self) -> None:
        self.free: float = math.inf
        self.failing_truncates = 0

    def fill(self, leave_bytes: int = 10) -> None:
        self.free = leave_bytes

    def clear(self) -> None:
        self.free = math.inf


class FullDiskFile(io.RawIOBase):
    """A raw file on ``disk``: a write takes what is free (a partial write), then fails
    with ENOSPC, as write(2) does on a full disk."""

    def __init__(self, path, mode: str, disk: Disk) -> None:
        self.disk = disk
        self.raw = io.FileIO(path, mode.replace("b", ""))

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def seekable(self) -> bool:
        return True

    def write(self, data) -> int:
        data = memoryview(data).cast("B")
        n = int(min(len(data), self.disk.free))
        if n == 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.disk.free -= n
        return self.raw.write(data[:n])

    def truncate(self, size=None) -> int:
        if self.disk.failing_truncates:
            self.disk.failing_truncates -= 1
            raise OSError(errno.EIO, "Input/output error")
        return self.raw.truncate(size)

    def seek(self, offset, whence=io.SEEK_SET) -> int:
        return self.raw.seek(offset, whence)

    def tell(self) -> int:
        return self.raw.tell()

    def fileno(self) -> int:
        return self.raw.fileno()

    def close(self) -> None:
        self.raw.close()
        super().close()


def opener(disk: Disk):
    """An ``open`` for binary writes that puts the file on ``disk`` (buffered like the
    builtin unless told ``buffering=0``)."""

    def fake_open(path, mode="r", buffering=-1, *args, **kwargs):
        if "b" not in mode or not any(c in mode for c in "wa"):
            return open(path, mode, buffering, *args, **kwargs)
        raw = FullDiskFile(path, mode, disk)
        return raw if buffering == 0 else io.BufferedWriter(raw)

    return fake_open


def open_server(tmp_path, every=10**6):
    cfg = ServerConfig(
        port=0,
        outer=OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0),
        durability=DurabilityConfig(checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=every, fsync=False),
    )
    return open_durable(cfg)


def push(state, wid, push_id, value=0.01):
    payload = MANIFEST.pack([torch.full((64,), value)])
    return state.intake.push(payload, worker_id=wid, push_id=push_id, base_version=state.version, num_local_steps=1)


def started(state) -> int:
    wid, init, _ = state.join(MANIFEST, "a")
    assert init
    state.intake.push(MANIFEST.pack([torch.zeros(64)]), worker_id=wid, push_id=1, kind=pb.PUSH_KIND_INITIAL_PARAMETERS)
    return wid


def durability_errors(state) -> dict[str, float]:
    text = ServerMetrics(state).exposition().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("asyncdiloco_durability_errors_total{"):
            what = line.split('what="', 1)[1].split('"', 1)[0]
            out[what] = float(line.rsplit(" ", 1)[1])
    return out


def newest_checkpoint_version(tmp_path) -> int:
    return json.loads(sorted((tmp_path / "ckpt").glob("ckpt-*.json"))[-1].read_text())["version"]


def leftovers(tmp_path) -> list[str]:
    """Temp files, and tensor files whose sidecar (the commit point) was never written."""
    folder = tmp_path / "ckpt"
    orphans = [p for p in folder.glob("ckpt-*.pt") if not p.with_suffix(".json").exists()]
    return sorted(p.name for p in [*folder.glob("*.tmp"), *orphans])


def fail_checkpoints(monkeypatch, fault: str):
    """Make checkpoint writes fail with ``fault``; returns the call that frees the disk."""
    if fault == "disk_full":
        disk = Disk()
        monkeypatch.setattr(atomic_module, "open", opener(disk), raising=False)
        disk.fill(leave_bytes=100)  # the log's file was opened before: only checkpoint files fill up
        return disk.clear
    real_save = torch.save

    def torch_fails(obj, f, *args, **kwargs):  # what torch's zip writer raises on a full disk
        f.write(b"PK" * 50)
        raise RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 64 vs 0")

    monkeypatch.setattr(torch, "save", torch_fails)
    return lambda: monkeypatch.setattr(torch, "save", real_save)


@pytest.mark.parametrize("fault", ["disk_full", "torch_enforce"])
def test_a_failed_checkpoint_leaves_the_push_applied_and_no_temp_file(tmp_path, monkeypatch, fault):
    state, store = open_server(tmp_path, every=1)  # a checkpoint after every push
    wid = started(state)
    free_the_disk = fail_checkpoints(monkeypatch, fault)
    outcome = push(state, wid, 2)
    assert outcome.applied and not outcome.duplicate and outcome.version == 1  # not an error
    assert leftovers(tmp_path) == []
    assert durability_errors(state)["checkpoint"] >= 1
    assert push(state, wid, 3).applied  # the server keeps serving from memory
    free_the_disk()  # the next checkpoint is written
    push(state, wid, 4)
    assert newest_checkpoint_version(tmp_path) == 3 == state.version
    store.close()
    state2, store2 = open_server(tmp_path)
    assert state2.version == 3
    store2.close()


@pytest.mark.parametrize("failing_truncates", [0, 1], ids=["truncate-ok", "truncate-fails-once"])
def test_a_full_disk_on_the_log_refuses_the_push_and_the_log_recovers(tmp_path, monkeypatch, failing_truncates):
    state, store = open_server(tmp_path)
    wid = started(state)
    push(state, wid, 2)
    disk = Disk()
    monkeypatch.setattr(store_module, "open", opener(disk), raising=False)
    store.checkpoint()  # a new log segment, on the fake disk
    before = fingerprint(state)
    disk.fill(leave_bytes=10)  # part of the record gets written
    disk.failing_truncates = failing_truncates
    with pytest.raises(CheckpointError, match="disk full|No space") as info:
        push(state, wid, 3)
    assert info.value.grpc_code.name == "UNAVAILABLE"  # refused before it was applied: the worker retries
    assert_same(before, fingerprint(state))
    assert durability_errors(state)["log_write"] >= 1
    disk.clear()
    assert push(state, wid, 3).applied  # the retry, once space returned
    assert push(state, wid, 4).applied
    theta = fingerprint(state)
    crash(store)
    state2, store2 = open_server(tmp_path)  # the log has no torn record in its middle: it replays
    assert_same(theta, fingerprint(state2))
    store2.close()


def test_a_full_disk_when_a_log_segment_is_started_keeps_the_old_segment(tmp_path, monkeypatch):
    state, store = open_server(tmp_path, every=1)
    wid = started(state)

    def no_new_files(path, mode="r", *args, **kwargs):
        if "a" in mode or "w" in mode:
            raise OSError(errno.ENOSPC, "No space left on device")
        return open(path, mode, *args, **kwargs)

    monkeypatch.setattr(store_module, "open", no_new_files, raising=False)
    assert push(state, wid, 2).applied  # its checkpoint cannot start a new segment: logged, counted
    assert push(state, wid, 3).applied  # appended to the segment that was open
    assert durability_errors(state)["checkpoint"] >= 1
    monkeypatch.undo()
    assert push(state, wid, 4).applied
    theta = fingerprint(state)
    crash(store)
    state2, store2 = open_server(tmp_path)
    assert_same(theta, fingerprint(state2))
    store2.close()
