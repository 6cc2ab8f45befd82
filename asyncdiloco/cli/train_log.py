"""The CLI worker's training log, at the same points in three places: the process log
(INFO, every ``every`` inner steps), JSON lines (``--train-log``: one object per log point
and per event, units in the keys) and TensorBoard (``--tensorboard-dir``); the keys are in
docs/operations.md "Training logs".
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable
from typing import IO, Any

import torch

from asyncdiloco.errors import ConfigError

log = logging.getLogger(__name__)

#: What to install for ``--tensorboard-dir``.
TENSORBOARD_FIX = "pip install 'asyncdiloco[tensorboard]'"


def check_tensorboard() -> None:
    """Raise ConfigError unless ``torch.utils.tensorboard`` imports (it needs the
    ``tensorboard`` package, the ``tensorboard`` extra)."""
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            f"--tensorboard-dir needs the tensorboard package ({exc}); install it with {TENSORBOARD_FIX}, "
            f"or drop --tensorboard-dir"
        ) from None


def check_writable_folder(flag: str, path: str) -> None:
    """The folder ``path`` is written in exists and is writable (checked before training)."""
    folder = os.path.dirname(os.path.abspath(path)) if not path.endswith("/") else path.rstrip("/")
    if not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
        raise ConfigError(
            f"{flag} {path!r} is invalid: its folder {folder} does not exist or is not writable; "
            f"give a path in a writable folder (checked now, not after training)"
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainLogConfig:
    """Where and how often the worker logs its training (train_log.py)."""

    #: Inner steps between two log points (process log, JSON lines, TensorBoard).
    every: int = 20
    #: JSON-lines file, appended to (None: none).
    jsonl_path: str | None = None
    #: TensorBoard log folder, created if missing (None: none).
    tensorboard_dir: str | None = None

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ConfigError(f"--log-every {self.every} is invalid: give 1 or more inner steps")
        if self.jsonl_path is not None:
            check_writable_folder("--train-log", self.jsonl_path)
        if self.tensorboard_dir is not None:
            check_tensorboard()
            folder = os.path.abspath(self.tensorboard_dir)
            check_writable_folder("--tensorboard-dir", folder if not os.path.isdir(folder) else folder + "/")


def _counters(worker: Any) -> dict[str, Any]:
    """The worker's totals for a line: pushes (or rounds), bytes, blocked seconds."""
    st = worker.stats
    if worker.mode == "sync":
        rounds = {"rounds_committed": st.rounds_committed, "rounds_failed": st.rounds_failed}
        staleness = 0 if st.rounds_committed else None  # a committed round is never stale
    else:
        rounds = {"pushes_applied": st.pushes_applied, "pushes_refused": st.pushes_refused}
        staleness = st.staleness[-1] if st.staleness else None
    return {
        "local_steps": worker.local_steps,
        "staleness_versions": staleness,
        **rounds,
        "bytes_pushed": st.bytes_pushed,
        "bytes_pulled": st.bytes_pulled,
        "blocked_s": round(st.blocked_s, 4),
    }


def _synced(worker: Any) -> bool:
    st = worker.stats
    if worker.mode == "sync":
        return st.rounds_committed + st.rounds_failed > 0
    return st.pushes_applied + st.pushes_refused > 0


