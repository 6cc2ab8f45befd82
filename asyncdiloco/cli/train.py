"""What ``asyncdiloco worker`` runs: the default job's plain PyTorch training loop wrapped
by an ``AsyncDiLoCoWorker`` (or a ``SyncDiLoCoWorker`` in sync mode)."""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
from torch.nn.parallel import DistributedDataParallel

from asyncdiloco.cli.train_log import TrainLog, TrainLogConfig
from asyncdiloco.errors import ConfigError
from asyncdiloco.job.config import JobConfig
from asyncdiloco.job.dataset import BatchStream, CharCorpus
from asyncdiloco.job.models import lm_loss
from asyncdiloco.job.slowdown import SlowdownChanges, check_slowdown_changes, slowdown_at
from asyncdiloco.worker.async_worker import AsyncDiLoCoWorker
from asyncdiloco.worker.config import SyncWorkerConfig, WorkerConfig
from asyncdiloco.worker.group import noted, portable
from asyncdiloco.worker.stats import SyncWorkerStats, WorkerStats
from asyncdiloco.worker.sync_worker import SyncDiLoCoWorker

log = logging.getLogger(__name__)

_W = TypeVar("_W")


def run_worker(
    *,
    worker_config: WorkerConfig,
    job: JobConfig,
    worker_index: int = 0,
    slowdown: float = 1.0,
    slowdown_changes: SlowdownChanges = (),
    step_s: float = 0.0,
    max_steps: int | None = None,
    max_seconds: float | None = None,
    on_step: Callable[[int, float], None] | None = None,
    on_start: Callable[[], None] | None = None,
    on_join: Callable[[], None] | None = None,
    on_end: Callable[[], None] | None = None,
    stop: threading.Event | None = None,
    wait_to_join: Callable[[], bool] | None = None,
    train_log: TrainLogConfig | None = None,
    sync: SyncWorkerConfig | None = None,
    device: str = "cpu",
) -> WorkerStats | SyncWorkerStats:
    """Train the default job as one DiLoCo worker until a bound is hit: asynchronous,
    or synchronous (``SyncDiLoCoWorker``) when ``sync`` is given.

    Args:
        worker_config, job: the client's settings; the model, data and inner optimizer.
        worker_index: selects this worker's batch order.
        slowdown: F ≥ 1: every inner step takes F times longer (``_Pace``).
        slowdown_changes: ((t_s, F), ...): from t_s seconds of training on, F instead
            (``slowdown_at``).
        step_s: ≥ 0: every inner step lasts at least this many seconds at full speed
            (an emulated larger model; 0: the job's own step time).
        max_steps, max_seconds: stop after this many inner steps / seconds of training
            (None: no bound; one of them is needed).
        on_step: called after every inner step with (step, loss in nats/char).
        on_start: called once training begins (joined, global model pulled);
            ``slowdown_changes`` and ``max_seconds`` count from then.
        on_join, on_end: called right before the join, and once the last inner step
            (and its sync) is done, before the Leave (bench/peer_sync.py's phases).
        stop: once set, training ends after the current inner step; the worker then
            pushes its last steps and leaves (set before training: right after the join).
        wait_to_join: blocks until the worker may join; False: give up without joining.
        train_log: the training log's points (train_log.py; None: ``TrainLogConfig()``).
        sync: run as a sync-mode worker with these settings (None: asynchronous).
        device: where the model, its inner optimizer state and the batches live
            ("cpu", "cuda", "cuda:N"; the worker's θ_base stays on the host).
    Returns:
        The worker's counters.
    Raises:
        ConfigError: slowdown < 1, a bad ``slowdown_changes`` or no bound given.
        ServerUnavailableError / ManifestMismatchError: joining failed.
    """
    _check_bounds(slowdown, step_s, max_steps, max_seconds)
    slowdown_changes = check_slowdown_changes(slowdown_changes)
    rank = group_rank()
    model, inner, inner_lr, batches = _model_and_data(job, device, worker_index, rank)
    worker = _agreed(rank, lambda: _build_worker(model, inner, worker_config, sync, job.tokens_per_step))
    if wait_to_join is not None and not wait_to_join():
        return worker.stats
    tlog = TrainLog(train_log or TrainLogConfig()) if not worker.follower else _FollowerLog()
    # In a group rank 0 alone sleeps: DDP's allreduce makes the others wait for it, and a
    # follower's step time (which includes that wait) would feed back into its own sleep.
    pace = _Pace(slowdown, slowdown_changes, step_s) if not worker.follower else _Pace(1.0, ())
    loop = _Loop(worker, model, inner, inner_lr, batches, pace, tlog, device)
    if worker_config.state_dir is not None and not worker.follower:  # the loop's position is saved with the worker's
        loop.load_state_dict(worker.restored_extra)
        worker.extra_state = loop.state_dict
    if not worker.follower:
        name = worker_config.worker_name
        log.info("joining %s as %s (mode %s, device %s)", worker_config.server, name, worker.mode, device)
    if on_join is not None:
        on_join()
    with _left(tlog, loop), worker:
        if worker.follower:  # rank 0's position arrived with the join; this rank's own stream goes there
            loop.load_state_dict(worker.restored_extra, own_stream=True)
        tlog.joined(worker, name=worker_config.worker_name, server=worker_config.server)
        try:
            if on_start is not None:
                on_start()
            loop.run(max_steps, max_seconds, stop, on_step)
            if on_end is not None:
                on_end()
        except KeyboardInterrupt:  # SIGINT: stop training; close() still pushes and leaves
            if rank is not None:
                raise  # in a group this rank leaves alone (its close is no collective)
            log.info("interrupted after %d inner steps; leaving", loop.step)
        if stop is not None and stop.is_set():
            log.info("stopped after %d inner steps; leaving", loop.step)
    return worker.stats


