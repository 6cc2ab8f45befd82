"""The global model of a checkpoint folder, written as a safetensors file: the newest
durable state restored read-only (ps/durable/store.py ``restore_read_only``; the folder is not
changed or locked, so it runs beside the server), one tensor per parameter with the
metadata ``format``, ``asyncdiloco_export``, ``version``, ``manifest_hash``, ``dtype``
and ``lsn`` (docs/operations.md "Getting the model out").
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib

import torch

from asyncdiloco._atomic import write_atomically
from asyncdiloco.errors import CheckpointError, ConfigError
from asyncdiloco.ps.durable.store import DurableStore, read_only_config
from asyncdiloco.ps.state import ParameterServerState
from asyncdiloco.wire.tensors import Manifest

log = logging.getLogger(__name__)

#: ``--dtype``: each parameter's manifest dtype, or float32 for all.
EXPORT_DTYPES = ("manifest", "float32")
#: The layout written (metadata ``asyncdiloco_export``).
EXPORT_FORMAT = "1"
#: Reads of a folder its running server changes meanwhile (a pruned checkpoint or log
#: segment) are tried this many times.
ATTEMPTS = 3


@dataclasses.dataclass(frozen=True)
class Exported:
    """What ``export_global_model`` wrote."""

    path: str
    version: int
    manifest: Manifest
    #: The last write-ahead log record the model includes.
    lsn: int
    num_bytes: int


def restore(folder: pathlib.Path) -> tuple[ParameterServerState, int]:
    """The newest durable state of ``folder``, read-only, and its LSN; a read that a
    running server's pruning overtook is tried again.

    Raises:
        CheckpointError: no folder, no checkpoint, or an unusable one (the message says
        which file and the fix).
    """
    for attempt in range(1, ATTEMPTS + 1):
        config = read_only_config(folder)
        assert config.durability is not None, "read_only_config names the folder"
        state = ParameterServerState(config)
        store = DurableStore(config.durability, config)
        try:
            store.restore_read_only(state.durability)
            return state, store.lsn
        except (CheckpointError, OSError) as exc:
            if attempt == ATTEMPTS:
                if isinstance(exc, CheckpointError):
                    raise
                raise CheckpointError(f"{folder} cannot be read ({exc}); check the folder's permissions") from None
            log.info("reading %s failed (%s), probably pruned by its running server; trying again", folder, exc)
    raise AssertionError("unreachable")


def export_global_model(folder: str | os.PathLike, out: str | os.PathLike, dtype: str = "manifest") -> Exported:
    """Write the newest durable global model of the checkpoint folder ``folder`` to the
    safetensors file ``out`` (replaced atomically; see the module docstring).

    Args:
        folder: a server's ``--checkpoint-dir`` (read, never changed; the server may run).
        out: the file to write; its folder must exist.
        dtype: "manifest" (each parameter in its dtype in the manifest) or "float32".
    Returns:
        What was written: path, version, manifest, LSN, size in bytes.
    Raises:
        ConfigError: an unknown ``dtype``; ``out`` is a folder, its folder does not exist,
            or it cannot be written (nothing is left behind).
        CheckpointError: the folder holds no usable checkpoint, or no global model yet.
    """
    if dtype not in EXPORT_DTYPES:
        raise ConfigError(f"dtype {dtype!r} is invalid: choose one of {EXPORT_DTYPES}")
    target = _checked_out(pathlib.Path(out))
    state, lsn = restore(pathlib.Path(folder))
    if state.params is None or state.model.manifest is None:
        raise CheckpointError(
            f"{folder} holds no global model yet: no worker had pushed its initial parameters when it was "
            f"written; export once a worker has joined and pushed"
        )
    tensors = named_parameters(state.params, state.model.manifest, dtype)
    metadata = {
        "format": "pt",
        "asyncdiloco_export": EXPORT_FORMAT,
        "version": str(state.version),
        "manifest_hash": state.model.manifest.manifest_hash,
        "dtype": dtype,
        "lsn": str(lsn),
    }
    _write(target, tensors, metadata)
    return Exported(str(target), state.version, state.model.manifest, lsn, target.stat().st_size)


def _checked_out(target: pathlib.Path) -> pathlib.Path:
    """``out`` if a file can be written there, else ConfigError (before the restore)."""
    if target.is_dir():
        raise ConfigError(
            f"--out {str(target)!r} is invalid: it is a folder; give a file, e.g. {target / 'model.safetensors'}"
        )
    if not target.parent.is_dir():
        raise ConfigError(f"--out {str(target)!r} is invalid: folder {target.parent} does not exist; create it first")
    return target


def _write(target: pathlib.Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """The safetensors bytes, written atomically (a reader sees the old file or the whole
    new one; a failed write leaves no temp file) with the usual permissions, 0666 less
    the umask (``save_file`` would leave 0600, its temp file's). The whole file is held
    in memory once, beside θ.

    Raises:
        ConfigError: ``target`` cannot be written (permissions, no space, not a real folder).
    """
    from safetensors.torch import save

    try:
        write_atomically(target, lambda f: f.write(save(tensors, metadata=metadata)))
    except OSError as exc:
        raise ConfigError(
            f"--out {str(target)!r} cannot be written ({exc}); give a file in a folder you can write"
        ) from None


def named_parameters(params: torch.Tensor, manifest: Manifest, dtype: str = "manifest") -> dict[str, torch.Tensor]:
    """θ (float32 (N,), manifest order) cut into ``{name: tensor of its shape}``, each in
    its manifest dtype (``dtype="manifest"``) or float32; contiguous copies, as
    safetensors stores them."""
    out, pos = {}, 0
    for spec in manifest.tensors:
        t = params[pos : pos + spec.numel].view(spec.shape)
        out[spec.name] = t.to(spec.dtype if dtype == "manifest" else torch.float32).clone().contiguous()
        pos += spec.numel
    return out
