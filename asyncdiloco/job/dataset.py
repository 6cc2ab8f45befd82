"""Character-level corpus: the embedded default text (Tiny Shakespeare,
``job/data/tinyshakespeare.txt``, 1,115,394 characters, 65 distinct, from Karpathy's
char-rnn, https://github.com/karpathy/char-rnn) and how it is cut into batches: a
deterministic train/validation split (``CharCorpus``), each worker's reproducible stream
of training batches (``BatchStream``, over the whole split or its own shard for non-IID
data), and fixed validation batches (``eval_batches``, ``split_batches``) so held-out
losses compare across time and processes. Ids are int64 on the CPU.
"""

from __future__ import annotations

import importlib.resources
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from asyncdiloco.errors import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_TEXT_NAME = "tinyshakespeare.txt"
# Multiplier that combines (seed, worker_index) into one generator seed.
_WORKER_SEED_STRIDE = 1_000_003
_MAX_SEED = 2**63 - 1


def load_text(path: str | os.PathLike | None = None) -> str:
    """The whole UTF-8 text of ``path`` (None: the embedded Tiny Shakespeare).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        UnicodeDecodeError: the file is not UTF-8.
    """
    if path is None:
        resource = importlib.resources.files("asyncdiloco.job") / "data" / DEFAULT_TEXT_NAME
        return resource.read_text(encoding="utf-8")
    with open(path, encoding="utf-8") as f:
        return f.read()


@dataclass(frozen=True, kw_only=True, eq=False)
class CharCorpus:
    """A character vocabulary and the train/validation split of one text (build it with
    ``from_text`` or ``default``)."""

    #: The sorted distinct characters of the text; id ``i`` is ``vocab[i]``.
    vocab: str
    #: Training ids, (N_train,) int64: the first ``1 - val_fraction`` of the text.
    train: torch.Tensor
    #: Held-out validation ids, (N_val,) int64: the rest of the text.
    val: torch.Tensor
    _stoi: dict[str, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.vocab) == 0:
            raise ConfigError("CharCorpus: vocab is empty; build the corpus from a non-empty text.")
        if len(set(self.vocab)) != len(self.vocab) or list(self.vocab) != sorted(self.vocab):
            raise ConfigError(
                f"CharCorpus: vocab {self.vocab!r} must be sorted distinct characters; "
                "build it with CharCorpus.from_text."
            )
        for name in ("train", "val"):
            ids = getattr(self, name)
            if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype != torch.long:
                got = (
                    f"{ids.dtype} of shape {tuple(ids.shape)}" if isinstance(ids, torch.Tensor) else type(ids).__name__
                )
                raise ConfigError(
                    f"CharCorpus: {name} must be a 1-D int64 tensor, got {got}; "
                    "build the corpus with CharCorpus.from_text."
                )
            if ids.numel() == 0:
                raise ConfigError(f"CharCorpus: the {name} split is empty; use a longer text.")
        object.__setattr__(self, "_stoi", {ch: i for i, ch in enumerate(self.vocab)})

    @classmethod
    def from_text(cls, text: str, val_fraction: float = 0.1) -> CharCorpus:
        """The vocabulary of ``text`` and its split: the last ``val_fraction`` of the
        characters, in (0, 0.5], held out for validation.

        Raises:
            ConfigError: ``val_fraction`` is outside (0, 0.5], or ``text`` is too short to
                leave a character in each split.
        """
        if not 0.0 < val_fraction <= 0.5:
            raise ConfigError(
                f"val_fraction={val_fraction!r} is outside (0, 0.5]; "
                "pass e.g. 0.1 to hold out the last 10% of the text."
            )
        n_train = int(len(text) * (1.0 - val_fraction))
        if n_train < 1 or n_train >= len(text):
            raise ConfigError(
                f"text of {len(text)} characters is too short to split with "
                f"val_fraction={val_fraction}; use a text of at least a few hundred characters."
            )
        vocab = "".join(sorted(set(text)))
        stoi = {ch: i for i, ch in enumerate(vocab)}
        ids = torch.tensor([stoi[ch] for ch in text], dtype=torch.long)  # (N,)
        logger.debug(
            "corpus: %d chars, vocab %d, %d train / %d val", len(text), len(vocab), n_train, len(text) - n_train
        )
        return cls(vocab=vocab, train=ids[:n_train].clone(), val=ids[n_train:].clone())

    @classmethod
    def default(cls, val_fraction: float = 0.1) -> CharCorpus:
        """The embedded Tiny Shakespeare corpus (65 characters in the vocabulary)."""
        return cls.from_text(load_text(), val_fraction=val_fraction)

    @property
    def vocab_size(self) -> int:
        """Number of distinct characters, V."""
        return len(self.vocab)

    def encode(self, text: str) -> torch.Tensor:
        """The ids of ``text``, shape (len(text),), int64.

        Raises:
            ConfigError: ``text`` holds a character outside the vocabulary.
        """
        try:
            return torch.tensor([self._stoi[ch] for ch in text], dtype=torch.long)
        except KeyError as e:
            raise ConfigError(
                f"character {e.args[0]!r} is not in the corpus vocabulary of {self.vocab_size} "
                "characters; encode only text drawn from the same corpus."
            ) from None

    def decode(self, ids: torch.Tensor) -> str:
        """The characters of ``ids`` (any shape, read in row-major order, integer dtype).

        Raises:
            ConfigError: an id is outside [0, vocab_size).
        """
        flat = ids.reshape(-1).tolist()
        bad = [i for i in flat if not 0 <= i < self.vocab_size]
        if bad:
            raise ConfigError(f"id {bad[0]} is outside [0, {self.vocab_size}); decode only ids made by this corpus.")
        return "".join(self.vocab[i] for i in flat)


