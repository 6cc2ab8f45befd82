"""A worker's own state on disk (``WorkerConfig.state_dir``), so that a restarted worker
continues where it stopped: ``state.pt``, ``state.json``, the lock, a corrupt state set
aside (docs/worker.md, "The state folder"; docs/operations.md, "Restarting a worker").
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import pathlib
import secrets
import socket
import time
from typing import Any, TextIO

from asyncdiloco._atomic import fsync_dir, write_atomically
from asyncdiloco.errors import ConfigError
from asyncdiloco.wire.tensors import Manifest
from asyncdiloco.worker import state_file
from asyncdiloco.worker.state_file import CorruptStateError, NewerFormatError, nonfinite_part

log = logging.getLogger(__name__)

#: ``state.pt``'s ``format``: what this version writes and reads (state_file.py).
STATE_FORMAT = state_file.FORMAT
STATE_FILE, SUMMARY_FILE, LOCK_FILE = "state.pt", "state.json", "LOCK"


def default_worker_name() -> str:
    """A name no other process uses: ``<host>-<pid>-<4 hex digits>``. Saved into a new
    state folder, it is the worker's name for every restart with that folder."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}"


def manifest_entries(manifest: Manifest) -> list[list]:
    """``[[name, shape, dtype], ...]`` of a model, e.g. ``[["fc.weight", [4, 2], "torch.float32"]]``."""
    return [[t.name, list(t.shape), str(t.dtype)] for t in manifest.tensors]