def _model_and_data(
    job: JobConfig, device: str, worker_index: int, rank: int | None
) -> tuple[torch.nn.Module, torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR, BatchStream]:
    """The job's model on ``device`` (in a torchrun group wrapped in DDP, which averages the
    gradients: the group is one worker), its inner optimizer and lr schedule, and this
    rank's batch stream."""
    corpus = CharCorpus.default()
    gpu = torch.device(device)
    if gpu.type == "cuda" and gpu.index is not None:  # this process's CUDA context, pinned memory, NCCL: that GPU
        torch.cuda.set_device(gpu)
    model: torch.nn.Module = job.build(corpus).to(device)
    inner, inner_lr = job.build_inner(model.parameters())
    if rank is not None:
        model = DistributedDataParallel(model, device_ids=None if gpu.index is None else [gpu.index])
    stream = rank_stream_index(worker_index, rank or 0)
    return model, inner, inner_lr, BatchStream(corpus, job.batch_size, job.context_len, job.seed, stream)


def _build_worker(
    model: torch.nn.Module,
    inner: torch.optim.Optimizer,
    config: WorkerConfig,
    sync: SyncWorkerConfig | None,
    tokens_per_step: int,
) -> AsyncDiLoCoWorker | SyncDiLoCoWorker:
    if sync is not None:
        return SyncDiLoCoWorker(model, inner, config, sync=sync, tokens_per_step=tokens_per_step)
    return AsyncDiLoCoWorker(model, inner, config, tokens_per_step=tokens_per_step)


def _agreed(rank: int | None, build: Callable[[], _W]) -> _W:
    """``build()``, in a torchrun group on every rank at once: if it raised on any rank
    (rank 0's state folder in use by another worker, say), every rank raises the lowest
    rank's error instead of the others failing later in a collective with "Connection
    closed by peer".

    Raises:
        what ``build`` raised on the lowest rank where it raised.
    """
    try:
        built, error = build(), None
    except Exception as exc:  # noqa: BLE001 - shared with the group, then raised
        built, error = None, exc
    if rank is not None:
        import torch.distributed as dist

        errors: list[BaseException | None] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, portable(error) if error is not None else None)
        first = next(((r, e) for r, e in enumerate(errors) if e is not None), None)
        if first is not None and error is None:
            raise noted(first[1], f"raised on rank {first[0]} of the group; rank {rank} raises it too")
    if error is not None:
        raise error
    assert built is not None, "built unless it raised"
    return built


