"""A small character-level GPT: the model each DiLoCo worker (replica) trains.

One readable file in the manner of nanoGPT (https://github.com/karpathy/nanoGPT):
token and learned position embeddings, ``n_layer`` pre-LayerNorm transformer
blocks (causal multi-head self-attention, Vaswani et al. 2017,
https://arxiv.org/abs/1706.03762; a 4x GELU MLP), a final LayerNorm and a
linear LM head. The head is *not* tied to the token embedding, so
``state_dict()`` keys and ``named_parameters()`` names are the same, one to one,
which keeps pseudo-gradient bookkeeping simple.

Shapes: B batch, T time (<= context_len), C = n_embd, V = vocab_size,
nh = n_head, hs = C / nh. Everything is float32.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from asyncdiloco.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class CharTransformerConfig:
    """Shape of a ``CharTransformer``.

    The defaults with ``vocab_size=65`` (Tiny Shakespeare) give 421,632 parameters.
    """

    vocab_size: int
    """V, distinct characters; ``CharCorpus.vocab_size``."""
    context_len: int = 64
    """Longest input, in characters (T <= context_len)."""
    n_layer: int = 2
    """Transformer blocks."""
    n_embd: int = 128
    """C, width of the residual stream."""
    n_head: int = 4
    """Attention heads; must divide n_embd."""
    dropout: float = 0.0
    """Dropout probability in [0, 1), applied in training mode only."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_len", "n_layer", "n_embd", "n_head"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"CharTransformerConfig.{name}={value!r} must be a positive int.")
        if self.n_embd % self.n_head != 0:
            raise ConfigError(
                f"CharTransformerConfig.n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                f"choose n_head among the divisors of {self.n_embd} (e.g. 4) or change n_embd."
            )
        if (
            isinstance(self.dropout, bool)
            or not isinstance(self.dropout, (int, float))
            or not 0.0 <= self.dropout < 1.0
        ):
            raise ConfigError(f"CharTransformerConfig.dropout={self.dropout!r} is outside [0, 1); use e.g. 0.0 or 0.1.")


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t sees only positions <= t."""

    def __init__(self, config: CharTransformerConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # q, k, v for all heads
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))  # (B, T, C)


class MLP(nn.Module):
    """Position-wise feed-forward network, C -> 4C -> C with GELU."""

    def __init__(self, config: CharTransformerConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.c_fc(x))  # (B, T, 4C)
        return self.dropout(self.c_proj(x))  # (B, T, C)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: CharTransformerConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        x = x + self.mlp(self.ln_2(x))  # (B, T, C)
        return x


class CharTransformer(nn.Module):
    """Character-level GPT of shape ``config``, initialised from the global torch RNG
    (``build_model(config, seed)``: reproducibly)."""

    def __init__(self, config: CharTransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.context_len, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2 init: N(0, 0.02) weights, zero biases; residual projections scaled
        # by 1/sqrt(2 * n_layer) (Radford et al. 2019), as in nanoGPT.
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * self.config.n_layer))

    def num_parameters(self) -> int:
        """Number of scalar parameters (each shared tensor counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Next-character logits (B, T, V) float32 of ids ``idx`` (B, T) int64 in [0, V), T <=
        context_len; ``logits[b, t]`` predicts ``idx[b, t + 1]``.

        Raises:
            ConfigError: ``idx`` is not 2-D int64, or T > context_len.
        """
        if idx.dim() != 2 or idx.dtype != torch.long:
            raise ConfigError(f"idx must be a (B, T) int64 tensor, got {idx.dtype} of shape {tuple(idx.shape)}.")
        B, T = idx.shape
        if T > self.config.context_len:
            raise ConfigError(
                f"input length T={T} exceeds context_len={self.config.context_len}; "
                f"crop the input to its last {self.config.context_len} characters "
                "or build a model with a larger context_len."
            )
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        x = self.ln_f(x)  # (B, T, C)
        return self.lm_head(x)  # (B, T, V)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-character cross-entropy of ``logits`` (B, T, V) against ``targets`` (B, T)
    int64: a scalar in nats per character (ln V for a uniform prediction).

    Raises:
        ConfigError: the shapes do not match.
    """
    if logits.dim() != 3 or targets.shape != logits.shape[:2]:
        raise ConfigError(
            f"logits of shape {tuple(logits.shape)} and targets of shape {tuple(targets.shape)} "
            "must be (B, T, V) and (B, T)."
        )
    V = logits.size(-1)
    return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))  # (B*T, V) vs (B*T,)


def build_model(config: CharTransformerConfig, seed: int) -> CharTransformer:
    """A ``CharTransformer`` (float32, CPU, training mode) whose initial parameters depend
    only on ``seed``: bit-identical in any process; the global torch RNG is left untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = CharTransformer(config)
    logger.debug("built CharTransformer with %d parameters (seed %d)", model.num_parameters(), seed)
    return model


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean held-out loss of ``model`` ((B, T) int64 ids → (B, T, V) logits, run in eval
    mode) over ``batches`` of (x, y), each (B, T) int64: nats per character.

    Raises:
        ConfigError: ``batches`` is empty.
    """
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        losses = [lm_loss(model(x.to(device)), y.to(device)).item() for x, y in batches]
    finally:
        model.train(was_training)
    if not losses:
        raise ConfigError("evaluate() got no batches; pass e.g. dataset.eval_batches(corpus, 32, 64, 8).")
    return sum(losses) / len(losses)
