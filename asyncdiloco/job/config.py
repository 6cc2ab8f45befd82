"""The embedded default job: a char-level transformer on Tiny Shakespeare, its data and its
inner optimizer (AdamW, as in DiLoCo, its lr scheduled by the worker's inner step with
torch's ``LambdaLR``). Every worker builds the model from the same seed, so whichever
worker initializes the server starts it from the same parameters; each worker draws its
own batch order (by worker index).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Iterable

import torch

from asyncdiloco.algo.lr_schedule import LRSchedule, lr_factor
from asyncdiloco.errors import ConfigError
from asyncdiloco.job.dataset import CharCorpus, eval_batches, split_batches
from asyncdiloco.job.models import CharTransformer, CharTransformerConfig, build_model

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
        return LRSchedule(
            kind=self.inner_lr_schedule,
            warmup=self.inner_warmup_steps,
            total=self.inner_total_steps,
            min_ratio=self.inner_min_ratio,
        )

    def build_inner(self, params: Iterable) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
        """The inner optimizer over ``params`` (AdamW, as in DiLoCo) and its ``LambdaLR``
        scheduler: with ``scheduler.step()`` after every ``inner.step()``, inner step k
        (0-based) runs at inner_lr · lr_factor(k) (lr_schedule.py; the default: inner_lr)."""
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
        """The held-out batches evaluated during training: ``eval_batches`` fixed random
        validation batches of (batch_size, context_len), the same in every process."""
        return eval_batches(corpus, self.batch_size, self.context_len, self.eval_batches)

    def split_set(self, corpus: CharCorpus) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The whole validation split in (batch_size, context_len) batches of
        non-overlapping windows (``dataset.split_batches``): the final model's held-out
        set in the benchmark suite, large enough that its own noise is well below the
        gaps between methods."""
        return split_batches(corpus, self.batch_size, self.context_len)