#: Stream index stride between a group's ranks: rank r of worker index i draws stream
#: i + r · stride, distinct from every other worker's and rank's for i < stride.
RANK_STREAM_STRIDE = 1 << 20


def rank_stream_index(worker_index: int, rank: int) -> int:
    """The batch stream of ``rank`` of the worker ``worker_index``: rank 0 draws the
    worker's own stream (as a worker alone does), rank r its own (``RANK_STREAM_STRIDE``).

    Raises:
        ConfigError: ``worker_index`` ≥ the stride in a group (its ranks' streams would
            collide with other workers').
    """
    if rank and worker_index >= RANK_STREAM_STRIDE:
        raise ConfigError(
            f"--worker-index {worker_index} is too large for a torchrun group: give one below {RANK_STREAM_STRIDE}"
        )
    return worker_index + rank * RANK_STREAM_STRIDE


def group_rank() -> int | None:
    """This process's rank when torch.distributed runs a group of more than one (torchrun), else None."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank()
    return None


class _FollowerLog(TrainLog):
    """A follower's training log: none (rank 0 writes the group's)."""

    def __init__(self) -> None:
        super().__init__(TrainLogConfig())

    def joined(self, worker: object, *, name: str, server: str) -> None:
        pass

    def after_step(self, step: int, loss: torch.Tensor) -> None:
        pass

    def left(self, step: int) -> None:
        pass


@contextlib.contextmanager
def _left(tlog: TrainLog, loop: _Loop) -> Iterator[None]:
    """The training log's last line once the worker closed (its final push sent), also
    when training ended with an error."""
    try:
        yield
    finally:
        tlog.left(loop.step)


def _check_bounds(slowdown: float, step_s: float, max_steps: int | None, max_seconds: float | None) -> None:
    if not slowdown >= 1.0:
        raise ConfigError(f"slowdown={slowdown} is invalid: must be >= 1 (1 = full speed, 2 = twice as slow)")
    if max_steps is None and max_seconds is None:
        raise ConfigError("give max_steps or max_seconds, or the worker would train forever")
    if max_steps is not None and max_steps < 1:
        raise ConfigError(f"max_steps={max_steps} is invalid: give 1 or more inner steps")
    if max_seconds is not None and not max_seconds > 0:
        raise ConfigError(f"max_seconds={max_seconds} is invalid: give a positive number of seconds")
    if not (math.isfinite(step_s) and step_s >= 0):
        raise ConfigError(f"step_s={step_s} is invalid: give the seconds a full-speed inner step lasts at least, >= 0")


class _Pace:
    """The emulated slowdown, inside the inner step as a slower machine's compute would
    be: between the backward pass and the optimizer step it sleeps F·max(c, step_s) − c,
    F the factor in force at that time of training (``slowdown_at``) and c the previous
    step's compute at full speed (forward, backward and optimizer step; for the first
    step, its own forward and backward). The step then lasts about F·max(c, step_s), and
    the worker's rate (algo/rates.py), timed over the step, sees it; a sleep after the
    step would count as the loop's own work between steps, which the rate leaves out."""

    def __init__(self, slowdown: float, changes: SlowdownChanges, step_s: float = 0.0) -> None:
        self.slowdown, self.changes, self.factor, self.step_s = slowdown, changes, slowdown, step_s
        self.full_speed_s: float | None = None  # c of the previous step
        self.slept_s = 0.0  # in the current step

    def in_step(self, step: int, train_s: float, so_far_s: float) -> None:
        """Before the optimizer step: ``so_far_s`` seconds of this step's forward and backward."""
        if self.changes:
            factor = slowdown_at(train_s, self.slowdown, self.changes)
            if factor != self.factor:
                log.info("step %d, %.1f s: slowdown %g -> %g", step, train_s, self.factor, factor)
                self.factor = factor
        c = max(self.full_speed_s if self.full_speed_s is not None else so_far_s, 0.0)
        self.slept_s = max(0.0, self.factor * max(c, self.step_s) - c)
        if self.slept_s > 0:
            time.sleep(self.slept_s)

    def after_step(self, compute_s: float) -> None:
        """The step took ``compute_s`` seconds from its forward pass on, the sleep included."""
        self.full_speed_s = max(compute_s - self.slept_s, 0.0)
        self.slept_s = 0.0