class TrainLog:
    """The training log of one worker: call ``joined`` once the worker joined,
    ``after_step`` after every inner step, ``left`` once it closed (also on errors).

    Args:
        config: where and how often.
        clock: seconds, monotonic (tests inject one).
    """

    def __init__(self, config: TrainLogConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config, self.clock = config, clock
        self._file: IO[str] | None = None
        self._writer: Any = None  # torch.utils.tensorboard.SummaryWriter
        self._worker: Any = None
        self._joined_at = self._last_t = 0.0
        self._last_tokens = 0
        self._loss_sum: torch.Tensor | None = None  # Σ loss since the last line, on the loss's device
        self._loss_steps = 0
        self._first_sync_seen = False

    def joined(self, worker: Any, *, name: str, server: str) -> None:
        """The worker joined (it holds the global model): log it, open the outputs."""
        self._worker = worker
        self._joined_at = self._last_t = self.clock()
        self._last_tokens = worker.stats.tokens
        if self.config.jsonl_path is not None:
            self._file = open(self.config.jsonl_path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - until left()
        if self.config.tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(self.config.tensorboard_dir)
        log.info(
            "joined %s as worker %d (%s): H_w %d, mode %s; a line every %d inner steps",
            server,
            worker.worker_id,
            name,
            worker.local_steps,
            worker.mode,
            self.config.every,
        )
        self._write(
            {
                "event": "join",
                "worker_id": worker.worker_id,
                "name": name,
                "server": server,
                "mode": worker.mode,
                "local_steps": worker.local_steps,
            }
        )

    def after_step(self, step: int, loss: torch.Tensor) -> None:
        """Inner step ``step`` (1-based, the steps so far) trained with ``loss`` (a
        scalar tensor, nats/char; detached here, read on the host only at a log point)."""
        loss = loss.detach()
        self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
        self._loss_steps += 1
        if not self._first_sync_seen and _synced(self._worker):
            self._first_sync_seen = True
            log.info("first sync after %d inner steps (%.1f s after the join)", step, self.clock() - self._joined_at)
            self._write({"event": "first_sync", "step": step, **_counters(self._worker)})
        if step % self.config.every == 0:
            self._log_point(step)

    def _log_point(self, step: int) -> None:
        now, tokens = self.clock(), self._worker.stats.tokens
        assert self._loss_sum is not None
        loss = float(self._loss_sum) / self._loss_steps
        tokens_per_s = (tokens - self._last_tokens) / (now - self._last_t) if now > self._last_t else 0.0
        self._loss_sum, self._loss_steps, self._last_t, self._last_tokens = None, 0, now, tokens
        counters = _counters(self._worker)
        line = {"step": step, "loss_nats": round(loss, 5), "tokens_per_s": round(tokens_per_s, 1), **counters}
        log.info("step %d: train loss %.3f nats/char, %.0f tokens/s, %s", step, loss, tokens_per_s, _progress(counters))
        if self._writer is not None:
            for key, value in line.items():
                if key != "step" and value is not None:
                    self._writer.add_scalar(_TENSORBOARD_TAGS.get(key, f"sync/{key}"), value, step)
            self._writer.flush()
        self._write(line)

    def left(self, step: int) -> None:
        """The worker closed (its last push sent, Leave called): the last line, then close."""
        if self._worker is None:
            return  # never joined
        log.info("left after %d inner steps (%.1f s after the join)", step, self.clock() - self._joined_at)
        self._write({"event": "leave", "step": step, **_counters(self._worker)})
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _write(self, obj: dict[str, Any]) -> None:
        if self._file is None:
            return
        obj.update(elapsed_s=round(self.clock() - self._joined_at, 3), time_unix_s=round(time.time(), 3))
        self._file.write(json.dumps(obj) + "\n")  # line-buffered: flushed per line


#: The TensorBoard tag of each line key (by unit: train/, comm/, sync/).
_TENSORBOARD_TAGS = {
    "loss_nats": "train/loss_nats",
    "tokens_per_s": "train/tokens_per_s",
    "bytes_pushed": "comm/bytes_pushed",
    "bytes_pulled": "comm/bytes_pulled",
    "blocked_s": "comm/blocked_s",
}


def _progress(c: dict[str, Any]) -> str:
    tau = "-" if c["staleness_versions"] is None else c["staleness_versions"]
    if "rounds_committed" in c:
        return f"H {c['local_steps']}, {c['rounds_committed']} rounds committed, {c['rounds_failed']} aborted"
    return f"H_w {c['local_steps']}, {c['pushes_applied']} pushes applied, staleness {tau} (last push, versions)"
