"""Checkpoint files: the tensor file and its JSON sidecar, written atomically, verified
on load, pruned to the newest two (store.py decides when; durable.py says what is in them).

A checkpoint ``ckpt-<LSN>`` is ``ckpt-<LSN>.pt`` (``torch.save`` of the named fp32
tensors, read back with ``torch.load(weights_only=True)``: no pickled objects) and
``ckpt-<LSN>.json``: the state's meta plus the format, the LSN, the outer-optimizer and
wire-codec settings, the tensor file's size and SHA-256, and the SHA-256 of the sidecar
itself (``meta_sha256``, over its canonical JSON). Each file is written to a temp name,
fsynced, renamed and the folder fsynced; the sidecar is renamed last and is the commit
point. The format is fixed: old checkpoints must load.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import time

import torch

from asyncdiloco._atomic import write_atomically
from asyncdiloco.errors import CheckpointError
from asyncdiloco.ps.config import ServerConfig

#: Checkpoint format (the sidecar's ``format``).
FORMAT = 1
KEEP_CHECKPOINTS = 2


def sha256_file(path: pathlib.Path) -> str:
    """The SHA-256 of a file's bytes, hex."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def wire_settings(config: ServerConfig) -> dict:
    """The wire codec a run's push records are encoded with (block size only for int8)."""
    return {
        "wire_codec": config.wire_codec,
        "codec_block_size": config.codec_block_size if config.wire_codec == "int8" else 0,
    }


def canonical(meta: dict) -> bytes:
    """The sidecar's canonical JSON (sorted keys, no spaces): what ``meta_sha256`` covers."""
    return json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()


def checkpoint_lsns(folder: pathlib.Path) -> list[int]:
    """LSNs of committed checkpoints (those with a sidecar), newest first."""
    out = []
    for p in folder.glob("ckpt-*.json"):
        try:
            out.append(int(p.stem.split("-", 1)[1]))
        except ValueError:
            continue
    return sorted(out, reverse=True)


def load_checkpoint(folder: pathlib.Path, lsn: int, config: ServerConfig) -> tuple[dict, dict[str, torch.Tensor]]:
    """The checkpoint of ``lsn``: its meta (the sidecar) and its tensors, verified.

    Raises:
        CheckpointError: a file is missing, corrupt (SHA-256), of another format, or
        written with another outer optimizer or wire codec than ``config``'s.
    """
    side = folder / f"ckpt-{lsn:020d}.json"
    try:
        meta = json.loads(side.read_bytes())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {side} cannot be read ({exc})") from None
    claimed = meta.pop("meta_sha256", None) if isinstance(meta, dict) else None
    if claimed != hashlib.sha256(canonical(meta)).hexdigest():
        raise CheckpointError(f"checkpoint {side} fails its checksum (meta_sha256): it is corrupt")
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {side} has format {meta.get('format')}; this server reads format {FORMAT}")
    mine = dataclasses.asdict(config.outer)
    for field, value in meta["outer"].items():
        if mine.get(field) != value:
            raise CheckpointError(
                f"checkpoint {side} was written with outer {field}={value!r} but this server is configured "
                f"with {mine.get(field)!r}; restart with the checkpoint's setting (replaying the log needs it) "
                f"or use a fresh --checkpoint-dir"
            )
    stored_wire = meta["wire"]
    for field, value in wire_settings(config).items():
        if stored_wire.get(field) != value:
            flag = "--wire-codec" if field == "wire_codec" else "--codec-block-size"
            raise CheckpointError(
                f"checkpoint {side} was written with {field}={stored_wire.get(field)!r} but this server is "
                f"configured with {value!r}; restart with the checkpoint's {flag} (its write-ahead log holds "
                f"pushes encoded that way) or use a fresh --checkpoint-dir"
            )
    pt = folder / meta["tensor_file"]
    if not pt.is_file() or pt.stat().st_size != meta["tensor_bytes"] or sha256_file(pt) != meta["tensor_sha256"]:
        raise CheckpointError(f"checkpoint tensors {pt} are missing, truncated or corrupt (size or SHA-256 differ)")
    try:
        tensors = torch.load(pt, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means an unusable file
        raise CheckpointError(f"checkpoint tensors {pt} cannot be loaded ({exc})") from None
    return meta, tensors


def write_checkpoint(
    folder: pathlib.Path, lsn: int, meta: dict, tensors: dict[str, torch.Tensor], config: ServerConfig
) -> None:
    """Write ``ckpt-<lsn>.pt`` (the tensors) then ``ckpt-<lsn>.json`` (the sidecar, the
    commit point), each atomically; ``meta`` gains the format, the LSN, the settings and
    the checksums."""
    name = f"ckpt-{lsn:020d}"
    pt = folder / f"{name}.pt"
    write_atomically(pt, lambda f: torch.save(tensors, f))
    meta.update(
        format=FORMAT,
        lsn=lsn,
        outer=dataclasses.asdict(config.outer),
        wire=wire_settings(config),
        tensor_file=pt.name,
        tensor_bytes=pt.stat().st_size,
        tensor_sha256=sha256_file(pt),
        created_unix_s=time.time(),
    )
    meta["meta_sha256"] = hashlib.sha256(canonical(meta)).hexdigest()
    write_atomically(folder / f"{name}.json", lambda f: f.write(json.dumps(meta, indent=1).encode()))


def remove_partial_checkpoint(folder: pathlib.Path, lsn: int) -> None:
    """Remove what a failed write of checkpoint ``lsn`` may have left (its temp files,
    and its tensor file when the sidecar, the commit point, was never written)."""
    name = f"ckpt-{lsn:020d}"
    for leftover in (f"{name}.pt.tmp", f"{name}.json.tmp"):
        (folder / leftover).unlink(missing_ok=True)
    if not (folder / f"{name}.json").exists():
        (folder / f"{name}.pt").unlink(missing_ok=True)


def prune(folder: pathlib.Path, segments: list[tuple[int, pathlib.Path]]) -> None:
    """Keep the newest checkpoints and the log back to the oldest kept one."""
    lsns = checkpoint_lsns(folder)
    for old in lsns[KEEP_CHECKPOINTS:]:
        for suffix in (".json", ".pt"):
            (folder / f"ckpt-{old:020d}{suffix}").unlink(missing_ok=True)
    oldest_kept = lsns[:KEEP_CHECKPOINTS][-1]
    for (_first, path), (next_first, _) in zip(segments, segments[1:]):
        if next_first - 1 <= oldest_kept:  # every record in it is covered by a kept checkpoint
            path.unlink(missing_ok=True)
    for p in folder.glob("ckpt-*.pt"):  # tensor files whose sidecar never got written
        if not p.with_suffix(".json").exists():
            p.unlink(missing_ok=True)