class _Loop:
    """The plain PyTorch training loop of the default job; the worker syncs inside
    ``inner.step()`` every H-th step."""

    def __init__(self, worker, model, inner, inner_lr, batches, pace: _Pace, tlog: TrainLog, device: str) -> None:
        self.worker, self.model, self.inner, self.inner_lr = worker, model, inner, inner_lr
        self.batches, self.pace, self.tlog, self.device = batches, pace, tlog, torch.device(device)
        self.step = 0
        self._started = self._t0 = time.monotonic()  # run()'s start, the current step's start
        self._in_step = False  # inside inner.step(), where the worker syncs (and saves)
        #: The data position before the current step drew its batch, until the step is done:
        #: a step cut short before ``inner.step()`` (a rank of the group died in DDP's
        #: allreduce, an interrupt in backward) is saved as not done, its batch as not drawn.
        self._stream_before: dict | None = None

    def state_dict(self) -> dict:
        """The loop's part of the worker's saved state (``WorkerBase.extra_state``): inner
        steps done, the data position, the inner LR schedule. Saved inside ``inner.step()``
        (a sync point), that step counts as done but its LR step is still to come."""
        return {
            "step": self.step + self._in_step,
            "batches": self._stream_before if self._stream_before and not self._in_step else self.batches.state_dict(),
            "inner_lr": self.inner_lr.state_dict(),
            "inner_lr_stepped": not self._in_step,
        }

    def load_state_dict(self, state: dict, *, own_stream: bool = False) -> None:
        """Continue from a ``state_dict`` ({}: a fresh start): the step count, the data
        order exactly where it stopped, the inner LR schedule. With ``own_stream`` (a
        follower given rank 0's state) this rank's own stream is drawn up to rank 0's
        position instead."""
        if not state:
            return
        self.step = int(state["step"])
        if own_stream:
            for _ in range(int(state["batches"]["position"]) - self.batches.position):
                next(self.batches)
        else:
            self.batches.load_state_dict(state["batches"])
        self.inner_lr.load_state_dict(state["inner_lr"])
        if not state["inner_lr_stepped"]:
            self.inner_lr.step()
        log.log(
            logging.DEBUG if own_stream else logging.INFO,  # a follower: rank 0 says it
            "resuming at inner step %d (data position %d)",
            self.step,
            self.batches.position,
        )

    def run(
        self,
        max_steps: int | None,
        max_seconds: float | None,
        stop: threading.Event | None,
        on_step: Callable[[int, float], None] | None,
    ) -> None:
        started = time.monotonic()
        while max_steps is None or self.step < max_steps:  # every rank of a group counts the same steps
            if (max_seconds is not None and time.monotonic() - started >= max_seconds) or (
                stop is not None and stop.is_set()
            ):
                self.worker.request_stop()  # a group's ranks agree on it with the next inner step
            if self.worker.should_stop:
                break
            blocked0 = self.worker.stats.blocked_s
            self._started = started
            loss = self.inner_step()
            # from the forward pass on (data loading is not compute); the sync is not slowed
            compute_s = time.monotonic() - self._t0 - (self.worker.stats.blocked_s - blocked0)
            self.pace.after_step(compute_s)
            self.tlog.after_step(self.step, loss)
            if on_step is not None:
                on_step(self.step, loss.item())

    def inner_step(self) -> torch.Tensor:
        """One inner step; returns its training loss (a detached scalar, nats/char)."""
        self._stream_before = self.batches.state_dict()
        x, y = (t.to(self.device, non_blocking=True) for t in next(self.batches))  # (B, T) int64 each
        self._t0 = time.monotonic()
        loss = lm_loss(self.model(x), y)
        loss.backward()
        now = time.monotonic()
        self.pace.in_step(self.step, now - self._started, now - self._t0)
        self._in_step = True
        try:
            self.inner.step()  # every H-th step also syncs (async: push and pull; sync: a round)
        finally:
            self._in_step = False
        self.inner_lr.step()  # the lr of the next inner step: inner_lr · lr_factor(step + 1)
        self.inner.zero_grad(set_to_none=True)
        self.step += 1
        self._stream_before = None
        return loss.detach()
