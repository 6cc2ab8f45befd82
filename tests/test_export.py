"""The model out: ``asyncdiloco export`` (tools/export.py; ps/durable/store.py's read-only
restore) and ``load_global_model`` (worker/global_model.py).

The export of a real server's folder, written while it runs, with pushes after its last
checkpoint (so the log replay matters), equals the server's live θ, loads strict into the
default model and leaves the folder as it was; a torn tail is not cut; the dtypes; a
missing or empty folder. ``load_global_model`` equals the server's θ and refuses another model.
"""

from __future__ import annotations

import fcntl
import json
import os

import pytest
import safetensors
import torch
from _default_job import DefaultJobRun, default_model
from helpers import crash, flat
from torch import nn

import asyncdiloco
from asyncdiloco.errors import CheckpointError, ManifestMismatchError, NotInitializedError
from asyncdiloco.job.config import JobConfig
from asyncdiloco.ps.config import DurabilityConfig, ServerConfig
from asyncdiloco.ps.durable.store import DurableStore
from asyncdiloco.ps.state import ParameterServerState
from asyncdiloco.tools.export import export_global_model, named_parameters
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.tensors import Manifest

pytestmark = pytest.mark.timeout(120)


def folder_snapshot(folder) -> dict:
    """name -> (size, mtime in ns, bytes' hash) of every file in ``folder``."""
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns, hash(p.read_bytes())) for p in folder.iterdir()}


def newest_checkpoint_version(folder) -> int:
    return json.loads(sorted(folder.glob("ckpt-*.json"))[-1].read_text())["version"]


@pytest.fixture
def durable_run(start_server, tmp_path):
    """A running server of the default job with a checkpoint every 3 logged pushes: the
    initial push and 4 pseudo-gradients, so versions 3 and 4 are in the log only."""
    folder = tmp_path / "ckpt"
    srv = start_server(grouping="off", durability=DurabilityConfig(checkpoint_dir=str(folder), checkpoint_every=3))
    run = DefaultJobRun(srv.address)
    a = run.join("a")
    b = run.join("b")
    for k in range(4):
        run.push((a, b)[k % 2], seed=k)
    yield srv, folder
    run.close()


def test_export_while_the_server_runs_equals_its_live_model(durable_run, tmp_path):
    srv, folder = durable_run
    assert srv.state.version == 4 and newest_checkpoint_version(folder) == 2  # two pushes to replay
    before = folder_snapshot(folder)
    out = tmp_path / "model.safetensors"
    done = export_global_model(folder, out)
    assert folder_snapshot(folder) == before  # nothing written, renamed, cut or removed
    with open(folder / "LOCK") as lock, pytest.raises(BlockingIOError):  # the server still holds its folder
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    state = safetensors.torch.load_file(str(out))
    live = named_parameters(srv.state.params, srv.state.model.manifest)
    assert set(state) == set(live)
    for name, t in live.items():
        assert torch.equal(state[name], t), name
    model = default_model()
    model.load_state_dict(state, strict=True)  # the docs' three lines
    assert torch.equal(flat(model), srv.state.params)
    assert done.version == 4 and done.path == str(out)
    with safetensors.safe_open(str(out), "pt") as f:
        meta = f.metadata()
    assert meta["version"] == "4" and meta["manifest_hash"] == Manifest.from_module(model).manifest_hash
    assert meta["format"] == "pt" and meta["asyncdiloco_export"] == "1" and meta["dtype"] == "manifest"


def test_the_export_command_prints_what_it_wrote(durable_run, tmp_path, capsys):
    from asyncdiloco.cli import app

    srv, folder = durable_run
    out = tmp_path / "m.safetensors"
    args = app.build_parser().parse_args(["export", "--checkpoint-dir", str(folder), "--out", str(out)])
    assert args.func(args) == 0
    line = capsys.readouterr().out
    assert line.startswith(f"asyncdiloco export: wrote {out}: version 4, 29 parameters") and out.is_file()


# --------------------------------------------------- the store's folder, network-free
MANIFEST = Manifest.from_named_tensors(
    [("enc.weight", torch.zeros(3, 4)), ("head", torch.zeros(5, dtype=torch.bfloat16))]
)


def crashed_folder(tmp_path):
    """A folder whose server died (kill -9) after 6 pushes, a checkpoint every 4; returns
    (folder, θ at the crash, version)."""
    cfg = ServerConfig(port=0, durability=DurabilityConfig(checkpoint_dir=str(tmp_path / "c"), checkpoint_every=4))
    state, store = ParameterServerState(cfg), DurableStore(cfg.durability, cfg)
    store.open(state.durability)
    wid, _, _ = state.join(MANIFEST, "w")
    gen = torch.Generator().manual_seed(0)
    for k in range(6):
        tensors = [torch.randn(t.shape, generator=gen).to(t.dtype) for t in MANIFEST.tensors]
        kind = pb.PUSH_KIND_INITIAL_PARAMETERS if k == 0 else pb.PUSH_KIND_PSEUDO_GRADIENT
        state.intake.push(MANIFEST.pack(tensors), worker_id=wid, push_id=k + 1, base_version=state.version, kind=kind)
    crash(store)
    return tmp_path / "c", state.params.clone(), state.version


