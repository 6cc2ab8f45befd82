"""What the virtual-clock simulator charges: links (``Link``: latency + bytes ÷ bandwidth;
``sync_round_comm_s``: a quorum round trip and a ring allreduce), payload bytes under a wire
codec (``wire_bytes``), per-worker step-time noise (``Noise``, ``StepTimer``), and the
workers' own rate estimates (``WorkerRate``, built per registration by ``RATE_PROBE``).
docs/algorithms.md, "What the virtual clock charges"."""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Sequence

import torch

from asyncdiloco.algo.rates import InnerStepRate
from asyncdiloco.errors import ConfigError
from asyncdiloco.wire.codec import make_codec
from asyncdiloco.wire.tensors import Manifest, TensorSpec

#: 1 Gbit/s in bytes per second.
GBIT_S = 1e9 / 8


@dataclasses.dataclass(frozen=True)
class Link:
    """A worker's link to the server (and to its ring neighbours in sync mode).

    Attributes:
        latency_s: one-way latency, seconds (≥ 0).
        bandwidth_Bps: bytes per second (> 0; ``math.inf``: transfers cost latency only).
    """

    latency_s: float = 0.0
    bandwidth_Bps: float = math.inf

    def __post_init__(self) -> None:
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ConfigError(f"latency_s={self.latency_s} is invalid: give one-way seconds >= 0")
        if not self.bandwidth_Bps > 0:
            raise ConfigError(f"bandwidth_Bps={self.bandwidth_Bps} is invalid: give bytes per second > 0")

    def transfer_s(self, n_bytes: float) -> float:
        """Seconds to move ``n_bytes`` one way: latency_s + n_bytes / bandwidth_Bps."""
        return self.latency_s + n_bytes / self.bandwidth_Bps


#: A link that costs nothing (the simulator's default: no communication charged).
FREE_LINK = Link()


def ring_allreduce_s(links: Sequence[Link], n_bytes: float) -> float:
    """Seconds of a ring allreduce of ``n_bytes`` over members with ``links``.

    A ring over N members runs 2(N − 1) steps (N − 1 of reduce-scatter, N − 1 of
    all-gather), each moving B/N bytes from every member to its neighbour at once, so
    each step is paced by the slowest link in the ring:
    ``2(N − 1) · (max latency + (B / N) / min bandwidth)``; 0 for N ≤ 1.
    """
    n = len(links)
    if n <= 1:
        return 0.0
    latency = max(link.latency_s for link in links)
    bandwidth = min(link.bandwidth_Bps for link in links)
    return 2 * (n - 1) * (latency + (n_bytes / n) / bandwidth)


def ring_allreduce_bytes(members: int, n_bytes: float) -> float:
    """Bytes each member sends (and receives) in a ring allreduce: 2(N − 1) · B/N."""
    return 2 * (members - 1) * n_bytes / members if members > 1 else 0.0


def sync_round_comm_s(links: Sequence[Link], n_bytes: float) -> float:
    """Seconds of one synchronous round's communication after the slowest member's last
    inner step: the quorum round trip to the server (2 × the largest member latency: the
    round starts when the last member's request is answered), then the ring allreduce
    of the pseudo-gradients (``ring_allreduce_s``). Sync mode's pseudo-gradients travel
    raw (fp32)."""
    if not links:
        return 0.0
    return 2 * max(link.latency_s for link in links) + ring_allreduce_s(links, n_bytes)


def wire_bytes(codec: str, numel: int) -> int:
    """Bytes of one push (or pull) of ``numel`` fp32 elements under wire codec ``codec``
    ("raw": 4·N; "bf16": 2·N; "int8": 4·⌈N/4096⌉ + N), from ``wire/codec.py`` itself."""
    manifest = Manifest((TensorSpec("flat", (numel,), torch.float32),))
    return make_codec(codec, manifest).wire_bytes


