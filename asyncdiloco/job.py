"""The embedded default job: a char-level transformer on Tiny Shakespeare.

``run_worker`` is what ``asyncdiloco worker`` runs: a plain PyTorch training loop
(AdamW inner optimizer, as in DiLoCo, its lr scheduled by the worker's inner step with
torch's ``LambdaLR``) wrapped by ``AsyncDiLoCoWorker``. Every worker
builds the model from the same seed, so whichever worker initializes the server starts
it from the same parameters; each worker draws its own batch order (by worker index).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable

import torch

from asyncdiloco.config import SyncWorkerConfig, WorkerConfig
from asyncdiloco.dataset import BatchStream, CharCorpus, eval_batches
from asyncdiloco.errors import ConfigError
from asyncdiloco.lr_schedule import LRSchedule, lr_factor
from asyncdiloco.models import CharTransformer, CharTransformerConfig, build_model, lm_loss
from asyncdiloco.sync_worker import SyncDiLoCoWorker, SyncWorkerStats
from asyncdiloco.worker import AsyncDiLoCoWorker, WorkerStats

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobConfig:
    """Model, data and inner optimizer of the default job (identical on every worker)."""

    #: Sequences per inner step.
    batch_size: int = 32
    #: Characters per sequence (the model's context).
    context_len: int = 64
    n_layer: int = 2
    n_embd: int = 128
    n_head: int = 4
    #: AdamW learning rate of the inner optimizer.
    inner_lr: float = 3e-3
    #: AdamW weight decay.
    weight_decay: float = 0.01
    #: The inner lr's schedule, keyed by the worker's inner step k (0 = its first):
    #: lr_k = inner_lr · lr_factor(k) (lr_schedule.py). "constant" or "cosine".
    inner_lr_schedule: str = "constant"
    #: Inner steps of linear warmup (0 = none).
    inner_warmup_steps: int = 0
    #: cosine: the inner step from which the lr stays at its floor (must exceed the warmup).
    inner_total_steps: int = 0
    #: cosine: the floor as a fraction of inner_lr, in [0, 1].
    inner_min_ratio: float = 0.1
    #: Seed of the model initialization and of the data order.
    seed: int = 0
    #: Held-out evaluation: number of fixed validation batches of ``batch_size``.
    eval_batches: int = 8

    def __post_init__(self) -> None:
        for name in ("batch_size", "context_len", "n_layer", "n_embd", "n_head", "eval_batches"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} is invalid: must be >= 1")
        if not self.inner_lr > 0:
            raise ConfigError(f"inner_lr={self.inner_lr} is invalid: must be > 0 (3e-3 is a good start)")
        try:
            self.inner_schedule()
        except ConfigError as exc:
            raise ConfigError(
                f"inner {exc} [kind: inner_lr_schedule, --inner-lr-schedule; warmup: inner_warmup_steps, "
                f"--inner-warmup-steps; total: inner_total_steps, --inner-total-steps; "
                f"min_ratio: inner_min_ratio, --inner-min-lr-ratio]"
            ) from None

    def inner_schedule(self) -> LRSchedule:
        """The inner lr's schedule as an ``LRSchedule`` (its counter is the inner step)."""
        return LRSchedule(kind=self.inner_lr_schedule, warmup=self.inner_warmup_steps, total=self.inner_total_steps,
                          min_ratio=self.inner_min_ratio)  # fmt: skip

    def build_inner(self, params: Iterable) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
        """The inner optimizer (AdamW, as in DiLoCo) and its lr scheduler.

        Call ``scheduler.step()`` after every ``inner.step()``: inner step k (0-based)
        then runs at inner_lr · lr_factor(k), warmup and cosine decay as in DiLoCo's
        inner optimizer (lr_schedule.py). The default schedule keeps inner_lr exactly.

        Args:
            params: the model's parameters (an iterable of tensors or parameter groups).
        Returns:
            (inner optimizer, ``torch.optim.lr_scheduler.LambdaLR`` over it).
        """
        inner = torch.optim.AdamW(params, lr=self.inner_lr, weight_decay=self.weight_decay)
        return inner, torch.optim.lr_scheduler.LambdaLR(inner, functools.partial(lr_factor, self.inner_schedule()))

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.context_len

    def model_config(self, vocab_size: int) -> CharTransformerConfig:
        return CharTransformerConfig(
            vocab_size=vocab_size,
            context_len=self.context_len,
            n_layer=self.n_layer,
            n_embd=self.n_embd,
            n_head=self.n_head,
        )

    def build(self, corpus: CharCorpus) -> CharTransformer:
        """The job's model, initialized from ``seed`` (bit-identical on every worker)."""
        return build_model(self.model_config(corpus.vocab_size), seed=self.seed)

    def eval_set(self, corpus: CharCorpus) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return eval_batches(corpus, self.batch_size, self.context_len, self.eval_batches)


