"""Durable file writes shared by the server's checkpoints (ps/durable/checkpoints.py) and a
worker's state folder (worker/state_dir.py): a reader after a crash sees the old file or
the new one, never half of one."""

from __future__ import annotations

import contextlib
import os
import pathlib
from collections.abc import Callable
from typing import BinaryIO


def fsync_dir(path: pathlib.Path) -> None:
    """fsync a folder, so that a rename or a new file in it is durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: pathlib.Path, write: Callable[[BinaryIO], object]) -> None:
    """Write via ``write(file)`` to ``<path>.tmp``, fsync it, rename it onto ``path``,
    fsync the folder.

    Raises:
        OSError: the folder cannot be written (the previous ``path``, if any, is intact,
            and no ``<path>.tmp`` is left behind); ``write``'s own exceptions likewise.
    """
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # the original error is the one to report
            tmp.unlink()
        raise
    fsync_dir(path.parent)
