"""A server checkpoint whose tensors are not exactly the model's is refused (issue 32,
item 3): a tensor the model lacks (with its momentum, the sidecar re-signed so every
checksum holds), a missing one, a reshaped one and a re-typed one are each named, with
the documented way to convert a checkpoint on purpose. An untouched checkpoint restores."""

from __future__ import annotations

import hashlib
import json
import pathlib
import re

import helpers
import pytest
import torch

from asyncdiloco.algo.config import OuterConfig
from asyncdiloco.errors import CheckpointError
from asyncdiloco.ps.config import DurabilityConfig, ServerConfig
from asyncdiloco.ps.durable.checkpoints import canonical, sha256_file
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.tensors import Manifest

pytestmark = pytest.mark.timeout(60)

MANIFEST = Manifest.from_named_tensors([("w", torch.zeros(2, 3)), ("b", torch.zeros(3))])
OUTER = OuterConfig(optimizer="nesterov", lr=0.7, momentum=0.9)  # keeps a momentum per tensor


def _config(tmp_path: pathlib.Path) -> ServerConfig:
    return ServerConfig(
        port=0, outer=OUTER, durability=DurabilityConfig(checkpoint_dir=str(tmp_path / "ckpt"), fsync=False)
    )


def _checkpointed(tmp_path: pathlib.Path, saved: list | None = None) -> pathlib.Path:
    """A folder whose newest checkpoint holds the model after one push (θ and momentum);
    θ is appended to ``saved``."""
    state, store = helpers.open_durable(_config(tmp_path))
    wid, _, _ = state.join(MANIFEST, "a")
    state.intake.push(
        MANIFEST.pack([torch.zeros(2, 3), torch.zeros(3)]),
        worker_id=wid,
        push_id=1,
        kind=pb.PUSH_KIND_INITIAL_PARAMETERS,
    )
    state.intake.push(
        MANIFEST.pack([torch.ones(2, 3), torch.ones(3)]), worker_id=wid, push_id=2, base_version=0, num_local_steps=1
    )
    if saved is not None:
        saved.append(state.model.theta.clone())
    store.close()  # a checkpoint: the log after it is empty
    return tmp_path / "ckpt"


def _rewrite_newest(folder: pathlib.Path, change) -> None:
    """``change(tensors)`` in the newest checkpoint, its sidecar re-signed (size, SHA-256s)."""
    side = max(folder.glob("ckpt-*.json"))
    meta = json.loads(side.read_text())
    pt = folder / meta["tensor_file"]
    tensors = torch.load(pt, weights_only=True)
    change(tensors)
    torch.save(tensors, pt)
    meta.pop("meta_sha256")
    meta.update(tensor_bytes=pt.stat().st_size, tensor_sha256=sha256_file(pt))
    meta["meta_sha256"] = hashlib.sha256(canonical(meta)).hexdigest()
    side.write_text(json.dumps(meta))


def _extra(tensors) -> None:
    tensors["param/extra"] = torch.zeros(5)
    tensors["momentum/extra"] = torch.zeros(5)


def _missing(tensors) -> None:
    del tensors["momentum/b"]


def _reshaped(tensors) -> None:
    tensors["param/w"] = tensors["param/w"].reshape(3, 2)


def _retyped(tensors) -> None:
    tensors["momentum/w"] = tensors["momentum/w"].double()


@pytest.mark.parametrize(
    "change, named",
    [
        (_extra, ["extra 'param/extra' (float32 (5,)), 'momentum/extra' (float32 (5,)): the model has no such"]),
        (_missing, ["missing 'momentum/b' (float32 (3,))"]),
        (_reshaped, ["reshaped: 'param/w' is (3, 2) where the model's is (2, 3)"]),
        (_retyped, ["re-typed: 'momentum/w' is torch.float64 where the model's is torch.float32"]),
    ],
    ids=["extra", "missing", "reshaped", "retyped"],
)
def test_a_checkpoint_whose_tensors_differ_from_the_model_is_refused_naming_them(tmp_path, change, named):
    folder = _checkpointed(tmp_path)
    _rewrite_newest(folder, change)
    with pytest.raises(CheckpointError) as info:
        helpers.open_durable(_config(tmp_path))
    message = str(info.value)
    for text in named:
        assert text in message, message
    assert re.search(r"checkpoint tensors ckpt-\d+\.pt do not match the model", message), message
    assert "asyncdiloco export" in message and '"Converting a checkpoint on purpose"' in message, message


def test_every_difference_is_named_at_once(tmp_path):
    folder = _checkpointed(tmp_path)
    _rewrite_newest(folder, lambda t: [f(t) for f in (_extra, _missing, _reshaped, _retyped)])
    with pytest.raises(CheckpointError) as info:
        helpers.open_durable(_config(tmp_path))
    for key in ("param/extra", "momentum/extra", "momentum/b", "param/w", "momentum/w"):
        assert repr(key) in str(info.value), info.value


def test_an_untouched_checkpoint_restores_the_model(tmp_path):
    saved: list = []
    folder = _checkpointed(tmp_path, saved)
    _rewrite_newest(folder, lambda tensors: None)  # re-signed, unchanged
    state, store = helpers.open_durable(_config(tmp_path))
    try:
        assert state.version == 1 and torch.equal(state.model.theta, saved[0])
    finally:
        store.close()
