"""Outer optimizers and staleness weights, on flat fp32 vectors.

The server keeps the global parameters θ and the outer momentum m as flat fp32
vectors (one element per model parameter element, manifest order) and applies each
pseudo-gradient Δ = θ_base − θ_local as it arrives, scaled by its staleness weight s(τ):

- ``nesterov`` (DiLoCo, Douillard et al. 2023, arXiv 2311.08105, Alg. 1 with Nesterov
  outer SGD; same update as ``torch.optim.SGD(nesterov=True)``):
  m ← μ·m + s(τ)·Δ;  θ ← θ − η·(s(τ)·Δ + μ·m)
- ``sgd`` (heavy-ball): m ← μ·m + s(τ)·Δ;  θ ← θ − η·m.
  With η = 1, μ = 0 and one worker the global model becomes the worker's parameters
  (LocalSGD averaging).

Staleness weights (τ = versions applied since the worker's base version):
``constant`` 1; ``inverse`` 1/(1+τ) (Zhang et al. 2016, arXiv 1511.05950);
``polynomial`` (1+τ)^−a and ``hinge`` 1 if τ ≤ b else 1/(a(τ−b)+1)
(FedAsync, Xie et al. 2019, arXiv 1903.03934, Sec. 5.2).

All updates are in place and allocate nothing per step; the kernel is torch's fused SGD.
"""

from __future__ import annotations

import torch
from torch.optim.sgd import sgd as _torch_sgd

from asyncdiloco.config import OuterConfig


def staleness_weight(config: OuterConfig, staleness: int) -> float:
    """s(τ) for a pseudo-gradient ``staleness`` versions old.

    Args:
        config: supplies the weighting (``staleness``) and its ``staleness_a``/``_b``.
        staleness: τ ≥ 0, in versions.
    Returns:
        The weight in (0, 1].
    Raises:
        ValueError: τ < 0.
    """
    if staleness < 0:
        raise ValueError(f"staleness is {staleness}; it must be >= 0 versions (a base version from the future?)")
    kind, a, b = config.staleness, config.staleness_a, config.staleness_b
    if kind == "constant":
        return 1.0
    if kind == "inverse":
        return 1.0 / (1.0 + staleness)
    if kind == "polynomial":
        return float((1.0 + staleness) ** (-a))
    if kind == "hinge":
        return 1.0 if staleness <= b else 1.0 / (a * (staleness - b) + 1.0)
    raise ValueError(f"unknown staleness weighting {kind!r}")  # unreachable: OuterConfig validates


def describe(config: OuterConfig) -> tuple[str, str]:
    """Human-readable (outer optimizer, staleness weighting) for status and reports."""
    opt = f"{config.optimizer}(lr={config.lr:g}, momentum={config.momentum:g})"
    stal = {
        "constant": "constant",
        "inverse": "inverse 1/(1+tau)",
        "polynomial": f"polynomial (1+tau)^-{config.staleness_a:g}",
        "hinge": f"hinge(a={config.staleness_a:g}, b={config.staleness_b})",
    }[config.staleness]
    return opt, f"{stal}, max_staleness={config.max_staleness}"


class OuterOptimizer:
    """Applies pseudo-gradients to flat fp32 global parameters in place.

    Args:
        params: θ, 1-D float32 tensor (N,), updated in place.
        config: optimizer kind, η (``lr``) and μ (``momentum``).
    Attributes:
        momentum_buffer: m, float32 (N,), zero at start (allocated only when μ > 0).
    """

    def __init__(self, params: torch.Tensor, config: OuterConfig) -> None:
        if params.dtype != torch.float32 or params.dim() != 1:
            raise ValueError(f"global parameters must be a 1-D float32 vector; got {params.dtype} {tuple(params.shape)}")
        self.params = params
        self.config = config
        self.momentum_buffer = torch.zeros_like(params) if config.momentum > 0 else None

    @torch.no_grad()
    def step(self, delta: torch.Tensor, weight: float = 1.0) -> None:
        """θ ← update(θ, s·Δ) as in the module docstring, in one fused pass.

        The update is ``torch.optim.SGD``'s fused kernel (``torch.optim.sgd.sgd`` with
        ``fused=True``) run on the flat θ, Δ and m, so it reads and writes each
        vector once.

        Args:
            delta: Δ = θ_base − θ_local, float32 (N,) on θ's device. It is the caller's
                scratch: when ``weight`` ≠ 1 it is scaled in place (Δ ← s·Δ).
            weight: s(τ), the staleness weight.
        Raises:
            ValueError: ``delta`` has another shape or dtype (nothing is changed).
        """
        if delta.shape != self.params.shape or delta.dtype != torch.float32:
            raise ValueError(
                f"pseudo-gradient has dtype {delta.dtype} shape {tuple(delta.shape)}; "
                f"expected float32 {tuple(self.params.shape)}"
            )
        if weight != 1.0:
            delta.mul_(weight)  # s·Δ enters both the momentum and the direct term
        _torch_sgd(
            [self.params],
            [delta],
            [self.momentum_buffer],
            fused=self.params.device.type in ("cpu", "cuda"),
            weight_decay=0.0,
            momentum=self.config.momentum,
            lr=self.config.lr,
            dampening=0.0,
            nesterov=self.config.optimizer == "nesterov" and self.config.momentum > 0,
            maximize=False,
        )
