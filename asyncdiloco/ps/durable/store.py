"""The durable store: checkpoints plus a write-ahead log, so that every push a worker was
told about survives ``kill -9`` and is applied exactly once (``DurableStore``: append and
fsync before apply, checkpoints every ``checkpoint_every`` pushes, restore and replay at
start-up, a ``LOCK`` file per folder, a read-only restore for the export). The mechanism
and the folder layout: docs/operations.md, "Checkpoints, and what a crash loses".
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import pathlib
import threading
import time
from typing import TextIO

import torch

from asyncdiloco._atomic import fsync_dir
from asyncdiloco.algo.config import OuterConfig
from asyncdiloco.errors import CheckpointError
from asyncdiloco.ps.books import AppliedAs, JournaledState, LoggedJoin
from asyncdiloco.ps.config import DurabilityConfig, ServerConfig
from asyncdiloco.ps.core import Observer
from asyncdiloco.ps.durable.checkpoints import (
    checkpoint_lsns,
    load_checkpoint,
    prune,
    remove_partial_checkpoint,
    write_checkpoint,
)
from asyncdiloco.ps.durable.segment import LogSegment
from asyncdiloco.ps.durable.wal import (
    JOIN,
    PUSH,
    encode_record,
    manifest_to_json,
    push_meta,
    read_segment,
    replay_record,
)
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.codec import DEFAULT_BLOCK_SIZE

log = logging.getLogger(__name__)


class DurableStore:
    """Checkpoints and write-ahead log of one ``ParameterServerState`` (through its ``durability``).

    Args:
        config: folder, checkpoint cadence, fallback policy.
        server_config: the server's configuration (its outer optimizer and wire codec
            must equal the checkpoint's, or replaying the log would not reproduce the model).
    """

    def __init__(self, config: DurabilityConfig, server_config: ServerConfig) -> None:
        self.config = config
        self.server_config = server_config
        self.dir = pathlib.Path(config.checkpoint_dir)
        self.lsn = 0  # LSN of the newest record written (or loaded)
        self._segment: LogSegment | None = None  # the current log segment
        self._pushes_since_checkpoint = 0
        self._ckpt_lock = threading.Lock()
        self._lock_file: TextIO | None = None
        self._state: JournaledState | None = None
        self._broken: str | None = None
        self._good_lsns: set[int] = set()  # checkpoints loaded or written by this process
        self._opened_fresh = False  # open() found no checkpoint (a fresh run)
        #: Times each log write and checkpoint (the state's observer, set by server.py).
        self.observer = Observer()

    # ------------------------------------------------------------ start-up
    def open(self, state: JournaledState) -> None:
        """Lock the folder, restore ``state`` from the newest good checkpoint and the
        log after it, checkpoint, and start journaling ``state``'s changes.

        Raises:
            CheckpointError: the folder is in use, or its newest checkpoint or log is
            unusable (see the message for which file and the fix).
        """
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(
                f"checkpoint dir {self.dir} cannot be created ({exc.strerror}); give a folder path this "
                f"process may write to"
            ) from None
        self._lock_dir()
        try:
            for tmp in self.dir.glob("*.tmp"):
                tmp.unlink()
            checkpoints = checkpoint_lsns(self.dir)
            self._opened_fresh = not checkpoints
            if not checkpoints:
                if self._segments():
                    raise CheckpointError(
                        f"{self.dir} holds a write-ahead log but no checkpoint; it was not written by this "
                        f"server or was damaged: give an empty or a complete --checkpoint-dir"
                    )
                log.info("checkpoint dir %s is empty: starting a fresh run", self.dir)
            else:
                self._restore(state, checkpoints)
            self._state = state
            state.attach_journal(self)
            self.checkpoint()
        except BaseException:
            self._unlock_dir()
            raise

    def restore_read_only(self, state: JournaledState) -> None:
        """Restore ``state`` as ``open`` does (the newest good checkpoint, then the log
        after it), leaving the folder exactly as it is, so that it can be read while its
        server runs (``asyncdiloco export``, tools/export.py): no lock is taken, no temp
        file removed, no torn tail cut (a record being appended reads as one: reading
        stops before it), no checkpoint written and no journal attached.

        A running server may prune the checkpoint or a log segment being read (after it
        wrote two newer checkpoints); that read fails and the caller tries again.

        Raises:
            CheckpointError: the folder holds no checkpoint, or its checkpoints or log are
            unusable (the message says which file and why). OSError: a file went away.
        """
        checkpoints = checkpoint_lsns(self.dir)
        if not checkpoints:
            raise CheckpointError(
                f"{self.dir} holds no checkpoint (ckpt-*.json): give the --checkpoint-dir of a server, which "
                f"writes its first checkpoint as it starts"
            )
        self._restore(state, checkpoints, repair=False)

    def _lock_dir(self) -> None:
        f = open(self.dir / "LOCK", "a+")
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            raise CheckpointError(
                f"checkpoint dir {self.dir} is in use by another running server; stop it first, or give "
                f"this server its own --checkpoint-dir"
            ) from None
        f.truncate(0)
        f.write(f"{os.getpid()}\n")
        f.flush()
        self._lock_file = f

    def _unlock_dir(self) -> None:
        if self._lock_file is not None:
            fcntl.flock(self._lock_file.fileno(), fcntl.LOCK_UN)
            self._lock_file.close()
            self._lock_file = None

    def _segments(self) -> list[tuple[int, pathlib.Path]]:
        out = []
        for p in self.dir.glob("wal-*.log"):
            try:
                out.append((int(p.stem.split("-", 1)[1]), p))
            except ValueError:
                continue
        return sorted(out)

    def _restore(self, state: JournaledState, checkpoints: list[int], repair: bool = True) -> None:
        meta, tensors = self._newest_good_checkpoint(checkpoints)
        state.load_state_dict(meta, tensors)
        self.lsn = meta["lsn"]
        self._good_lsns.add(self.lsn)
        replayed = self._replay_log(state, repair)
        log.info(
            "restored version %d from checkpoint ckpt-%020d and %d log records (LSN %d)",
            state.version,
            meta["lsn"],
            replayed,
            self.lsn,
        )

    def _newest_good_checkpoint(self, checkpoints: list[int]) -> tuple[dict, dict[str, torch.Tensor]]:
        """The newest checkpoint that loads, falling back to older ones only when told to."""
        failures = []
        for i, lsn in enumerate(checkpoints):
            try:
                return load_checkpoint(self.dir, lsn, self.server_config)
            except CheckpointError as exc:
                failures.append(str(exc))
                older = checkpoints[i + 1] if i + 1 < len(checkpoints) else None
                if not self.config.fallback_to_previous or older is None:
                    hint = (
                        f"start with --fallback-to-previous to resume from the previous checkpoint "
                        f"(ckpt-{older:020d}) and replay the log from there"
                        if older is not None
                        else "no older checkpoint is left; restore the folder from a backup or start a fresh run "
                        "in an empty folder"
                    )
                    raise CheckpointError(f"{'; '.join(failures)}; {hint}") from None
                log.warning("%s; falling back to the previous checkpoint ckpt-%020d", exc, older)
        raise CheckpointError("no checkpoint to restore")  # unreachable: called with at least one

    def _replay_log(self, state: JournaledState, repair: bool = True) -> int:
        """Redo the log records after ``self.lsn``, in order; returns how many.
        ``repair``: cut a torn tail off the last segment (else only stop reading there)."""
        replayed = 0
        segments = self._segments()
        for j, (_first, path) in enumerate(segments):
            for rec in read_segment(path, is_last=j == len(segments) - 1, repair=repair):
                if rec.lsn <= self.lsn:
                    continue
                if rec.lsn != self.lsn + 1:
                    raise CheckpointError(
                        f"write-ahead log {path} jumps from LSN {self.lsn} to {rec.lsn}: a log segment is missing; "
                        f"restore the folder from a backup"
                    )
                replay_record(state, rec, self.server_config.wire_codec)
                self.lsn = rec.lsn
                replayed += 1
        return replayed

    # ------------------------------------------------------------ journal
    def _append(self, kind: int, meta: dict, payload: memoryview | bytes = b"") -> None:
        """Append one record and fsync it, all or nothing (segment.py). Called with the
        state's lock held, before the change is applied.

        Raises:
            CheckpointError (UNAVAILABLE): the record could not be written (a full disk):
            the change must not be applied; the log goes on once the disk takes writes.
        """
        if self._broken:
            raise CheckpointError(f"the write-ahead log is closed ({self._broken}); nothing was applied")
        lsn = self.lsn + 1
        head, meta_b = encode_record(kind, lsn, meta, payload)
        segment = self._segment
        assert segment is not None, "the log is open while a journal is attached"
        try:
            with self.observer.timed("log_write"):
                segment.append(head, meta_b, payload)
        except OSError as exc:
            self.observer.failed("log_write")
            full = " (disk full)" if exc.errno == errno.ENOSPC else ""
            log.error(
                "could not write the write-ahead log in %s%s: %s; refusing changes until it can", self.dir, full, exc
            )
            raise CheckpointError(
                f"not logged: could not write the write-ahead log in {self.dir}{full} ({exc}); nothing was "
                f"applied: free disk space on the server; the worker retries the push with the same push_id"
            ) from None
        self.lsn = lsn

    def log_join(self, join: LoggedJoin) -> None:
        """Journal a Join before it is answered (state lock held): its manifest when it
        becomes the server's (the first Join), whether the worker gave its name (a Join of
        a known name resumes its id) and when, on the wall clock."""
        meta: dict = {"worker_id": join.worker_id, "name": join.name, "initialize": join.initialize}
        if join.manifest is not None:
            meta["manifest"] = manifest_to_json(join.manifest)
        meta["named"] = join.named
        if join.region:
            meta["region"] = True
        meta["seen_unix_s"] = join.seen_unix_s
        self._append(JOIN, meta)

    def log_push(self, header: pb.PushHeader, payload: torch.Tensor, applied: AppliedAs, *, seen_unix_s: float) -> None:
        """Journal a push before it is applied and acknowledged (state lock held), with
        everything its outer step depends on: τ, s(τ) and the live worker count (and
        ``seen_unix_s``, when it arrived on the wall clock: the worker's last contact)."""
        meta = push_meta(header, applied, self.server_config.wire_codec)
        meta["seen_unix_s"] = seen_unix_s
        self._append(PUSH, meta, payload.numpy().data)
        self._pushes_since_checkpoint += 1

    def maybe_checkpoint(self) -> None:
        """Checkpoint when ``checkpoint_every`` pushes were logged since the last one
        (called after an apply, without the state lock; one checkpoint at a time)."""
        if self._pushes_since_checkpoint < self.config.checkpoint_every:
            return
        if not self._ckpt_lock.acquire(blocking=False):
            return
        try:
            self._checkpoint_locked()
        except Exception as exc:  # noqa: BLE001 - whatever fails (OSError, torch's RuntimeError), the push stays applied
            self._pushes_since_checkpoint = 0  # the next try after checkpoint_every more pushes
            self.observer.failed("checkpoint")
            log.error(
                "checkpoint failed (%s: %s); the write-ahead log keeps every push, retrying after the next %d",
                type(exc).__name__,
                exc,
                self.config.checkpoint_every,
            )
        finally:
            self._ckpt_lock.release()

    # ---------------------------------------------------------- checkpoint
    def checkpoint(self) -> None:
        """Write a checkpoint of the state now (blocks until any running one ends)."""
        with self._ckpt_lock:
            self._checkpoint_locked()

    def _rotate(self) -> int:
        """Start a new log segment after the newest record (state lock held). Returns the
        LSN covered. Raises OSError when the new segment cannot be created: the open one
        stays the one appended to."""
        path = self.dir / f"wal-{self.lsn + 1:020d}.log"
        segment = LogSegment(open(path, "ab", buffering=0), path, self.config.fsync)  # noqa: SIM115 - kept open
        try:
            fsync_dir(self.dir)
        except OSError:
            segment.close()
            raise
        if self._segment is not None:
            self._segment.close()
        self._segment = segment
        self._pushes_since_checkpoint = 0
        return self.lsn

    def _checkpoint_locked(self) -> None:
        started = time.monotonic()
        assert self._state is not None, "open() first"
        meta, tensors, lsn = self._state.state_dict(while_locked=self._rotate)
        name = f"ckpt-{lsn:020d}"
        if lsn in self._good_lsns:  # nothing was logged since that (intact) checkpoint
            return
        try:
            write_checkpoint(self.dir, lsn, meta, tensors, self.server_config)
        except BaseException:
            remove_partial_checkpoint(self.dir, lsn)
            raise
        self._good_lsns.add(lsn)
        prune(self.dir, self._segments())
        took_s = time.monotonic() - started
        self.observer.observe("checkpoint", took_s)
        log.info("checkpoint %s at version %d written in %.3f s", name, meta["version"], took_s)

    # ------------------------------------------------------------ shutdown
    def close(self, *, final_checkpoint: bool = True) -> None:
        """Checkpoint (unless told not to), close the log and release the folder."""
        try:
            if final_checkpoint and self._state is not None and not self._broken:
                self.checkpoint()
        finally:
            if self._state is not None:
                self._state.detach_journal(then=self._close_log)  # no append interleaves with closing it
            self._unlock_dir()

    def abandon(self) -> None:
        """Undo ``open`` for a server that never served (its start failed later): close
        without a final checkpoint and, if the folder was empty when opened, remove the
        checkpoint and log this start wrote, so the next start is a fresh run again (with
        whatever settings it is given) instead of a restore of settings never used."""
        fresh = self._opened_fresh
        self.close(final_checkpoint=False)
        if fresh:
            for path in [*self.dir.glob("ckpt-*"), *self.dir.glob("wal-*.log")]:
                path.unlink(missing_ok=True)

    def _close_log(self) -> None:
        self._broken = "the server is stopping"
        if self._segment is not None:
            self._segment.close()
            self._segment = None


def read_only_config(folder: pathlib.Path) -> ServerConfig:
    """A server configuration that restores ``folder`` read-only (``restore_read_only``):
    the newest checkpoint's outer optimizer and wire codec (replaying its log needs
    them), every other setting the default (none affects θ).

    Raises:
        CheckpointError: ``folder`` is not a folder, holds no checkpoint, or the newest
        sidecar cannot be read.
    """
    if not folder.is_dir():
        raise CheckpointError(
            f"checkpoint dir {folder} does not exist or is not a folder: give the --checkpoint-dir a server ran with"
        )
    lsns = checkpoint_lsns(folder)
    if not lsns:
        raise CheckpointError(
            f"{folder} holds no checkpoint (ckpt-*.json): give the --checkpoint-dir of a server, which writes "
            f"its first checkpoint as it starts"
        )
    side = folder / f"ckpt-{lsns[0]:020d}.json"
    try:
        meta = json.loads(side.read_bytes())
        wire = meta["wire"]
        return ServerConfig(
            outer=OuterConfig(**meta["outer"]),
            wire_codec=wire["wire_codec"],
            codec_block_size=wire["codec_block_size"] or DEFAULT_BLOCK_SIZE,
            durability=DurabilityConfig(checkpoint_dir=str(folder), fallback_to_previous=True),
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {side} cannot be read ({exc!r}); restore the folder from a backup") from None
