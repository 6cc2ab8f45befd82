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

A worker's closing push (``PushHeader.last``) takes the direct term alone
(``step_closing``): θ ← θ − η·s(τ)·Δ/N, m, b and the arrival count unchanged
(docs/algorithms.md "The run's end").

Staleness weights (τ = versions applied since the worker's base version):
``constant`` 1; ``inverse`` 1/(1+τ) (Zhang et al. 2016, arXiv 1511.05950);
``polynomial`` (1+τ)^−a and ``hinge`` 1 if τ ≤ b else 1/(a(τ−b)+1)
(FedAsync, Xie et al. 2019, arXiv 1903.03934, Sec. 5.2).

With a schedule every η above is η_v = η · lr_factor(v), v the version the update is
applied at (lr_schedule.py); every caller passes the same v for the same update.

All updates are in place and allocate nothing per step; the kernel is torch's fused SGD.
A step may run block by block (``on_block``), bit-identical to one pass
(docs/performance.md).
"""

from __future__ import annotations

import collections
import logging
import math
import statistics
from collections.abc import Callable

import torch
from torch.optim.sgd import sgd as _torch_sgd

from asyncdiloco.algo.config import OuterConfig
from asyncdiloco.algo.lr_schedule import LRSchedule, lr_factor

log = logging.getLogger(__name__)

#: Elements per block of a blocked step (``on_block``): 256 Ki fp32 = 1 MiB per vector,
#: so θ, Δ and m of one block (3 MiB) stay in cache until the block is copied; smaller
#: blocks cost more in per-call overhead than they save (docs/performance.md). A multiple
#: of every SIMD width, so block edges never split a vector of torch's kernels.
STEP_BLOCK_ELEMS = 1 << 18

#: ``on_block(start, end)``: elements [start, end) of θ hold their new values.
BlockHook = Callable[[int, int], None]


class BlockDelta:
    """A pseudo-gradient Δ decoded block by block as the step reads it, instead of into
    a whole fp32 (N,) vector first (the server's bf16 payloads: ps/model.py
    ``pseudo_gradient_blocks``): the step then needs one block of scratch, not 4·N bytes.

    Args:
        numel: N, elements of Δ.
        decode: ``(start, end, out) -> out``: elements [start, end) of Δ as float32 into
            ``out`` (a float32 tensor of end − start elements).
    """

    dtype = torch.float32

    def __init__(self, numel: int, decode: Callable[[int, int, torch.Tensor], torch.Tensor]) -> None:
        self.shape = torch.Size([numel])
        self._decode = decode
        self._scratch = torch.empty(0, dtype=torch.float32)

    def numel(self) -> int:
        return self.shape[0]

    def block(self, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of Δ, float32, in a scratch valid until the next call
        (the step's own: it may scale it in place)."""
        if self._scratch.numel() < end - start:
            self._scratch = torch.empty(end - start, dtype=torch.float32)
        return self._decode(start, end, self._scratch[: end - start])

    def full(self) -> torch.Tensor:
        """All of Δ, float32 (N,), in a new tensor."""
        return self._decode(0, self.numel(), torch.empty(self.numel(), dtype=torch.float32))


def _block_of(delta: torch.Tensor | BlockDelta, start: int, end: int) -> torch.Tensor:
    return delta.block(start, end) if isinstance(delta, BlockDelta) else delta[start:end]


def chain_hooks(hooks: list[BlockHook]) -> BlockHook | None:
    """One ``on_block`` hook calling each of ``hooks`` in order (None when there are none)."""
    if not hooks:
        return None
    if len(hooks) == 1:
        return hooks[0]

    def on_block(start: int, end: int) -> None:
        for hook in hooks:
            hook(start, end)

    return on_block


def _blocks(numel: int, block_elems: int) -> list[tuple[int, int]]:
    """[start, end) of each block of ``numel`` elements, in order."""
    if block_elems <= 0:
        raise ValueError(f"block_elems is {block_elems}; it must be > 0 elements")
    return [(s, min(numel, s + block_elems)) for s in range(0, numel, block_elems)] or [(0, 0)]


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
        momentum_steps: outer steps that updated the momentum so far (every step here;
            Delayed Nesterov: one per completed buffer), for reports.
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
        self.momentum_steps = 0

    def lr_at(self, version: int) -> float:
        """η_v = η · lr_factor(v): the outer learning rate of the update applied at
        version ``version`` (updates applied before it); exactly η without a schedule."""
        return self.config.lr * lr_factor(self.schedule, version)

    def _check(self, delta: torch.Tensor | BlockDelta) -> None:
        if delta.shape != self.params.shape or delta.dtype != torch.float32:
            raise ValueError(
                f"pseudo-gradient has dtype {delta.dtype} shape {tuple(delta.shape)}; "
                f"expected float32 {tuple(self.params.shape)}"
            )

    @torch.no_grad()
    def step(
        self,
        delta: torch.Tensor | BlockDelta,
        weight: float = 1.0,
        *,
        version: int,
        num_workers: int = 1,
        on_block: BlockHook | None = None,
        block_elems: int = STEP_BLOCK_ELEMS,
    ) -> None:
        """θ ← update(θ, s·Δ) with η_v as in the module docstring: one pass of torch's fused
        SGD kernel over the flat θ, Δ and m.

        Args:
            delta: Δ = θ_base − θ_local, float32 (N,) on θ's device, the caller's scratch
                (scaled in place when ``weight`` ≠ 1); or a ``BlockDelta`` (CPU), decoded
                per block: the step then runs blocked.
            weight: s(τ), the staleness weight.
            version: v, the version this update is applied at (keys η's schedule).
            num_workers: live workers (used only by delayed_nesterov with dn_buffer=0).
            on_block: ``(start, end) -> None``, called after each block of ``block_elems``
                elements of θ is updated (bit-identical to one pass).
            block_elems: elements per block (> 0) with ``on_block``.
        Raises:
            ValueError: ``delta`` has another shape or dtype, ``version`` < 0, or
                ``block_elems`` ≤ 0 (nothing is changed).
        """
        self._check(delta)
        lr = self.lr_at(version)
        self.momentum_steps += 1
        if on_block is None and not isinstance(delta, BlockDelta):
            if weight != 1.0:
                delta.mul_(weight)  # s·Δ enters both the momentum and the direct term
            self._kernel(self.params, delta, self.momentum_buffer, lr)
            return
        m = self.momentum_buffer
        for start, end in _blocks(delta.numel(), block_elems):
            d = _block_of(delta, start, end)
            if weight != 1.0:
                d.mul_(weight)
            self._kernel(self.params[start:end], d, None if m is None else m[start:end], lr)
            if on_block is not None:
                on_block(start, end)

    def closing_workers(self, num_workers: int) -> int:
        """N for a closing push (``step_closing``): 1, the plain optimizers do not divide."""
        return 1

    @torch.no_grad()
    def step_closing(
        self,
        delta: torch.Tensor | BlockDelta,
        weight: float = 1.0,
        *,
        version: int,
        num_workers: int = 1,
        on_block: BlockHook | None = None,
        block_elems: int = STEP_BLOCK_ELEMS,
    ) -> None:
        """A worker's closing push (its partial round at close, ``PushHeader.last``): the
        direct term alone, θ ← θ − η_v·s·Δ/N, the momentum (Delayed Nesterov: also the
        buffer and its arrival count) left as it is (docs/algorithms.md "The run's end":
        a momentum step on a partial round raised the held-out loss). Arguments and
        errors as ``step`` (``delta`` is only read); ``num_workers`` is N for Delayed
        Nesterov (``closing_workers``), ignored by the plain optimizers."""
        self._check(delta)
        scale = weight * self.lr_at(version) / max(1, self.closing_workers(num_workers))
        average_in(self.params, delta, scale, on_block=on_block, block_elems=block_elems)

    def _kernel(self, params: torch.Tensor, delta: torch.Tensor, momentum: torch.Tensor | None, lr: float) -> None:
        """One pass of torch's fused SGD kernel over (slices of) θ, Δ and m: the
        ``torch._fused_sgd_`` call ``torch.optim.sgd.sgd(fused=True)`` makes, without
        its per-call grouping of the tensor lists (a blocked step calls it per block);
        ``torch.optim.sgd.sgd`` itself where the fused kernel is missing (other devices)."""
        mu = self.config.momentum
        nesterov = self.config.optimizer == "nesterov" and mu > 0
        if params.device.type in ("cpu", "cuda") and hasattr(torch, "_fused_sgd_"):
            torch._fused_sgd_(
                [params],
                [delta],
                [] if momentum is None else [momentum],  # m exists when μ > 0 (from __init__): never a first step
                weight_decay=0.0,
                momentum=mu,
                lr=lr,
                dampening=0.0,
                nesterov=nesterov,
                maximize=False,
                is_first_step=False,
            )
            return
        _torch_sgd(  # pragma: no cover - CPU and CUDA have the fused kernel
            [params],
            [delta],
            [momentum],
            weight_decay=0.0,
            momentum=mu,
            lr=lr,
            dampening=0.0,
            nesterov=nesterov,
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
        #: N of the last momentum update (0: none yet): a closing push is divided by at
        #: least this, so the Leaves at a run's end do not shrink its N (``closing_workers``).
        self.last_n = 0
        #: ``block_check``: element counts of the blocks (the model's tensors, manifest order).
        self.block_sizes = block_sizes or [params.numel()]

    def closing_workers(self, num_workers: int) -> int:
        """N for a closing push: ``dn_buffer``, or with N = the live workers the larger of
        ``num_workers`` (live now) and the N of the last momentum update, so a run's end,
        where every worker pushes its partial round and leaves, divides each closing push
        by the N the workers trained under (4, 4, 4, 4), not by one fewer after each Leave
        (4, 3, 2, 1)."""
        return self.config.dn_buffer or max(1, num_workers, self.last_n)

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
    def step(
        self,
        delta: torch.Tensor | BlockDelta,
        weight: float = 1.0,
        *,
        version: int,
        num_workers: int = 1,
        on_block: BlockHook | None = None,
        block_elems: int = STEP_BLOCK_ELEMS,
    ) -> None:
        """Apply one arrival g_t = s·Δ at version ``version`` with η_v (``delta`` is scaled
        in place when s ≠ 1); ``delta``, ``on_block`` and ``block_elems`` as in
        ``OuterOptimizer.step`` (``block_check``'s per-tensor damping needs whole blocks'
        dot products, so it runs over the whole Δ first, a ``BlockDelta`` decoded whole)."""
        self._check(delta)
        if isinstance(delta, BlockDelta) and self.config.block_check:
            delta = delta.full()
        blocked = on_block is not None or isinstance(delta, BlockDelta)
        spans = _blocks(delta.numel(), block_elems) if blocked else [(0, delta.numel())]
        if weight != 1.0 and (not blocked or self.config.block_check):
            assert isinstance(delta, torch.Tensor)
            delta.mul_(weight)
            weight = 1.0
        if self.config.block_check:
            assert isinstance(delta, torch.Tensor)
            self._damp_against_momentum(delta)
        n = self.config.dn_buffer or max(1, num_workers)
        completed = self._arrive(n)
        lr = self.lr_at(version)
        for start, end in spans:
            d = _block_of(delta, start, end)
            if weight != 1.0:
                d.mul_(weight)
            self._update(slice(start, end), d, lr, n, completed)
            if on_block is not None:
                on_block(start, end)

    def _arrive(self, n: int) -> int:
        """Count one arrival; the arrivals the buffer held when this one completed it
        ((t+1) mod N = 0), else 0."""
        self.arrivals += 1
        if self.arrivals < n:
            return 0
        completed, self.arrivals, self.last_n = self.arrivals, 0, n
        self.momentum_steps += 1
        return completed

    def _update(self, span: slice, d: torch.Tensor, lr: float, n: int, completed: int) -> None:
        """The arrival g_t (its elements ``span``, in ``d``) into b, m and θ."""
        mu, c = self.config.momentum, self.config.dn_c
        m = self.momentum_buffer
        assert m is not None  # allocated in __init__
        m_s, b_s, p_s = m[span], self.delta_buffer[span], self.params[span]
        b_s.add_(d)  # b ← b + g_t
        if completed:
            # m ← μ·m + b/N, the mean over the buffer's arrivals: with N = live workers, N
            # can shrink while the buffer fills (a worker left), and b/N would then count
            # the earlier arrivals N_old/N times over.
            m_s.mul_(mu).add_(b_s, alpha=1.0 / completed)
            p_s.sub_(m_s, alpha=lr * (1.0 - c * n + c) * mu)
            b_s.zero_()
        elif c > 0:
            p_s.sub_(m_s, alpha=lr * c * mu)
        p_s.sub_(d, alpha=lr / n)  # the arrival's own g_t/N


@torch.no_grad()
def average_in(
    params: torch.Tensor,
    delta: torch.Tensor | BlockDelta,
    scale: float,
    on_block: BlockHook | None = None,
    block_elems: int = STEP_BLOCK_ELEMS,
) -> None:
    """θ ← θ − scale·Δ, in place (``on_block`` as in ``OuterOptimizer.step``): how a parent
    server takes a regional server's pseudo-gradient, with scale = s(τ)/R over R live
    regions. Each regional Δ is already the product of that region's outer optimizer over
    its workers' pushes, so the parent averages the regions' progress (as DiLoCo's outer
    step averages replicas, Douillard et al. 2023, Alg. 1, with outer lr 1 and no
    momentum) instead of feeding it through a second outer optimizer with momentum, which
    diverged in the suite's two-region runs.

    Args:
        params: θ, float32 (N,). delta: Δ_region, float32 (N,) or a ``BlockDelta``.
        scale: s(τ)/R.
    """
    if on_block is None and not isinstance(delta, BlockDelta):
        params.sub_(delta, alpha=scale)
        return
    for start, end in _blocks(delta.numel(), block_elems):
        params[start:end].sub_(_block_of(delta, start, end), alpha=scale)
        if on_block is not None:
            on_block(start, end)


@torch.no_grad()
def look_ahead_point(outer: OuterOptimizer, version: int, out: torch.Tensor, lam: float) -> torch.Tensor:
    """The momentum look-ahead point θ̃ = θ − λ·η_v·μ·m into ``out`` (float32 (N,)):
    where the outer momentum alone will carry θ over the next λ outer steps, to first
    order (after "Momentum Look-Ahead for Asynchronous Distributed Low-Communication
    Training", ICLR 2025 workshop). A worker that starts its round there computes its
    pseudo-gradient near the model it will be applied to, not the one it pulled; Δ is still
    taken against θ̃ (the worker's own start). Plain θ when λ = 0 or there is no momentum.

    Args:
        outer: the server's outer optimizer (θ, m, η's schedule, μ).
        version: the current version (keys η_v).
        out: float32 (N,) to write.
        lam: λ, outer steps to look ahead (≥ 0; 0 = θ). Only the virtual-clock simulator
            serves it so far (bench/sim.py ``Method.look_ahead``); the server's pulls do not.
    Returns:
        ``out``.
    """
    out.copy_(outer.params)
    m = outer.momentum_buffer
    if lam > 0 and m is not None:
        out.sub_(m, alpha=lam * outer.lr_at(version) * outer.config.momentum)
    return out


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
