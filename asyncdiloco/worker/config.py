"""A worker's configuration: ``WorkerConfig`` (how it talks to the server) and
``SyncWorkerConfig`` (sync mode's collectives); frozen, validated in ``__post_init__``.
"""

from __future__ import annotations

import dataclasses
import math

from asyncdiloco.errors import require
from asyncdiloco.wire.names import check_worker_name
from asyncdiloco.wire.security import ClientSecurityConfig, check_client_transport


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    """How a worker talks to the server (the run config itself comes from the server)."""

    #: "HOST:PORT" of the parameter server.
    server: str = "127.0.0.1:29500"
    #: The worker's identity: a Join under the name a worker gave before gets that
    #: worker's id back (a restarted worker resumes as itself), so two processes must
    #: never share one. Empty: the server names it "worker-<id>" and it never resumes
    #: (with ``state_dir``: the name saved there, or a new unique one saved there).
    worker_name: str = ""
    #: Deadline for small RPCs (join, heartbeat, status), seconds.
    rpc_timeout_s: float = 10.0
    #: Extra deadline per MiB of payload for push and pull, seconds (≥ 1 MiB/s assumed).
    timeout_s_per_mib: float = 1.0
    #: Give up joining after this many seconds of retries (then ServerUnavailableError).
    join_timeout_s: float = 30.0
    #: First retry delay after a failed sync, seconds; doubles up to ``max_backoff_s``.
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    #: Heartbeat period in seconds; None = a third of the server's lease.
    heartbeat_s: float | None = None
    #: Push the steps taken since the last sync when the worker closes.
    push_on_close: bool = True
    #: Overlap the push and the next pull with the next inner steps (async worker only):
    #: the sync runs in a background thread and its result is merged when it arrives,
    #: keeping the local progress made meanwhile (worker/push_pull.py; Streaming DiLoCo, arXiv
    #: 2501.18512; eager updates, arXiv 2502.12996). The sync worker refuses it.
    overlap: bool = False
    #: Token and TLS; None talks plaintext without a token.
    security: ClientSecurityConfig | None = None
    #: Push and pull over the server's bulk data channel when it offers one
    #: (RunConfig.bulk_port > 0), falling back to gRPC per call; False = gRPC only.
    bulk_channel: bool = True
    #: Folder of the worker's own state (worker/state_dir.py): saved atomically after
    #: every sync, loaded when the worker is built, so a restarted worker continues
    #: under its name with its inner optimizer, θ_base and unsent progress, push counter
    #: and the caller's ``extra``. None: nothing is saved.
    state_dir: str | None = None
    #: After this many pseudo-gradients in a row were dropped instead of applied (refused
    #: by the server, or not finite: a diverged model; sync mode: rounds whose Δ from this
    #: member was not finite), the worker raises, naming the count and the fix, instead of
    #: dropping the next one too. 0: never raise.
    max_dropped_in_a_row: int = 5

    def __post_init__(self) -> None:
        check_worker_name(self.worker_name)
        for address in self.server.split(","):  # several: the shards of a sharded server, shard 0 first
            host, sep, port = address.strip().rpartition(":")
            require(
                bool(sep) and bool(host) and port.isdigit() and 1 <= int(port) <= 65535,
                "server",
                self.server,
                "give HOST:PORT with a port in [1, 65535], e.g. 127.0.0.1:29500 (a sharded server: "
                "HOST:PORT,HOST:PORT,... shard 0 first, or --shard-map FILE)",
            )
            check_client_transport(address, self.security)  # a token goes over TLS or stays on the loopback
        for name in ("rpc_timeout_s", "timeout_s_per_mib", "initial_backoff_s", "max_backoff_s"):
            value = getattr(self, name)
            require(0 < value <= 86400, name, value, "must be in (0, 86400] seconds")
        require(self.join_timeout_s >= 0, "join_timeout_s", self.join_timeout_s, "must be >= 0 seconds")
        require(isinstance(self.overlap, bool), "overlap", self.overlap, "must be True or False")
        require(
            isinstance(self.max_dropped_in_a_row, int) and self.max_dropped_in_a_row >= 0,
            "max_dropped_in_a_row",
            self.max_dropped_in_a_row,
            "must be an integer >= 0 (0: never raise)",
        )
        require(
            self.max_backoff_s >= self.initial_backoff_s,
            "max_backoff_s",
            self.max_backoff_s,
            f"must be >= initial_backoff_s={self.initial_backoff_s}",
        )
        require(
            self.heartbeat_s is None or 0 < self.heartbeat_s <= 3600,
            "heartbeat_s",
            self.heartbeat_s,
            "must be in (0, 3600] seconds, or None for a third of the server's lease",
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyncWorkerConfig:
    """Sync mode on the worker: collective timeouts and rendezvous."""

    #: Seconds a process-group build or allreduce may take before the round fails here
    #: (a dead peer fails it at once, a hung one after exactly this long).
    allreduce_timeout_s: float = 10.0
    #: Seconds to wait for a quorum at one sync point (at least the server's join timeout
    #: + 1 s); then training goes on locally and the next sync point asks again.
    quorum_timeout_s: float = 60.0
    #: Address this worker's gloo device binds and advertises to its peers. None: 127.0.0.1
    #: when the server address is a loopback one, else torch's default (GLOO_SOCKET_IFNAME
    #: or the host name).
    collective_host: str | None = None

    def __post_init__(self) -> None:
        for name in ("allreduce_timeout_s", "quorum_timeout_s"):
            value = getattr(self, name)
            require(math.isfinite(value) and value > 0, name, value, "must be a finite number of seconds > 0")