#: A worker's speed schedule: ((t_s, factor), ...), strictly increasing t_s (seconds since
#: the worker began training), each factor >= 1 (the ``slowdown`` from t_s on).
SlowdownChanges = tuple[tuple[float, float], ...]


def parse_slowdown_changes(text: str) -> SlowdownChanges:
    """Parse ``"T1:F1,T2:F2"`` (``asyncdiloco worker --slowdown-changes``) into
    ``((T1, F1), (T2, F2))`` and check it (``check_slowdown_changes``); "" is no change.

    Raises:
        ConfigError: an item is not ``T:F``, or the schedule breaks a limit.
    """
    changes = []
    for item in (i.strip() for i in text.split(",") if i.strip()):
        t, sep, f = item.partition(":")
        try:
            if not sep:
                raise ValueError
            changes.append((float(t), float(f)))
        except ValueError:
            raise ConfigError(
                f"--slowdown-changes item {item!r} is invalid: write SECONDS:FACTOR pairs separated by commas, "
                f"e.g. 30:4,90:1 (from 30 s of training on 4x slower, from 90 s on full speed)"
            ) from None
    return check_slowdown_changes(tuple(changes))


def check_slowdown_changes(changes: SlowdownChanges) -> SlowdownChanges:
    """``changes`` as a tuple of (float, float) pairs, if every time is finite and >= 0,
    the times strictly increase and every factor is finite and >= 1.

    Raises:
        ConfigError: naming the pair and the limit it broke.
    """
    out, last = [], -math.inf
    for t_s, factor in changes:
        t_s, factor = float(t_s), float(factor)
        if not (math.isfinite(t_s) and t_s >= 0):
            raise ConfigError(f"slowdown change at t={t_s} s is invalid: give seconds since training began, >= 0")
        if not t_s > last:
            raise ConfigError(
                f"slowdown change at t={t_s} s is invalid: times must strictly increase (previous change at "
                f"{last} s); list the changes in time order, one per time"
            )
        if not (math.isfinite(factor) and factor >= 1.0):
            raise ConfigError(
                f"slowdown change to factor={factor} at t={t_s} s is invalid: must be >= 1 (1 = full speed, 2 = twice as slow)"
            )
        out.append((t_s, factor))
        last = t_s
    return tuple(out)


def slowdown_at(t_s: float, slowdown: float, changes: SlowdownChanges) -> float:
    """The slowdown factor in force ``t_s`` seconds after the worker began training:
    ``slowdown`` until the first change, then the factor of the last change at or
    before ``t_s``. ``changes`` as ``check_slowdown_changes`` returns it."""
    factor = slowdown
    for when_s, f in changes:
        if when_s > t_s:
            break
        factor = f
    return factor


