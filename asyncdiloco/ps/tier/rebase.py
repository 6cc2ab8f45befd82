"""The hierarchical tier's settings and its two steps on a regional server's state: the
snapshot S a push upward is cut from, and the rebase onto a pulled global model
(upstream.py's ``UpstreamLink`` drives them over the network; bench/sim_tier.py on the
virtual clock). The algorithm: upstream.py's module docstring, and docs/algorithms.md.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from asyncdiloco.errors import require
from asyncdiloco.wire.security import ClientSecurityConfig

if TYPE_CHECKING:  # the worker command imports this module's defaults, not the server's state
    from asyncdiloco.ps.state import ParameterServerState

#: Regional pushes applied between two pushes upward (``--parent-every``). The two-region
#: profile of the benchmark suite (docs/algorithms.md, "Hierarchical tier") measured it.
DEFAULT_PARENT_EVERY = 4


@dataclasses.dataclass(frozen=True, kw_only=True)
class UpstreamConfig:
    """The regional server's link to its parent (module docstring)."""

    #: The parent parameter server, "HOST:PORT".
    parent: str
    #: K: regional pseudo-gradients applied between two pushes upward.
    every: int = DEFAULT_PARENT_EVERY
    #: The name the parent knows this regional server by (a rejoin resumes it); "" = one of
    #: this process (server.py: "region-HOSTNAME:PORT").
    name: str = ""
    #: Token and TLS towards the parent (None: plaintext).
    security: ClientSecurityConfig | None = None
    #: Deadline of the small calls to the parent, seconds.
    rpc_timeout_s: float = 10.0
    #: Seconds before the first retry of an unreachable parent; doubles up to ``max_backoff_s``.
    initial_backoff_s: float = 0.2
    max_backoff_s: float = 10.0
    #: Seconds between two looks at the regional push count.
    poll_s: float = 0.05
    #: Seconds ``stop`` gives the last push upward (0: no last push).
    flush_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        host, sep, port = self.parent.rpartition(":")
        require(
            bool(sep and host and port.isdigit() and 0 < int(port) <= 65535),
            "parent",
            self.parent,
            "give the parent parameter server as HOST:PORT (e.g. 10.0.0.5:29500)",
        )
        require(self.every >= 1, "parent_every", self.every, "must be >= 1 regional push")
        require(self.rpc_timeout_s > 0, "rpc_timeout_s", self.rpc_timeout_s, "must be > 0 seconds")
        require(
            0 < self.initial_backoff_s <= self.max_backoff_s,
            "initial_backoff_s",
            self.initial_backoff_s,
            f"must be in (0, max_backoff_s={self.max_backoff_s}] seconds",
        )
        require(self.poll_s > 0, "poll_s", self.poll_s, "must be > 0 seconds")
        require(self.flush_timeout_s >= 0, "flush_timeout_s", self.flush_timeout_s, "must be >= 0 seconds")


def take_snapshot(state: ParameterServerState) -> tuple[torch.Tensor, tuple[int, int]]:
    """S, a copy of θ_regional (fp32 (N,)), with the regional (applied pushes, tokens) it holds."""
    with state.locks.apply:
        snapshot = state.model.theta.clone()
        with state.locks.books:
            return snapshot, (state.counters.applied_pushes, state.counters.tokens)


def rebase_onto(
    state: ParameterServerState, theta_g: torch.Tensor, since: torch.Tensor, residual: torch.Tensor | None = None
) -> None:
    """θ_regional ← θ_g − (since − θ_regional) − residual, in place, as one regional version.

    Args:
        state: the regional server's state (initialized).
        theta_g: the pulled global model, fp32 (N,).
        since: S, θ_regional when the push upward was cut (or θ_base: keep all since it), fp32 (N,).
        residual: what the parent's wire codec did not carry of that push, fp32 (N,); None = 0.
    """
    shift = theta_g - since
    if residual is not None:
        shift.sub_(residual)
    with state.locks.apply:
        state.snapshots.before_apply(state.version)  # pulls reading θ in place finish from a copy
        state.model.theta.add_(shift)
        with state.locks.books:
            state.model.version += 1
