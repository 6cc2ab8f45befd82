"""The open write-ahead-log segment the server appends to (store.py starts new ones; wal.py
says what a record holds). An append is all or nothing: the file is unbuffered and a
failed append is cut off again (or, when that fails too, before the next append).
"""

from __future__ import annotations

import os
import pathlib
from typing import BinaryIO


class LogSegment:
    """One log segment open for appending.

    Args:
        file: the segment's file, opened unbuffered for appending (``open(path, "ab",
            buffering=0)``); closed by ``close``.
        path: its path, for messages.
        fsync: fsync each record before ``append`` returns.
    """

    def __init__(self, file: BinaryIO, path: pathlib.Path, fsync: bool = True) -> None:
        self.path = path
        self.fsync = fsync
        self._file = file
        self._good_bytes = self._file.seek(0, os.SEEK_END)  # where the last intact record ends
        self._torn = False  # bytes of a failed append may follow _good_bytes

    def append(self, *parts: bytes | memoryview) -> None:
        """Write one record (its ``parts`` in order) and fsync it; all or nothing.

        Raises:
            OSError: the record could not be written (disk full, I/O error), or the bytes
            of an earlier failed append could not be cut off yet; the segment holds no
            part of this record either way (or, if even the cut failed, it will be cut
            before the next append).
        """
        self._repair()
        try:
            for part in parts:
                self._write_all(memoryview(part).cast("B"))
            if self.fsync:
                os.fsync(self._file.fileno())
        except OSError:
            self._torn = True
            try:
                self._repair()
            except OSError:
                pass  # cut before the next append instead; the append's own error is the one to report
            raise
        self._good_bytes = self._file.tell()

    def _write_all(self, data: memoryview) -> None:
        while data:  # an unbuffered write may take part of the bytes (a disk filling up)
            n = self._file.write(data)
            if not n:
                raise OSError(f"write to {self.path} made no progress")
            data = data[n:]

    def _repair(self) -> None:
        """Cut the bytes of a failed append off (they follow the last intact record)."""
        if self._torn:
            self._file.truncate(self._good_bytes)
            self._file.seek(self._good_bytes)
            self._torn = False

    def close(self) -> None:
        """Close the file (a torn tail left by a failed cut is dropped at the next start-up)."""
        self._file.close()
