"""A sharded server's files: ``shard.json`` (``{"shard_index": i, "shard_count": S}``) in each
shard's checkpoint folder, so a folder of another split is refused at start (a folder
without it that holds state is shard 0 of 1), and ``ROOT/shards.json`` of ``--shards S``
on one host (per shard its address, folder and version). docs/architecture.md.
"""

from __future__ import annotations

import json
from pathlib import Path

from asyncdiloco.errors import CheckpointError

IDENTITY = "shard.json"
MANIFEST = "shards.json"


def _has_state(folder: Path) -> bool:
    return any(p.name.startswith(("ckpt", "wal-")) for p in folder.iterdir()) if folder.is_dir() else False


def check_shard_identity(folder: str | Path, shard_index: int, shard_count: int) -> None:
    """Refuse to resume ``folder`` as shard ``shard_index`` of ``shard_count`` when it
    belongs to another split; otherwise record this identity in it.

    Raises:
        CheckpointError: the folder was written as shard i' of S' with (i', S') ≠ (i, S).
    """
    folder = Path(folder)
    path = folder / IDENTITY
    if path.exists():
        try:
            data = json.loads(path.read_text())
            had_index, had_count = int(data["shard_index"]), int(data["shard_count"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{path} is unreadable ({exc}); restore it or remove the folder") from exc
    elif _has_state(folder):
        had_index, had_count = 0, 1
    else:
        had_index, had_count = shard_index, shard_count
    if had_count != shard_count:
        raise CheckpointError(
            f"checkpoint folder {str(folder)!r} belongs to a parameter server of {had_count} shard(s) but this one "
            f"starts with {shard_count}: the shards' parameter ranges differ. Restart with --shards {had_count} "
            f"(the run's count), or start a new run in an empty folder"
        )
    if had_index != shard_index:
        raise CheckpointError(
            f"checkpoint folder {str(folder)!r} holds shard {had_index} of {had_count}, not shard {shard_index}; "
            f"give each shard its own folder (--shard-index {had_index} for this one)"
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"shard_index": shard_index, "shard_count": shard_count}) + "\n")
    except OSError as exc:
        raise CheckpointError(
            f"checkpoint dir {folder} cannot be created ({exc.strerror}); give a folder path this process "
            f"may create and write"
        ) from None


def check_root(root: str | Path, shard_count: int) -> None:
    """``--shards S`` on one host: refuse a root folder of a run with another count.

    Raises:
        CheckpointError: ``ROOT/shards.json`` names another count, or ROOT holds an unsharded run.
    """
    root = Path(root)
    path = root / MANIFEST
    if path.exists():
        try:
            had = int(json.loads(path.read_text())["shard_count"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{path} is unreadable ({exc}); restore it or remove the folder") from exc
    elif _has_state(root):
        had = 1
    else:
        return
    if had != shard_count:
        raise CheckpointError(
            f"checkpoint folder {str(root)!r} belongs to a parameter server of {had} shard(s) but this one starts "
            f"with {shard_count}: the shards' parameter ranges differ. Restart with --shards {had} (the run's "
            f"count), or start a new run in an empty folder"
        )


def write_manifest(root: str | Path, shards: list[dict]) -> None:
    """Write ``ROOT/shards.json``: ``{"shard_count": S, "shards": [{"index", "address",
    "checkpoint_dir", "version"}, ...]}`` (atomically: a temp file, then a rename)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"shard_count": len(shards), "shards": shards}, indent=1) + "\n")
    tmp.replace(root / MANIFEST)