def test_a_torn_tail_is_read_around_not_cut(tmp_path):
    folder, params, version = crashed_folder(tmp_path)
    last = sorted(folder.glob("wal-*.log"))[-1]
    with open(last, "ab") as f:
        f.write(b"ADWL\x02" + b"\x00" * 7)  # a record's head cut off: an append in progress
    size = last.stat().st_size
    done = export_global_model(folder, tmp_path / "m.safetensors", dtype="float32")
    assert last.stat().st_size == size and done.version == version == 5
    state = safetensors.torch.load_file(str(tmp_path / "m.safetensors"))
    assert torch.equal(torch.cat([state["enc.weight"].reshape(-1), state["head"]]), params)


def test_manifest_dtype_by_default_float32_on_request(tmp_path):
    folder, params, _ = crashed_folder(tmp_path)
    export_global_model(folder, tmp_path / "a.safetensors")
    export_global_model(folder, tmp_path / "b.safetensors", dtype="float32")
    a = safetensors.torch.load_file(str(tmp_path / "a.safetensors"))
    b = safetensors.torch.load_file(str(tmp_path / "b.safetensors"))
    assert a["enc.weight"].dtype == torch.float32 and a["head"].dtype == torch.bfloat16
    assert b["head"].dtype == torch.float32 and torch.equal(b["head"], params[12:])
    assert torch.equal(a["head"], params[12:].to(torch.bfloat16))


def test_a_missing_or_empty_folder_is_a_clear_error(tmp_path, cli_exit):
    with pytest.raises(CheckpointError, match="does not exist or is not a folder: give the --checkpoint-dir"):
        export_global_model(tmp_path / "nope", tmp_path / "m.safetensors")
    (tmp_path / "empty").mkdir()
    code, err = cli_exit(["export", "--checkpoint-dir", str(tmp_path / "empty"), "--out", str(tmp_path / "m")])
    assert code == 1 and f"{tmp_path / 'empty'} holds no checkpoint" in err
    assert not os.listdir(tmp_path / "empty")  # nothing created there
    code, err = cli_exit(["export", "--checkpoint-dir", str(tmp_path), "--out", str(tmp_path / "no" / "m")])
    assert code == 2 and "create it first" in err


# ------------------------------------------------------------ load_global_model
def test_load_global_model_equals_the_servers_params(durable_run):
    srv, _ = durable_run
    model = default_model()
    assert asyncdiloco.load_global_model(model, srv.address) == 4
    assert torch.equal(flat(model), srv.state.params)


def test_load_global_model_refuses_another_model(durable_run):
    srv, _ = durable_run
    other = nn.Sequential(nn.Linear(4, 2))
    before = flat(other)
    with pytest.raises(ManifestMismatchError, match=r"parameter #0 'tok_emb.weight': name is 0.weight"):
        asyncdiloco.load_global_model(other, srv.address)
    assert torch.equal(flat(other), before)  # untouched
    narrower = default_model(JobConfig(n_embd=64))
    with pytest.raises(ManifestMismatchError, match=r"'tok_emb.weight': shape is \(65, 64\) on the worker"):
        asyncdiloco.load_global_model(narrower, srv.address)


def test_load_global_model_before_any_worker_pushed(start_server):
    srv = start_server()
    with pytest.raises(NotInitializedError, match="no global model yet"):
        asyncdiloco.load_global_model(default_model(), srv.address)


def test_the_export_command_puts_the_library_log_levels_back(durable_run, tmp_path, cli_exit):
    """An in-process export (as here) must not leave the server's loggers at WARNING for
    whatever runs next in the process."""
    import logging

    _, folder = durable_run
    ps_log = logging.getLogger("asyncdiloco.ps")
    before = ps_log.level
    code, _ = cli_exit(["export", "--checkpoint-dir", str(folder), "--out", str(tmp_path / "m.safetensors")])
    assert code == 0 and ps_log.level == before


def test_an_out_that_cannot_be_written_is_one_line_and_leaves_no_temp_file(tmp_path, cli_exit, monkeypatch):
    folder, _, _ = crashed_folder(tmp_path)
    (tmp_path / "d").mkdir()
    code, err = cli_exit(["export", "--checkpoint-dir", str(folder), "--out", str(tmp_path / "d")])
    assert code == 2 and f"--out '{tmp_path / 'd'}' is invalid: it is a folder" in err and "model.safetensors" in err
    assert not os.listdir(tmp_path / "d")
    code, err = cli_exit(["export", "--checkpoint-dir", str(folder), "--out", "/proc/x"])
    assert code == 2 and "--out '/proc/x' cannot be written" in err and len(err.strip().splitlines()) == 1

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save", disk_full)
    code, err = cli_exit(["export", "--checkpoint-dir", str(folder), "--out", str(tmp_path / "m.safetensors")])
    assert code == 2 and "No space left on device" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "d"]  # no m.safetensors.tmp


def test_the_exported_file_has_the_usual_permissions(tmp_path):
    folder, _, _ = crashed_folder(tmp_path)
    umask = os.umask(0o022)
    try:
        export_global_model(folder, tmp_path / "m.safetensors")
    finally:
        os.umask(umask)
    assert (tmp_path / "m.safetensors").stat().st_mode & 0o777 == 0o644  # readable by others, as cp would leave it
