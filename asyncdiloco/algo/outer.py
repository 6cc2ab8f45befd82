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

- ``delayed_nesterov`` (Liu et al. 2024, arXiv 2401.09135, Alg. 3; buffer N, c ∈ [0, 1/N]):
  on arrival t of g_t = s(τ)·Δ: b ← b + g_t; if (t+1) mod N = 0:
  m ← μ·m + b/N;  θ ← θ − η·[(1 − cN + c)·μ·m + g_t/N];  b ← 0;
  otherwise θ ← θ − η·[c·μ·m + g_t/N]. With c = 0, N arrivals equal one synchronous
  Nesterov step on their mean.

Staleness weights (τ = versions applied since the worker's base version):
``constant`` 1; ``inverse`` 1/(1+τ) (Zhang et al. 2016, arXiv 1511.05950);
``polynomial`` (1+τ)^−a and ``hinge`` 1 if τ ≤ b else 1/(a(τ−b)+1)
(FedAsync, Xie et al. 2019, arXiv 1903.03934, Sec. 5.2).

η may follow a schedule keyed by the version v an update is applied at (the number of
updates applied before it, so the first update is v = 0): every η above is then
η_v = η · lr_factor(v) (``OuterConfig.lr_schedule``; warmup and cosine decay as in
lr_schedule.py). The caller passes v; the async server, its log replay, the sync-mode
server and every sync member pass the same v for the same update.

All updates are in place and allocate nothing per step; the kernel is torch's fused SGD.
"""

from __future__ import annotations

import collections
import logging
import math
import statistics

import torch
from torch.optim.sgd import sgd as _torch_sgd

from asyncdiloco.algo.config import OuterConfig
from asyncdiloco.algo.lr_schedule import LRSchedule, lr_factor

log = logging.getLogger(__name__)


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
    """Human-readable (outer optimizer, staleness weighting) for status and reports; the
    lr schedule is named when there is one."""
    opt = f"{config.optimizer}(lr={config.lr:g}, momentum={config.momentum:g}"
    opt += f", N={config.dn_buffer or 'workers'}, c={config.dn_c:g})" if config.optimizer == "delayed_nesterov" else ")"
    schedule = config.schedule()
    if schedule != LRSchedule():  # the default (constant, no warmup) keeps the old text
        opt += f", lr schedule {schedule.describe()} by version"
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
        config: optimizer kind, η (``lr``), its schedule (``lr_schedule``, ...) and μ
            (``momentum``).
    Attributes:
        momentum_buffer: m, float32 (N,), zero at start (allocated only when μ > 0).
    """

    def __init__(self, params: torch.Tensor, config: OuterConfig) -> None:
        if params.dtype != torch.float32 or params.dim() != 1:
            raise ValueError(
                f"global parameters must be a 1-D float32 vector; got {params.dtype} {tuple(params.shape)}"
            )
        self.params = params
        self.config = config
        self.schedule = config.schedule()
        self.momentum_buffer = torch.zeros_like(params) if config.momentum > 0 else None

    def lr_at(self, version: int) -> float:
        """η_v = η · lr_factor(v): the outer learning rate of the update applied at
        version ``version`` (updates applied before it); exactly η without a schedule."""
        return self.config.lr * lr_factor(self.schedule, version)

    def _check(self, delta: torch.Tensor) -> None:
        if delta.shape != self.params.shape or delta.dtype != torch.float32:
            raise ValueError(
                f"pseudo-gradient has dtype {delta.dtype} shape {tuple(delta.shape)}; "
                f"expected float32 {tuple(self.params.shape)}"
            )

    @torch.no_grad()
    def step(self, delta: torch.Tensor, weight: float = 1.0, *, version: int, num_workers: int = 1) -> None:
        """θ ← update(θ, s·Δ) with η_v as in the module docstring, in one fused pass.

        The update is ``torch.optim.SGD``'s fused kernel (``torch.optim.sgd.sgd`` with
        ``fused=True``) run on the flat θ, Δ and m, so it reads and writes each
        vector once.

        Args:
            delta: Δ = θ_base − θ_local, float32 (N,) on θ's device. It is the caller's
                scratch: when ``weight`` ≠ 1 it is scaled in place (Δ ← s·Δ).
            weight: s(τ), the staleness weight.
            version: v, the version this update is applied at (updates applied before
                it); keys η's schedule.
            num_workers: live workers (used only by delayed_nesterov with dn_buffer=0).
        Raises:
            ValueError: ``delta`` has another shape or dtype, or ``version`` < 0
                (nothing is changed).
        """
        self._check(delta)
        lr = self.lr_at(version)
        if weight != 1.0:
            delta.mul_(weight)  # s·Δ enters both the momentum and the direct term
        _torch_sgd(
            [self.params],
            [delta],
            [self.momentum_buffer],
            fused=self.params.device.type in ("cpu", "cuda"),
            weight_decay=0.0,
            momentum=self.config.momentum,
            lr=lr,
            dampening=0.0,
            nesterov=self.config.optimizer == "nesterov" and self.config.momentum > 0,
            maximize=False,
        )


class DelayedNesterov(OuterOptimizer):
    """Delayed Nesterov (Liu et al. 2024, arXiv 2401.09135, Alg. 3) on flat fp32 vectors.

    The momentum m is updated once every N arrivals from the mean of the buffered
    pseudo-gradients b; in between, each arrival moves θ by its own g_t/N plus a share c
    of the momentum step. With c = 0, N arrivals equal exactly one synchronous Nesterov
    step on their mean.

    With ``dn_buffer`` = 0, N is the number of live workers at each arrival; when it
    shrinks while the buffer fills, the buffer completes at once and its momentum update
    takes the mean over the arrivals it holds (with a constant N that mean is b/N).

    Args:
        params: θ, 1-D float32 (N,), updated in place.
        config: η (``lr``), μ (``momentum``), N (``dn_buffer``; 0 = ``num_workers`` at
            each arrival) and c (``dn_c``).
    Attributes:
        momentum_buffer: m, float32 (N,). delta_buffer: b, float32 (N,).
        arrivals: arrivals since the last momentum update.
    """

    def __init__(self, params: torch.Tensor, config: OuterConfig, block_sizes: list[int] | None = None) -> None:
        super().__init__(params, config)
        if self.momentum_buffer is None:
            self.momentum_buffer = torch.zeros_like(params)
        self.delta_buffer = torch.zeros_like(params)
        self.arrivals = 0
        #: ``block_check``: element counts of the blocks (the model's tensors, manifest order).
        self.block_sizes = block_sizes or [params.numel()]

    def _damp_against_momentum(self, g: torch.Tensor) -> None:
        """``block_check``: g_b ← (1 + cos(g_b, m_b))·g_b for every block b whose
        direction opposes the momentum's (cos < 0); blocks that agree are unchanged."""
        m = self.momentum_buffer
        assert m is not None  # allocated in __init__
        for g_b, m_b in zip(torch.split(g, self.block_sizes), torch.split(m, self.block_sizes)):
            dot = float(torch.dot(g_b, m_b))
            if dot < 0:
                norms = float(torch.linalg.vector_norm(g_b)) * float(torch.linalg.vector_norm(m_b))
                if norms > 0:
                    g_b.mul_(max(0.0, 1.0 + dot / norms))

    @torch.no_grad()
    def step(self, delta: torch.Tensor, weight: float = 1.0, *, version: int, num_workers: int = 1) -> None:
        """Apply one arrival g_t = s·Δ at version ``version`` with η_v (``delta`` is scaled
        in place when s ≠ 1)."""
        self._check(delta)
        if weight != 1.0:
            delta.mul_(weight)
        if self.config.block_check:
            self._damp_against_momentum(delta)
        lr, mu, c = self.lr_at(version), self.config.momentum, self.config.dn_c
        n = self.config.dn_buffer or max(1, num_workers)
        m, b = self.momentum_buffer, self.delta_buffer
        assert m is not None  # allocated in __init__
        b.add_(delta)  # b ← b + g_t
        self.arrivals += 1
        if self.arrivals >= n:  # (t+1) mod N = 0
            # m ← μ·m + b/N, the mean over the buffer's arrivals: with N = live workers, N
            # can shrink while the buffer fills (a worker left), and b/N would then count
            # the earlier arrivals N_old/N times over.
            m.mul_(mu).add_(b, alpha=1.0 / self.arrivals)
            self.params.sub_(m, alpha=lr * (1.0 - c * n + c) * mu)
            b.zero_()
            self.arrivals = 0
        elif c > 0:
            self.params.sub_(m, alpha=lr * c * mu)
        self.params.sub_(delta, alpha=lr / n)  # the arrival's own g_t/N


def make_outer_optimizer(
    params: torch.Tensor, config: OuterConfig, block_sizes: list[int] | None = None
) -> OuterOptimizer:
    """The outer optimizer ``config.optimizer`` names, over the flat fp32 ``params``
    (``block_sizes``: the model's tensor sizes, for ``block_check``)."""
    if config.optimizer == "delayed_nesterov":
        return DelayedNesterov(params, config, block_sizes)
    return OuterOptimizer(params, config)


class PseudoGradientMonitor:
    """Warns when the pushed pseudo-gradients say the global model is diverging.

    A healthy run's ‖Δ‖ changes slowly; a model that overshoots (outer η or μ too
    large for the number of workers, a worker whose inner learning rate blows up) makes
    its workers' pseudo-gradients grow by orders of magnitude within a few pushes. Each
    push's norm (the server passes ‖Δ‖∞, which its finiteness check already computes, so
    the monitor adds no pass over the payload) is compared with the median of the
    previous ``window`` pushes; one over
    ``factor`` times that median (after ``min_samples`` pushes) is logged as a warning
    and counted in ``warnings`` (StatusReply.divergence_warnings).
    """

    def __init__(self, factor: float = 10.0, window: int = 64, min_samples: int = 8) -> None:
        self.factor = factor
        self.min_samples = min_samples
        self._norms: collections.deque[float] = collections.deque(maxlen=window)
        self.warnings = 0

    def observe(self, norm: float, worker_id: int, version: int) -> bool:
        """Record the norm of a push applied at ``version``; True when it warned."""
        warned = False
        if len(self._norms) >= self.min_samples and math.isfinite(norm):
            median = statistics.median(self._norms)
            if median > 0 and norm > self.factor * median:
                self.warnings += 1
                warned = True
                log.warning(
                    "pseudo-gradient norm %.3g from worker %d at version %d is %.0fx the running median %.3g: "
                    "the global model may be diverging; lower --outer-lr or --outer-momentum, or the workers' "
                    "inner learning rate (check the held-out loss)",
                    norm,
                    worker_id,
                    version,
                    norm / median,
                    median,
                )
        self._norms.append(norm)
        return warned
