"""A worker's ``state.pt`` damaged on disk, or written by a worker that had diverged
(worker/state_file.py, worker/state_dir.py): the restarted worker neither dies nor trains
on it. It sets the file aside as ``state.pt.corrupt-<time>``, warns once, and rejoins
under its name (the server gives it its id back) from the global model with a fresh inner
optimizer. A state file of the previous format (a bare ``torch.save``) still loads.

The CLI end-to-end case (a killed CLI worker restarted on a damaged folder) is in
``test_resume_cli.py``."""

from __future__ import annotations

import logging
import pathlib
import struct
import zlib

import pytest
import torch
from torch import nn

from asyncdiloco.algo.config import OuterConfig
from asyncdiloco.errors import ConfigError
from asyncdiloco.worker.async_worker import AsyncDiLoCoWorker
from asyncdiloco.worker.config import WorkerConfig
from asyncdiloco.worker.state_dir import STATE_FILE, SUMMARY_FILE, WorkerStateDir, saved_worker_name
from asyncdiloco.worker.state_file import HEADER_BYTES, read_state, write_state

SGD1 = OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _train(worker: AsyncDiLoCoWorker, model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randn(8, 4, generator=gen)
        nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True)).backward()
        opt.step()
        opt.zero_grad()


def _worker(srv, folder: pathlib.Path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    cfg = WorkerConfig(server=srv.address, state_dir=str(folder), heartbeat_s=30)
    return AsyncDiLoCoWorker(model, opt, cfg), model, opt


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _saved(srv, folder: pathlib.Path) -> tuple[str, int]:
    """A worker that trained 7 steps (two syncs) and closed: its name and id."""
    worker, model, opt = _worker(srv, folder)
    with worker:
        _train(worker, model, opt, 7)
        return worker.worker_name, worker.worker_id


def _bytes_of(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())


def _offset(data: bytes, where: str, state: dict) -> int:
    """The byte of ``data`` (a saved state.pt) to damage."""
    if where.startswith("header"):
        return {"header magic": 0, "header format": 8, "header length": 12, "header checksum": 21}[where]
    if where == "pickle":
        return data.index(b"inner_optimizer", HEADER_BYTES) + 3
    if where == "theta_base":  # the top exponent bit of θ_base[0] (-0.135 would read as -4.6e37)
        return data.index(_bytes_of(state["theta_base"]), HEADER_BYTES) + 3
    assert where == "exp_avg_sq"
    return data.index(_bytes_of(state["inner_optimizer"]["state"][0]["exp_avg_sq"]), HEADER_BYTES) + 1


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "state_dir" in r.getMessage()]


def _restarts_from_the_global_model(srv, folder: pathlib.Path, name: str, wid: int, damaged: bytes, caplog) -> str:
    """The restarted worker's checks; returns its one warning."""
    again, model2, opt2 = _worker(srv, folder)
    [kept] = folder.glob(f"{STATE_FILE}.corrupt-*")
    assert kept.read_bytes() == damaged and not (folder / STATE_FILE).exists()
    [warning] = _warnings(caplog)
    assert f"kept it as {kept}" in warning and f"worker {name!r} rejoins from the global model" in warning
    assert again.worker_name == name and again.restored_extra == {}
    assert not opt2.state  # a fresh inner optimizer, not a NaN or altered one
    with again:
        assert again.worker_id == wid  # the server gave it its id back by name
        assert torch.equal(_flat(model2), srv.state.params)  # it trains on from the global model
        _train(again, model2, opt2, 3)
    assert read_state(folder / STATE_FILE)["worker_name"] == name  # and saves intact states again
    return warning


@pytest.mark.parametrize(
    "where",
    ["theta_base", "exp_avg_sq", "pickle", "header magic", "header format", "header length", "header checksum"],
)
def test_a_flipped_bit_anywhere_sets_the_state_aside_and_the_worker_rejoins_as_itself(
    start_server, tmp_path, caplog, where
):
    srv = start_server(outer=SGD1, local_steps=3, dylu=False, grouping="off")
    folder = tmp_path / "w"
    name, wid = _saved(srv, folder)
    file = folder / STATE_FILE
    data = bytearray(file.read_bytes())
    data[_offset(bytes(data), where, read_state(file))] ^= 0x40
    file.write_bytes(bytes(data))
    assert saved_worker_name(folder) == name  # the CLI's check of its flags reads the name, and moves nothing
    assert file.exists()
    caplog.set_level(logging.WARNING)
    warning = _restarts_from_the_global_model(srv, folder, name, wid, bytes(data), caplog)
    expected = {"header magic": "does not begin with a state header", "header length": "bytes after its header"}
    assert expected.get(where, "fails its checksum") in warning


