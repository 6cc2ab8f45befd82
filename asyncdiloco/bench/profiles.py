"""The benchmark suite's worker profiles (``PROFILES``): per worker its speed, speed
changes, a leave and rejoin, its link, per-step time noise, its slice of the data, and the
model size the links are charged for. docs/algorithms.md, "What the virtual clock
charges", lists them."""

from __future__ import annotations

import dataclasses

from asyncdiloco.bench.sim_costs import GBIT_S, NO_NOISE, Link, Noise
from asyncdiloco.errors import ConfigError

#: A datacenter link: 0.5 ms one way, 10 Gbit/s.
DATACENTER = Link(latency_s=0.5e-3, bandwidth_Bps=10 * GBIT_S)
#: Mild noise: ±10 % log-normal jitter per step, 5 % slow drift, no stalls.
MILD = Noise(sigma=0.1, drift_sigma=0.05)
#: Liu et al. 2024's notebook speeds, seconds per inner step.
UNEVEN_SPEEDS = (0.58, 0.75, 1.51, 3.33)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Profile:
    """One benchmark setting: the workers and what the virtual clock charges them
    (virtual seconds; see the module docstring). ``sim.SimConfig`` is a profile plus a
    method, budget and seed."""

    #: Mean seconds per inner step of each worker (virtual clock); its length is the worker count.
    speeds_s_per_step: tuple[float, ...]
    #: Speed changes: (virtual time s, worker index, new seconds per step), in any order.
    speed_changes: tuple[tuple[float, int, float], ...] = ()
    #: A worker that leaves and rejoins: (worker index, leave at s, rejoin at s), or None.
    leave_rejoin: tuple[int, float, float] | None = None
    #: One link per worker (sim_costs.Link), or () for free communication.
    links: tuple[Link, ...] = ()
    #: Per-step time noise of every worker (drawn per worker from (seed, worker)).
    noise: Noise = NO_NOISE
    #: Non-IID data: worker i draws its batches from slice i of the training split
    #: (``BatchStream`` shards); the held-out set stays the common one.
    non_iid: bool = False
    #: Parameters whose bytes the links are charged for (None: the trained model's).
    #: The trained model is tiny (~60 k parameters), so its transfers would be free; a
    #: profile sets this to say "the virtual clock stands for a model of P parameters".
    #: Every byte count a run reports is of this size (the charged bytes).
    wire_params: int | None = None
    #: One line for reports.
    doc: str = ""

    def __post_init__(self) -> None:
        if not self.speeds_s_per_step or any(not s > 0 for s in self.speeds_s_per_step):
            raise ConfigError(f"speeds_s_per_step={self.speeds_s_per_step} is invalid: one positive value per worker")
        if self.links and len(self.links) != len(self.speeds_s_per_step):
            raise ConfigError(
                f"links has {len(self.links)} entries for {len(self.speeds_s_per_step)} workers: give one per worker, "
                "or () for free links"
            )
        if self.wire_params is not None and self.wire_params < 1:
            raise ConfigError(f"wire_params={self.wire_params} is invalid: give a parameter count >= 1, or None")

    def fields(self) -> dict:
        """The profile's fields by name (to build a ``SimConfig`` of this profile)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(Profile)}

    def describe(self) -> str:
        """One line: speeds, events, links, noise, data."""
        parts = [f"seconds/step {list(self.speeds_s_per_step)}"]
        if self.speed_changes:
            parts.append(f"speed changes {list(self.speed_changes)}")
        if self.leave_rejoin is not None:
            w, leave, back = self.leave_rejoin
            parts.append(f"worker {w} away {leave:g}–{back:g} s")
        if self.links:
            lat = sorted({round(link.latency_s * 1e3, 3) for link in self.links})
            bw = sorted({link.bandwidth_Bps / GBIT_S for link in self.links})
            parts.append(f"links {'/'.join(f'{x:g}' for x in lat)} ms, {'/'.join(f'{x:g}' for x in bw)} Gbit/s")
        if self.wire_params is not None:
            parts.append(f"charged as {self.wire_params / 1e6:g} M parameters")
        n = self.noise
        if not n.quiet:
            noise = f"noise σ {n.sigma:g}, drift {n.drift_sigma:g}"
            if n.stall_prob:
                noise += f", stalls p {n.stall_prob:g}/step of {n.stall_s:g} s mean"
            parts.append(noise)
        if self.non_iid:
            parts.append("non-IID data (one slice of the text per worker)")
        return ", ".join(parts)


def _dc(n: int) -> tuple[Link, ...]:
    return (DATACENTER,) * n


PROFILES: dict[str, Profile] = {
    "homogeneous": Profile(speeds_s_per_step=(1.0, 1.0, 1.0, 1.0), links=_dc(4), noise=MILD, doc="four equal workers"),
    "uneven": Profile(
        speeds_s_per_step=UNEVEN_SPEEDS, links=_dc(4), noise=MILD, doc="Liu et al.'s notebook speeds, datacenter links"
    ),
    "jittery": Profile(
        speeds_s_per_step=UNEVEN_SPEEDS,
        links=_dc(4),
        noise=Noise(sigma=0.5, stall_prob=0.005, stall_s=20.0, drift_sigma=0.1),
        doc="uneven mean speeds, heavy-tailed per-step noise and transient stalls of 20 s mean",
    ),
    "slow_link": Profile(
        speeds_s_per_step=UNEVEN_SPEEDS,
        links=tuple(Link(latency_s=ms / 1e3, bandwidth_Bps=GBIT_S) for ms in (50.0, 65.0, 80.0, 100.0)),
        noise=MILD,
        wire_params=150_000_000,  # a 600 MB fp32 push: 4.8 s at 1 Gbit/s, vs the fastest round 20 × 0.58 s
        doc="DiLoCo's setting: 1 Gbit/s and 50–100 ms to the server, links charged for a 150 M-parameter model",
    ),
    "non_iid": Profile(
        speeds_s_per_step=UNEVEN_SPEEDS,
        links=_dc(4),
        noise=MILD,
        non_iid=True,
        doc="uneven speeds, each worker draws its batches from its own quarter of the training text",
    ),
    "straggler": Profile(
        speeds_s_per_step=(1.0, 1.0, 1.0, 10.0), links=_dc(4), noise=MILD, doc="one worker 10x slower"
    ),
    "changing": Profile(
        speeds_s_per_step=UNEVEN_SPEEDS,
        speed_changes=((100.0, 0, 3.33), (100.0, 3, 0.58)),
        links=_dc(4),
        noise=MILD,
        doc="the fastest and the slowest worker swap speeds at 100 s",
    ),
    "leave_rejoin": Profile(
        speeds_s_per_step=(1.0, 1.0, 1.0, 1.0),
        leave_rejoin=(3, 60.0, 200.0),
        links=_dc(4),
        noise=MILD,
        doc="worker 3 leaves at 60 s and rejoins at 200 s",
    ),
}