def run_worker(
    *,
    worker_config: WorkerConfig,
    job: JobConfig,
    worker_index: int = 0,
    slowdown: float = 1.0,
    slowdown_changes: SlowdownChanges = (),
    max_steps: int | None = None,
    max_seconds: float | None = None,
    on_step: Callable[[int, float], None] | None = None,
    on_start: Callable[[], None] | None = None,
    stop: threading.Event | None = None,
    wait_to_join: Callable[[], bool] | None = None,
    log_every: int = 100,
    sync: SyncWorkerConfig | None = None,
) -> WorkerStats | SyncWorkerStats:
    """Train the default job as one DiLoCo worker until a bound is hit: asynchronous,
    or synchronous (``SyncDiLoCoWorker``) when ``sync`` is given.

    Args:
        worker_config: server address and client settings.
        job: model, data and inner optimizer settings.
        worker_index: selects this worker's batch order.
        slowdown: F ≥ 1; after each inner step the worker sleeps (F − 1) × the step's
            compute time, so it runs F times slower (emulates a weaker machine).
        slowdown_changes: ((t_s, F), ...): from t_s seconds after the worker began
            training (joined and holds the global model) it runs F times slower instead;
            times strictly increasing, each F ≥ 1 (``slowdown_at``).
        max_steps: stop after this many inner steps (None: no bound).
        max_seconds: stop after this many seconds of training (None: no bound).
        on_step: called after every inner step with (step, loss in nats/char).
        on_start: called once training begins (joined, global model pulled): the
            moment ``slowdown_changes`` and ``max_seconds`` count from.
        stop: once set, training ends after the current inner step (never in the middle
            of a sync); the worker then pushes its last steps and leaves. Set before
            training began, it ends right after the join (still with a Leave).
        wait_to_join: called once the model and data are ready, before the join; it
            blocks until the worker may join and returns False to give up (nothing is
            trained and the server never hears of this worker).
        log_every: log the training loss every this many inner steps (INFO).
        sync: run as a sync-mode worker with these settings (the server must run
            ``--mode sync``); None: asynchronous.
    Returns:
        The worker's counters.
    Raises:
        ConfigError: slowdown < 1, a bad ``slowdown_changes`` or no bound given.
        ServerUnavailableError / ManifestMismatchError: joining failed.
    """
    if not slowdown >= 1.0:
        raise ConfigError(f"slowdown={slowdown} is invalid: must be >= 1 (1 = full speed, 2 = twice as slow)")
    slowdown_changes = check_slowdown_changes(slowdown_changes)
    if max_steps is None and max_seconds is None:
        raise ConfigError("give max_steps or max_seconds, or the worker would train forever")
    if max_steps is not None and max_steps < 1:
        raise ConfigError(f"max_steps={max_steps} is invalid: give 1 or more inner steps")
    if max_seconds is not None and not max_seconds > 0:
        raise ConfigError(f"max_seconds={max_seconds} is invalid: give a positive number of seconds")
    corpus = CharCorpus.default()
    model = job.build(corpus)
    inner, inner_lr = job.build_inner(model.parameters())
    batches = BatchStream(corpus, job.batch_size, job.context_len, job.seed, worker_index)
    if sync is not None:
        worker = SyncDiLoCoWorker(model, inner, worker_config, sync=sync, tokens_per_step=job.tokens_per_step)
    else:
        worker = AsyncDiLoCoWorker(model, inner, worker_config, tokens_per_step=job.tokens_per_step)
    if wait_to_join is not None and not wait_to_join():
        return worker.stats
    with worker:
        started = time.monotonic()
        step = 0
        factor = slowdown
        try:
            if on_start is not None:
                on_start()
            while (
                (max_steps is None or step < max_steps)
                and (max_seconds is None or time.monotonic() - started < max_seconds)
                and not (stop is not None and stop.is_set())
            ):
                t0, blocked0 = time.monotonic(), worker.stats.blocked_s
                x, y = next(batches)  # (B, T) int64 each
                loss = lm_loss(model(x), y)
                loss.backward()
                inner.step()  # every H-th step also syncs (async: push and pull; sync: a round)
                inner_lr.step()  # the lr of the next inner step: inner_lr · lr_factor(step + 1)
                inner.zero_grad(set_to_none=True)
                step += 1
                if step % log_every == 0:
                    st = worker.stats
                    done = (
                        f"{st.rounds_committed} rounds committed, {st.rounds_failed} failed" if sync is not None
                        else f"{st.pushes_applied} pushes applied (mean staleness {st.mean_staleness:.1f})"
                    )  # fmt: skip
                    log.info("step %d: train loss %.3f nats/char, %s", step, float(loss), done)
                if slowdown_changes:
                    now_factor = slowdown_at(time.monotonic() - started, slowdown, slowdown_changes)
                    if now_factor != factor:
                        log.info("step %d, %.1f s: slowdown %g -> %g", step, time.monotonic() - started, factor, now_factor)
                        factor = now_factor
                if factor > 1.0:
                    compute_s = time.monotonic() - t0 - (worker.stats.blocked_s - blocked0)  # the sync is not slowed
                    time.sleep((factor - 1.0) * max(compute_s, 0.0))
                if on_step is not None:
                    on_step(step, float(loss))
        except KeyboardInterrupt:  # SIGINT: stop training; close() still pushes and leaves
            log.info("interrupted after %d inner steps; leaving", step)
        if stop is not None and stop.is_set():
            log.info("stopped after %d inner steps; leaving", step)
    return worker.stats