def test_a_truncated_state_without_its_summary_keeps_the_name_from_its_readable_part(start_server, tmp_path, caplog):
    srv = start_server(outer=SGD1, local_steps=3, dylu=False, grouping="off")
    folder = tmp_path / "w"
    name, wid = _saved(srv, folder)
    (folder / SUMMARY_FILE).unlink()
    file = folder / STATE_FILE
    data = file.read_bytes()
    state = read_state(file)
    damaged = bytearray(data)
    damaged[_offset(data, "theta_base", state)] ^= 0x40  # the pickle still parses: the name is readable
    file.write_bytes(bytes(damaged))
    caplog.set_level(logging.WARNING)
    _restarts_from_the_global_model(srv, folder, name, wid, bytes(damaged), caplog)
    caplog.clear()
    (folder / SUMMARY_FILE).write_text(f'{{"worker_name": "{name}"}}')
    cut = (folder / STATE_FILE).read_bytes()[:-100]
    (folder / STATE_FILE).write_bytes(cut)
    (folder / f"{STATE_FILE}.corrupt-keep").write_bytes(b"")  # an older one is never overwritten
    again, _, _ = _worker(srv, folder)
    [warning] = _warnings(caplog)
    assert "bytes after its header, which says" in warning and again.worker_name == name
    assert len(list(folder.glob(f"{STATE_FILE}.corrupt-*"))) == 3
    again.close()


@pytest.mark.parametrize("where", ["theta_base", "theta_local", "exp_avg_sq"])
def test_an_intact_state_with_non_finite_values_is_set_aside_too(start_server, tmp_path, caplog, where):
    """A worker that had diverged saved NaN: loading it would make every restart diverge."""
    srv = start_server(outer=SGD1, local_steps=3, dylu=False, grouping="off")
    folder = tmp_path / "w"
    name, wid = _saved(srv, folder)
    file = folder / STATE_FILE
    state = read_state(file)
    target = state["inner_optimizer"]["state"][1]["exp_avg_sq"] if where == "exp_avg_sq" else state[where]
    target.view(-1)[2] = float("nan") if where != "exp_avg_sq" else float("inf")
    with open(file, "wb") as f:
        write_state(f, state)  # a valid checksum: the values themselves are the problem
    caplog.set_level(logging.WARNING)
    warning = _restarts_from_the_global_model(srv, folder, name, wid, file.read_bytes(), caplog)
    assert "holds non-finite values in" in warning and "first at index 2" in warning and "diverged" in warning


def test_an_intact_state_of_a_newer_format_is_refused_not_set_aside(tmp_path):
    folder = tmp_path / "w"
    folder.mkdir()
    with open(folder / STATE_FILE, "wb") as f:
        write_state(f, {"format": 2, "worker_name": "w1"})
    data = bytearray((folder / STATE_FILE).read_bytes())
    data[8] = 3  # the header's format; its checksum covers it, so make the file consistent again
    size = len(data) - HEADER_BYTES
    data[20:HEADER_BYTES] = struct.pack("<I", zlib.crc32(bytes(data[HEADER_BYTES:]) + struct.pack("<IQ", 3, size)))
    (folder / STATE_FILE).write_bytes(bytes(data))
    with pytest.raises(ConfigError, match="has format 3; this worker reads format 2: run the version") as first:
        WorkerStateDir(folder)
    assert (folder / STATE_FILE).exists()
    with pytest.raises(ConfigError, match="has format 3"):  # the refusal released the folder (not "in use")
        WorkerStateDir(folder)
    del first


def test_a_run_that_dies_before_its_next_save_leaves_the_name_to_the_one_after(start_server, tmp_path, caplog):
    """The restart set the damaged file aside, then died before it joined and saved (e.g.
    the server was down): the run after it still rejoins under the name, by state.json."""
    srv = start_server(outer=SGD1, local_steps=3, dylu=False, grouping="off")
    folder = tmp_path / "w"
    name, wid = _saved(srv, folder)
    (folder / STATE_FILE).write_bytes(b"")  # an empty file: e.g. a file system that lost its blocks
    caplog.set_level(logging.WARNING)
    died, _, _ = _worker(srv, folder)
    assert died.worker_name == name
    assert "does not begin with a state header (0 bytes" in _warnings(caplog)[0]
    died.state_dir.close()  # the process dies here, before any save
    assert saved_worker_name(folder) == name
    again, _, _ = _worker(srv, folder)
    with again:
        assert (again.worker_name, again.worker_id) == (name, wid)
    assert len(_warnings(caplog)) == 1