class WorkerStateDir:
    """The state folder of one worker process (docs/worker.md, "The state folder"): locked while
    the worker uses it, its newest state loaded at open.

    Args:
        path: the folder; created if missing.
    Raises:
        ConfigError: the folder cannot be created or written, another process uses it,
            or its state file cannot be opened or is of a newer format (each message names
            the folder and the fix). A state file whose bytes are damaged or that holds
            non-finite values is set aside instead (docs/worker.md).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = pathlib.Path(path)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(
                f"state_dir {str(self.path)!r} cannot be created ({exc.strerror}); give a folder this process "
                f"may write to"
            ) from None
        self._lock: TextIO | None = self._take_lock()
        #: Whether this process saved into the folder yet (a first save that fails is a ConfigError).
        self._saved = False
        #: The name of a state set aside as unusable (``_set_aside``), or ``state.json``'s
        #: when ``state.pt`` is missing (None: neither).
        self.recovered_name: str | None = None
        #: The newest saved state (None: the folder holds none yet, or only an unusable one).
        try:
            self.state: dict[str, Any] | None = self._read()
        except ConfigError:
            self.close()  # the folder is not this worker's to use: release it
            raise

    def _unwritable(self, exc: OSError) -> ConfigError:
        return ConfigError(
            f"state_dir {str(self.path)!r} cannot be written ({exc.strerror or exc}); give a folder this process "
            f"may write to, or make this one writable by its user (ls -ld {self.path})"
        )

    def _take_lock(self) -> TextIO:
        try:
            f = open(self.path / LOCK_FILE, "a+")
        except OSError as exc:
            raise self._unwritable(exc) from None
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            raise ConfigError(
                f"state_dir {str(self.path)!r} is in use by another running worker; stop it first, or give "
                f"this worker its own --state-dir (two workers must not share a state, nor a name)"
            ) from None
        f.truncate(0)
        f.write(f"{os.getpid()}\n")
        f.flush()
        return f

    def _read(self) -> dict[str, Any] | None:
        file = self.path / STATE_FILE
        if not file.exists():  # a state set aside by a run that died before its next save keeps its name
            self.recovered_name = _name_from_summary(self.path)
            return None
        name: str | None = None
        try:
            state: dict[str, Any] | None = _read_state(file, self.path)
            problem = nonfinite_part(state or {})
            if problem is not None:
                problem = f"holds non-finite values in {problem}; the worker that saved it had diverged"
        except CorruptStateError as exc:
            state, problem, name = None, exc.reason, exc.name
        if problem is None:
            return state
        self._set_aside(file, problem, _name_from_summary(self.path) or (state or {}).get("worker_name") or name)
        return None

    def _set_aside(self, file: pathlib.Path, problem: str, name: str | None) -> None:
        """Rename an unusable ``state.pt`` to ``state.pt.corrupt-<UTC time>`` and say so."""
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        kept = file.with_name(f"{file.name}.corrupt-{stamp}")
        n = 1
        while kept.exists():
            n += 1
            kept = file.with_name(f"{file.name}.corrupt-{stamp}-{n}")
        try:
            os.rename(file, kept)
            fsync_dir(self.path)
        except OSError as exc:
            raise self._unwritable(exc) from None
        self.recovered_name = name
        who = f"worker {name!r}" if name else "the worker (its name is lost: a new one unless --worker-name is given)"
        log.warning(
            "state_dir %r: %s %s; kept it as %s and not loaded: %s rejoins from the global model with a fresh "
            "inner optimizer state (its data position and unsent progress are lost)",
            str(self.path),
            STATE_FILE,
            problem,
            kept,
            who,
        )

    @property
    def saved_name(self) -> str | None:
        """The worker name of the saved state, or of one set aside as unusable, or
        ``state.json``'s when ``state.pt`` is missing (None: none known)."""
        return self.recovered_name if self.state is None else str(self.state["worker_name"])

    def save_worker_state(self, state: dict[str, Any], saves: int) -> bool:
        """``save`` a worker's ``state_dict()`` with its summary; True when saved. A failed
        write after the first is logged and training goes on (ConfigError for the first)."""
        summary = {k: v for k, v in state.items() if isinstance(v, (int, float, str))}
        summary.update(saves=saves, pid=os.getpid(), extra=state["extra"])
        try:
            self.save(state, summary)
        except OSError as exc:
            log.warning("worker %s: state not saved in %s (%s); training on", state["worker_name"], self.path, exc)
            return False
        return True

    def save(self, state: dict[str, Any], summary: dict[str, Any]) -> None:
        """Write ``state`` (tensors on the CPU) atomically as ``state.pt``, then ``summary``
        (plain JSON values) as ``state.json``.

        Raises:
            ConfigError: this process's first save failed: the folder is not usable.
            OSError: a later save failed (the previous one is intact).
        """
        try:
            write_atomically(self.path / STATE_FILE, lambda f: state_file.write_state(f, state))
        except OSError as exc:
            if not self._saved:
                raise self._unwritable(exc) from None
            raise
        self._saved = True
        self.state = state
        text = json.dumps({**summary, "saved_unix_s": time.time()}, indent=1, default=lambda _: None)
        write_atomically(self.path / SUMMARY_FILE, lambda f: f.write(text.encode()))

    def close(self) -> None:
        """Release the folder (the process that exits releases it too)."""
        if self._lock is not None:
            fcntl.flock(self._lock.fileno(), fcntl.LOCK_UN)
            self._lock.close()
            self._lock = None


def resolve_worker_name(given: str, saved: str | None, folder: str | os.PathLike[str]) -> str:
    """The worker's name: ``given`` if set (it must equal ``saved``, the one saved in
    ``folder``), else ``saved``, else a new unique one (``default_worker_name``).

    Raises:
        ConfigError: ``given`` differs from the name saved in the folder.
    """
    if given and saved is not None and given != saved:
        raise ConfigError(
            f"worker name {given!r} differs from the name {saved!r} saved in state_dir {str(folder)!r}; "
            f"give --worker-name {saved} (or none), or another --state-dir for a different worker"
        )
    return given or saved or default_worker_name()


def saved_worker_name(folder: str | os.PathLike[str]) -> str | None:
    """The name saved in a state folder, read without its lock (None: none saved); for an
    unusable or missing ``state.pt``, ``state.json``'s (or the file's readable part).

    Raises:
        ConfigError: the state file cannot be opened, or is of a newer format.
    """
    file = pathlib.Path(folder) / STATE_FILE
    if not file.is_file():
        return _name_from_summary(folder)
    try:
        return str(_read_state(file, folder)["worker_name"])
    except CorruptStateError as exc:
        return _name_from_summary(folder) or exc.name