@dataclasses.dataclass(frozen=True, kw_only=True)
class Noise:
    """Per-step time noise of a worker (all multiplicative factors have mean 1).

    A step that starts at a base of s seconds (the profile's, after speed changes) takes
    ``s · drift · jitter (+ a stall)`` seconds:

    - jitter: log-normal, exp(σZ − σ²/2) with Z ~ N(0, 1) (heavy right tail; mean 1);
    - drift: exp(x) with x a slow Ornstein–Uhlenbeck walk per step,
      x ← (1 − 1/drift_steps)·x + drift_sigma·√(2/drift_steps)·Z (stationary std
      ``drift_sigma``, correlated over about ``drift_steps`` steps);
    - stall: with probability ``stall_prob`` per step, an extra pause drawn exponential
      with mean ``stall_s`` seconds (a preempted host, a stuck data loader, GC).

    Attributes:
        sigma: σ of the log-normal jitter (0: none).
        stall_prob: probability of a stall per step, in [0, 1).
        stall_s: mean stall, seconds.
        drift_sigma: stationary std of log-speed drift (0: none).
        drift_steps: correlation length of the drift, steps.
    """

    sigma: float = 0.0
    stall_prob: float = 0.0
    stall_s: float = 0.0
    drift_sigma: float = 0.0
    drift_steps: float = 500.0

    def __post_init__(self) -> None:
        if self.sigma < 0 or self.drift_sigma < 0 or self.stall_s < 0:
            raise ConfigError(f"noise {self} is invalid: sigma, drift_sigma and stall_s must be >= 0")
        if not 0 <= self.stall_prob < 1:
            raise ConfigError(f"stall_prob={self.stall_prob} is invalid: give a probability in [0, 1)")
        if not self.drift_steps >= 1:
            raise ConfigError(f"drift_steps={self.drift_steps} is invalid: give >= 1 step")

    @property
    def quiet(self) -> bool:
        return self.sigma == 0 and self.drift_sigma == 0 and (self.stall_prob == 0 or self.stall_s == 0)


NO_NOISE = Noise()


class StepTimer:
    """One worker's inner-step durations, deterministic per (seed, worker).

    Args:
        noise: the noise spec.
        seed, worker: seed the worker's own RNG (draws do not depend on other workers).
        base_s: ``t -> seconds per step`` of this worker at virtual time t (speed changes).
    """

    def __init__(self, noise: Noise, seed: int, worker: int, base_s: Callable[[float], float]) -> None:
        self.noise = noise
        self.base_s = base_s
        self._rng = random.Random(f"asyncdiloco-sim-steps:{seed}:{worker}")
        self._drift = 0.0

    def step_s(self, t: float) -> float:
        """Duration of one inner step that starts at virtual time ``t``, seconds."""
        s = self.base_s(t)
        n = self.noise
        if n.quiet:
            return s
        rng = self._rng
        if n.drift_sigma > 0:
            k = 1.0 / n.drift_steps
            self._drift = (1 - k) * self._drift + n.drift_sigma * math.sqrt(2 * k) * rng.gauss(0.0, 1.0)
            s *= math.exp(self._drift)
        if n.sigma > 0:
            s *= math.exp(n.sigma * rng.gauss(0.0, 1.0) - n.sigma**2 / 2)
        if n.stall_prob > 0 and rng.random() < n.stall_prob:
            s += rng.expovariate(1.0 / n.stall_s) if n.stall_s > 0 else 0.0
        return s

    def steps_s(self, t: float, count: int) -> list[float]:
        """Durations of ``count`` consecutive steps, the first starting at ``t``."""
        out = []
        for _ in range(count):
            d = self.step_s(t)
            out.append(d)
            t += d
        return out


#: worker/base.py ``WorkerBase.RATE_PROBE_STEPS``: before its first push a worker reports its
#: rate every this many timed inner steps (kept equal by tests/test_sim.py).
RATE_PROBE_STEPS = 3


class WorkerRate:
    """A simulated worker's rate, measured as the real worker measures it: the worker's
    ``InnerStepRate`` (algo/rates.py; first step untimed, mean of the last 16 timed steps
    without the longest) fed each simulated step's duration (``step``); before the first
    push of a registration it reports the rate every ``RATE_PROBE_STEPS`` timed steps
    (worker/base.py ``_report_rate``), and every push carries ``compute_s`` = the pushed
    steps at that rate (``InnerStepRate.seconds_for``), from which the server's ``StepRateMeter``
    takes its sample.
    """

    def __init__(self) -> None:
        self.meter = InnerStepRate(clock=lambda: 0.0)
        self.reporting = True  # until the first push of the registration
        self._reported_at = 0

    def step(self, duration_s: float) -> float | None:
        """One inner step of ``duration_s`` seconds ended; returns the rate (inner steps
        per second) to report with a heartbeat now, or None."""
        self.meter.step_took(duration_s)
        if not self.reporting:
            return None
        timed, rate = self.meter.timed_steps, self.meter.steps_per_s
        if rate <= 0 or timed - self._reported_at < RATE_PROBE_STEPS:
            return None
        self._reported_at = timed
        return rate

    def compute_s(self, steps: int, measured_s: float) -> float:
        """A push's ``compute_s`` for ``steps`` steps (``measured_s``, their summed
        durations, while no step was timed)."""
        return self.meter.seconds_for(steps) or measured_s


#: The estimator a simulated worker uses (swap to change it).
RATE_PROBE: Callable[[], WorkerRate] = WorkerRate
