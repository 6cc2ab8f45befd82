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


def run_worker(
    *,
    worker_config: WorkerConfig,
    job: JobConfig,
    worker_index: int = 0,
    slowdown: float = 1.0,
    max_steps: int | None = None,
    max_seconds: float | None = None,
    on_step: Callable[[int, float], None] | None = None,
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
        max_steps: stop after this many inner steps (None: no bound).
        max_seconds: stop after this many seconds of training (None: no bound).
        on_step: called after every inner step with (step, loss in nats/char).
        log_every: log the training loss every this many inner steps (INFO).
        sync: run as a sync-mode worker with these settings (the server must run
            ``--mode sync``); None: asynchronous.
    Returns:
        The worker's counters.
    Raises:
        ConfigError: slowdown < 1 or no bound given.
        ServerUnavailableError / ManifestMismatchError: joining failed.
    """
    if not slowdown >= 1.0:
        raise ConfigError(f"slowdown={slowdown} is invalid: must be >= 1 (1 = full speed, 2 = twice as slow)")
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
    with worker:
        started = time.monotonic()
        step = 0
        try:
            while (max_steps is None or step < max_steps) and (
                max_seconds is None or time.monotonic() - started < max_seconds
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
                if slowdown > 1.0:
                    compute_s = time.monotonic() - t0 - (worker.stats.blocked_s - blocked0)  # the sync is not slowed
                    time.sleep((slowdown - 1.0) * max(compute_s, 0.0))
                if on_step is not None:
                    on_step(step, float(loss))
        except KeyboardInterrupt:  # SIGINT / SIGTERM: stop training; close() still pushes and leaves
            log.info("interrupted after %d inner steps; leaving", step)
    return worker.stats