def _read_state(file: pathlib.Path, folder: str | os.PathLike[str]) -> dict[str, Any]:
    """``state_file.read_state`` with its environment's errors as ConfigErrors.

    Raises:
        ConfigError: the file cannot be opened, or is intact and of a format this version does not read.
        CorruptStateError: its bytes are not what was saved.
    """
    try:
        state = state_file.read_state(file)
    except OSError as exc:
        raise ConfigError(
            f"state_dir {str(folder)!r}: {STATE_FILE} cannot be read ({exc.strerror or exc}); make it readable "
            f"by this process's user (ls -l {file})"
        ) from None
    except NewerFormatError as exc:
        raise ConfigError(
            f"state_dir {str(folder)!r}: {STATE_FILE} {exc}: run the version that wrote it, or delete {file} "
            f"to start this worker afresh"
        ) from None
    if state.get("format") != STATE_FORMAT:
        raise ConfigError(
            f"state_dir {str(folder)!r}: {STATE_FILE} has format {state.get('format')!r}; this worker reads "
            f"format {STATE_FORMAT}: delete {file} to start this worker afresh"
        )
    if not isinstance(state.get("worker_name"), str):
        raise CorruptStateError("holds no worker name")
    return state


def _name_from_summary(folder: str | os.PathLike[str]) -> str | None:
    """``state.json``'s worker name (None: no such file, or none readable in it)."""
    try:
        name = json.loads((pathlib.Path(folder) / SUMMARY_FILE).read_text()).get("worker_name")
    except (OSError, ValueError, AttributeError):
        return None
    return name if isinstance(name, str) and name else None


def check_manifest(state: dict[str, Any], manifest: Manifest, what: str) -> None:
    """Raise ConfigError naming the first parameter where ``state``'s model differs from
    ``manifest``; ``what`` names the state in the message."""
    saved, mine = state.get("manifest", []), manifest_entries(manifest)
    if saved == mine:
        return
    diff = next(
        (f"parameter #{i}: {a} saved, {b} in this model" for i, (a, b) in enumerate(zip(saved, mine)) if a != b),
        f"{len(saved)} parameters saved, {len(mine)} in this model",
    )
    raise ConfigError(
        f"{what} belongs to a model of another layout ({diff}); start the worker with the model it was saved "
        f"with, or give another (or an empty) --state-dir for this one"
    )


def check_state(state: dict[str, Any], manifest: Manifest, mode: str, worker_name: str) -> str:
    """The saved worker name, once a worker's ``state_dict()`` is found to be of this
    model, mode and (when set) ``worker_name``; else ConfigError naming the fix."""
    what = f"the state of worker {state.get('worker_name')!r}"
    check_manifest(state, manifest, what)
    if state.get("mode") != mode:
        raise ConfigError(
            f"{what} was saved by a {state.get('mode')}-mode worker; this one runs mode {mode!r}: "
            f"run it with --mode {state.get('mode')}, or give another --state-dir"
        )
    name = str(state["worker_name"])
    if worker_name and worker_name != name:
        raise ConfigError(
            f"{what} was saved under another name than worker_name={worker_name!r}; give worker_name={name!r} (or none)"
        )
    return name


def open_for_worker(
    folder: str | os.PathLike[str] | None, worker_name: str, manifest: Manifest
) -> tuple[WorkerStateDir | None, str]:
    """A worker's state folder, locked while it runs (None: no ``folder``), and the name the
    worker joins under: ``worker_name``, else the one saved there, else (with a folder) a
    new unique one saved there.

    Raises:
        ConfigError: the folder is in use, or holds the state of another model.
    """
    if not folder:
        return None, worker_name
    state_dir = WorkerStateDir(folder)
    try:
        if state_dir.state is not None:
            check_manifest(state_dir.state, manifest, f"the state in state_dir {str(state_dir.path)!r}")
        return state_dir, resolve_worker_name(worker_name, state_dir.saved_name, state_dir.path)
    except ConfigError:
        state_dir.close()
        raise