def sample_batch(
    data: torch.Tensor, batch_size: int, context_len: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw ``batch_size`` random windows of ``context_len`` ids and their next ids.

    Args:
        data: A split of ids, shape (N,), int64.
        batch_size: B, windows per batch, >= 1.
        context_len: T, ids per window, >= 1; needs N > T.
        generator: CPU generator the window starts are drawn from (advanced).

    Returns:
        x: Inputs, shape (B, T), int64: ``data[s : s + T]`` for each start s.
        y: Targets, shape (B, T), int64: ``data[s + 1 : s + T + 1]``, x shifted by one.

    Raises:
        ConfigError: ``data`` is not 1-D int64, ``batch_size`` or ``context_len``
            is below 1, or the split is not longer than one context window.
    """
    if data.dim() != 1 or data.dtype != torch.long:
        raise ConfigError(f"data must be a 1-D int64 tensor, got {data.dtype} of shape {tuple(data.shape)}.")
    if batch_size < 1:
        raise ConfigError(f"batch_size={batch_size} must be >= 1.")
    if context_len < 1:
        raise ConfigError(f"context_len={context_len} must be >= 1.")
    n = data.numel()
    if n <= context_len:
        raise ConfigError(
            f"split of {n} ids is not longer than context_len={context_len}; "
            "use a shorter context_len, a longer text or a larger val_fraction."
        )
    starts = torch.randint(0, n - context_len, (batch_size,), generator=generator)  # (B,)
    offsets = torch.arange(context_len)  # (T,)
    idx = starts[:, None] + offsets[None, :]  # (B, T)
    return data[idx], data[idx + 1]  # (B, T), (B, T)


def _check_non_negative(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_SEED:
        raise ConfigError(f"{name}={value!r} must be an int in [0, 2**63 - 1].")


class BatchStream(Iterator[tuple[torch.Tensor, torch.Tensor]]):
    """One worker's infinite, reproducible stream of training batches.

    The window order is drawn from a generator seeded with
    ``(seed * 1_000_003 + worker_index) mod 2**63``: the same arguments give the
    same stream in any process, and different worker indices give different streams.

    Args:
        corpus: The corpus; batches come from ``corpus.train``.
        batch_size: B, windows per batch, >= 1.
        context_len: T, ids per window, >= 1 and < len(corpus.train).
        seed: Run seed, >= 0.
        worker_index: This worker's index, >= 0.
        shard, num_shards: draw every window from shard ``shard`` of ``num_shards``
            contiguous, equal slices of the training split (non-IID data: each worker
            sees its own part of the text; windows never cross a slice's end). The
            default (0 of 1) is the whole split.

    Raises:
        ConfigError: an argument is out of range (see ``sample_batch``), or the shard is
            not in [0, num_shards).

    Yields:
        (x, y), each of shape (B, T), int64, y = x shifted by one.
    """

    def __init__(
        self,
        corpus: CharCorpus,
        batch_size: int,
        context_len: int,
        seed: int,
        worker_index: int,
        *,
        shard: int = 0,
        num_shards: int = 1,
    ) -> None:
        _check_non_negative("seed", seed)
        _check_non_negative("worker_index", worker_index)
        if not (num_shards >= 1 and 0 <= shard < num_shards):
            raise ConfigError(f"shard={shard} of num_shards={num_shards} is invalid: give 0 <= shard < num_shards")
        n = corpus.train.numel()
        self.data = corpus.train[shard * n // num_shards : (shard + 1) * n // num_shards]  # (N_shard,) view
        if batch_size < 1 or context_len < 1 or self.data.numel() <= context_len:
            sample_batch(self.data, batch_size, context_len, torch.Generator())  # raises the clear error
        self.shard, self.num_shards = shard, num_shards
        self.corpus = corpus
        self.batch_size = batch_size
        self.context_len = context_len
        self.seed = seed
        self.worker_index = worker_index
        self.num_batches_drawn = 0
        self._generator = torch.Generator()
        self._generator.manual_seed((seed * _WORKER_SEED_STRIDE + worker_index) % (_MAX_SEED + 1))

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.num_batches_drawn += 1
        return sample_batch(self.data, self.batch_size, self.context_len, self._generator)

    @property
    def position(self) -> int:
        """Batches drawn so far: the next one is batch ``position`` (0-based) of the stream."""
        return self.num_batches_drawn

    def state_dict(self) -> dict:
        """Where the stream is, to continue it exactly (``load_state_dict``): its
        ``position``, the generator's state (uint8 tensor) and the arguments that choose
        the stream (``seed``, ``worker_index``, ``batch_size``, ``context_len``)."""
        return {
            "position": self.num_batches_drawn,
            "generator": self._generator.get_state(),
            "seed": self.seed,
            "worker_index": self.worker_index,
            "batch_size": self.batch_size,
            "context_len": self.context_len,
            "shard": self.shard,
            "num_shards": self.num_shards,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue a stream saved by ``state_dict``: the next batch is the one that
        would have followed there.

        Raises:
            ConfigError: the state is of another stream (seed, worker index, batch size
                or context length differ).
        """
        for name in ("seed", "worker_index", "batch_size", "context_len", "shard", "num_shards"):
            saved = state[name]
            if saved != getattr(self, name):
                raise ConfigError(
                    f"the saved data position is of a stream with {name}={saved}, this one has "
                    f"{getattr(self, name)}; start with the same --{name.replace('_', '-')} (or another --state-dir)"
                )
        self._generator.set_state(state["generator"])
        self.num_batches_drawn = int(state["position"])

    def __repr__(self) -> str:
        return (
            f"BatchStream(batch_size={self.batch_size}, context_len={self.context_len}, "
            f"seed={self.seed}, worker_index={self.worker_index}, drawn={self.num_batches_drawn})"
        )


def eval_batches(
    corpus: CharCorpus, batch_size: int, context_len: int, num_batches: int, seed: int = 1234
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``num_batches`` fixed held-out batches (x, y) of ``corpus.val``, each (B, T) int64,
    their windows drawn with ``seed``: bit-identical in every call and process (same torch
    version), so losses measured at different times compare.

    Raises:
        ConfigError: an argument is out of range (see ``sample_batch``).
    """
    if num_batches < 1:
        raise ConfigError(f"num_batches={num_batches} must be >= 1.")
    _check_non_negative("seed", seed)
    generator = torch.Generator()
    generator.manual_seed(seed)
    return [sample_batch(corpus.val, batch_size, context_len, generator) for _ in range(num_batches)]


def split_batches(corpus: CharCorpus, batch_size: int, context_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The whole validation split as batches: every non-overlapping window of
    ``context_len`` characters, in order, ``batch_size`` windows a batch.

    No window is drawn at random, so the loss depends on the model only: on Tiny
    Shakespeare's 111,540-character split this is 111,104 characters at B = 16, T = 32,
    where ``eval_batches``'s 4,096 characters put a 0.4-0.5 % seed-to-seed spread on the
    final loss of the benchmark suite's runs (docs/algorithms.md, "The held-out set").

    Args:
        corpus: The corpus; windows come from ``corpus.val``.
        batch_size: B, windows per batch, >= 1.
        context_len: T, ids per window, >= 1.

    Returns:
        Pairs (x, y), each of shape (B, T), int64, y = x shifted by one; the last,
        partial batch is dropped, so every batch has the same shape and ``evaluate``'s
        mean is the per-character mean.

    Raises:
        ConfigError: the split holds fewer than ``batch_size`` windows, or an argument is < 1.
    """
    if batch_size < 1 or context_len < 1:
        raise ConfigError(f"batch_size={batch_size} and context_len={context_len} must both be >= 1.")
    windows = (corpus.val.numel() - 1) // context_len
    batches = windows // batch_size
    if batches < 1:
        raise ConfigError(
            f"the validation split ({corpus.val.numel()} ids) holds {windows} windows of context_len={context_len}, "
            f"fewer than batch_size={batch_size}; use a smaller batch or a longer text."
        )
    n = batches * batch_size * context_len
    x = corpus.val[:n].view(batches, batch_size, context_len)  # (batches, B, T)
    y = corpus.val[1 : n + 1].view(batches, batch_size, context_len)  # (batches, B, T)
    return [(x[i], y[i]) for i in range(batches)]
