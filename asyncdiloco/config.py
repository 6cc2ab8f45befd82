"""Frozen, keyword-only configuration dataclasses, validated in ``__post_init__``.

Each field carries its unit in its name or doc. A bad value raises ``ConfigError``
naming the field, the value, the allowed range and the fix.
"""

from __future__ import annotations

import dataclasses
import math
import os

from asyncdiloco.codec import DEFAULT_BLOCK_SIZE, MAX_BLOCK_SIZE, WIRE_CODECS
from asyncdiloco.errors import ConfigError
from asyncdiloco.schedule import GROUPINGS
from asyncdiloco.lr_schedule import LRSchedule
from asyncdiloco.tensors import DEFAULT_CHUNK_BYTES

OUTER_OPTIMIZERS = ("nesterov", "sgd", "delayed_nesterov")
MODES = ("async", "sync")
SYNC_WEIGHTINGS = ("mean", "tokens")
FAIL_MODES = ("kill", "hang", "raise")
STALENESS_WEIGHTINGS = ("constant", "inverse", "polynomial", "hinge")


def _require(ok: bool, field: str, value: object, rule: str) -> None:
    if not ok:
        raise ConfigError(f"{field}={value!r} is invalid: {rule}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OuterConfig:
    """The outer optimizer and staleness weighting the server applies.

    Defaults follow DiLoCo (Douillard et al. 2023, arXiv 2311.08105, Sec. 3): Nesterov
    momentum with η = 0.7, μ = 0.9.
    """

    #: "nesterov" (SGD with Nesterov momentum), "sgd" (heavy-ball momentum; with lr=1,
    #: momentum=0 the server adopts each worker's parameters: LocalSGD averaging), or
    #: "delayed_nesterov" (momentum updated once per N arrivals; Liu et al. 2024, Alg. 3).
    optimizer: str = "nesterov"
    #: η, the outer learning rate (dimensionless; scales the pseudo-gradient).
    lr: float = 0.7
    #: μ, the outer momentum coefficient in [0, 1).
    momentum: float = 0.9
    #: s(τ): "constant" 1; "inverse" 1/(1+τ); "polynomial" (1+τ)^-a;
    #: "hinge" 1 if τ ≤ b else 1/(a(τ−b)+1)  (Xie et al. 2019, arXiv 1903.03934, Sec. 5.2).
    staleness: str = "constant"
    #: a, the exponent (polynomial) or slope (hinge).
    staleness_a: float = 0.5
    #: b, the hinge's grace in versions.
    staleness_b: int = 4
    #: Pushes with staleness τ above this many versions are refused (FAILED_PRECONDITION).
    max_staleness: int = 1000
    #: delayed_nesterov: N, arrivals per momentum update (Liu et al. 2024, Alg. 3);
    #: 0 = the number of live workers at each arrival.
    dn_buffer: int = 0
    #: delayed_nesterov: c ∈ [0, 1/N], the share of momentum applied between updates.
    dn_c: float = 0.0
    #: delayed_nesterov: damp each parameter tensor of a pseudo-gradient that points
    #: against the outer momentum by (1 + cos(g, m)) (1 when they agree); in the spirit of
    #: HeLoCo's per-block momentum check (arXiv 2606.00271). Off in Liu et al.'s DN.
    block_check: bool = False
    #: η's schedule, keyed by the version v an update is applied at (updates applied
    #: before it): η_v = lr · lr_factor(v) (lr_schedule.py). "constant" or "cosine".
    lr_schedule: str = "constant"
    #: Versions of linear warmup of η (0 = none).
    lr_warmup_versions: int = 0
    #: cosine: the version from which η stays at its floor (must exceed the warmup).
    lr_total_versions: int = 0
    #: cosine: the floor as a fraction of lr, in [0, 1].
    lr_min_ratio: float = 0.1

    def schedule(self) -> LRSchedule:
        """η's schedule as an ``LRSchedule`` (its counter is the version)."""
        return LRSchedule(kind=self.lr_schedule, warmup=self.lr_warmup_versions, total=self.lr_total_versions,
                          min_ratio=self.lr_min_ratio)  # fmt: skip

    def __post_init__(self) -> None:
        _require(self.optimizer in OUTER_OPTIMIZERS, "outer optimizer", self.optimizer, f"choose one of {OUTER_OPTIMIZERS}")
        _require(math.isfinite(self.lr) and self.lr > 0, "outer lr", self.lr, "must be a finite number > 0 (DiLoCo uses 0.7)")
        _require(0 <= self.momentum < 1, "outer momentum", self.momentum, "must lie in [0, 1) (DiLoCo uses 0.9)")
        _require(
            self.staleness in STALENESS_WEIGHTINGS, "staleness", self.staleness, f"choose one of {STALENESS_WEIGHTINGS}"
        )
        _require(math.isfinite(self.staleness_a) and self.staleness_a >= 0, "staleness_a", self.staleness_a, "must be >= 0")
        _require(self.staleness_b >= 0, "staleness_b", self.staleness_b, "must be >= 0 versions")
        _require(self.max_staleness >= 0, "max_staleness", self.max_staleness, "must be >= 0 versions")
        _require(self.dn_buffer >= 0, "dn_buffer", self.dn_buffer, "must be >= 1 arrivals, or 0 for the number of workers")
        _require(
            0 <= self.dn_c <= (1 / self.dn_buffer if self.dn_buffer else 1),
            "dn_c",
            self.dn_c,
            f"must lie in [0, 1/N] with N = dn_buffer = {self.dn_buffer or 'workers'} (0 is Liu et al.'s default)",
        )
        try:
            self.schedule()
        except ConfigError as exc:
            raise ConfigError(
                f"outer {exc} [kind: lr_schedule, --outer-lr-schedule; warmup: lr_warmup_versions, "
                f"--outer-warmup-versions; total: lr_total_versions, --outer-total-versions; "
                f"min_ratio: lr_min_ratio, --outer-min-lr-ratio]"
            ) from None


def _require_file(path: str | None, field: str) -> None:
    _require(path is None or os.path.isfile(path), field, path, "no such file; give the path of an existing file")


#: The async server's default outer step: Delayed Nesterov (Liu et al. 2024, Alg. 3) with
#: N = the live workers, constant staleness weights (the grouping keeps τ within a group),
#: η and μ as chosen by the benchmark suite (docs/algorithms.md has the sweep).
ASYNC_OUTER = OuterConfig(optimizer="delayed_nesterov", lr=0.7, momentum=0.6)
#: The sync server's default: DiLoCo's own outer step (Douillard et al. 2023, Sec. 3).
SYNC_OUTER = OuterConfig(optimizer="nesterov", lr=0.7, momentum=0.9)
#: H, inner steps between pushes (the fastest worker's under DyLU).
DEFAULT_LOCAL_STEPS = 20


@dataclasses.dataclass(frozen=True, kw_only=True)
class DurabilityConfig:
    """Where and how often the server makes its state durable (ps/store.py).

    Every acknowledged push is appended to a write-ahead log and fsynced before the
    reply; a checkpoint every ``checkpoint_every`` applied pushes (and on shutdown)
    lets the log be truncated.
    """

    #: Folder for checkpoints and the write-ahead log; created if missing.
    checkpoint_dir: str
    #: Applied pushes between two checkpoints (the log replayed after a crash is at most this long).
    checkpoint_every: int = 100
    #: When the newest checkpoint is corrupt, start from the previous good one (and replay
    #: the log from there) instead of refusing to start.
    fallback_to_previous: bool = False
    #: fsync the log before every acknowledgement. False trades crash safety for speed
    #: (a power loss may then lose acknowledged pushes; a killed process does not).
    fsync: bool = True

    def __post_init__(self) -> None:
        _require(bool(self.checkpoint_dir), "checkpoint_dir", self.checkpoint_dir, "give a folder path")
        _require(self.checkpoint_every >= 1, "checkpoint_every", self.checkpoint_every, "must be >= 1 applied push")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerSecurityConfig:
    """Shared-token authentication and TLS for the server (security.py)."""

    #: File holding the shared token (first line); every RPC must carry it. None: no token.
    token_file: str | None = None
    #: PEM server certificate chain and private key; both or neither (None: plaintext).
    tls_cert: str | None = None
    tls_key: str | None = None
    #: PEM CA bundle that client certificates must chain to; set = mutual TLS (clients
    #: without a valid certificate are refused during the handshake).
    tls_client_ca: str | None = None

    def __post_init__(self) -> None:
        for name in ("token_file", "tls_cert", "tls_key", "tls_client_ca"):
            _require_file(getattr(self, name), name)
        _require((self.tls_cert is None) == (self.tls_key is None), "tls_cert/tls_key", (self.tls_cert, self.tls_key),
                 "give both --tls-cert and --tls-key, or neither")
        _require(self.tls_client_ca is None or self.tls_cert is not None, "tls_client_ca", self.tls_client_ca,
                 "mutual TLS needs the server's own --tls-cert and --tls-key too")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClientSecurityConfig:
    """Token and TLS settings of a worker or other client (security.py)."""

    #: File holding the shared token the server expects (first line). None: send none.
    token_file: str | None = None
    #: PEM CA bundle to verify the server's certificate with; set = connect over TLS.
    tls_ca: str | None = None
    #: PEM client certificate and key, for a server that requires mutual TLS.
    tls_cert: str | None = None
    tls_key: str | None = None
    #: Expected name in the server's certificate when it differs from the host in the
    #: address (e.g. "localhost" when connecting to an IP); None = the address's host.
    tls_server_name: str | None = None

    def __post_init__(self) -> None:
        for name in ("token_file", "tls_ca", "tls_cert", "tls_key"):
            _require_file(getattr(self, name), name)
        _require((self.tls_cert is None) == (self.tls_key is None), "tls_cert/tls_key", (self.tls_cert, self.tls_key),
                 "give both --tls-cert and --tls-key, or neither")
        _require(self.tls_cert is None or self.tls_ca is not None, "tls_cert", self.tls_cert,
                 "a client certificate is only sent over TLS: also give --tls-ca")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyncConfig:
    """Sync mode on the server: how quorums form and how long a round may take.

    A round's quorum forms once at least ``min_workers`` asked to join it and either
    every live member of the previous quorum is among them, or every live registered
    worker is, or ``join_timeout_s`` passed since the round's first request (the role
    torchft's lighthouse plays; see ps/quorum.py).
    """

    #: A quorum needs at least this many workers.
    min_workers: int = 1
    #: Seconds after a round's first request after which ≥ min_workers form a quorum
    #: without waiting for missing members of the previous quorum.
    join_timeout_s: float = 10.0
    #: Seconds from a quorum's formation by which every member must have voted; later
    #: the round is aborted. Must cover the workers' allreduce timeout plus rank 0's upload.
    round_timeout_s: float = 60.0
    #: "mean": each member's pseudo-gradient weighs 1; "tokens": it weighs its tokens.
    weighting: str = "mean"
    #: TCP port of the rendezvous store the server hosts; 0 picks a free one.
    store_port: int = 0

    def __post_init__(self) -> None:
        _require(self.min_workers >= 1, "min_workers", self.min_workers, "must be >= 1 worker")
        _require(
            math.isfinite(self.join_timeout_s) and self.join_timeout_s >= 0,
            "join_timeout_s", self.join_timeout_s, "must be a finite number of seconds >= 0",
        )  # fmt: skip
        _require(
            math.isfinite(self.round_timeout_s) and self.round_timeout_s > 0,
            "round_timeout_s", self.round_timeout_s, "must be a finite number of seconds > 0 (default 60)",
        )  # fmt: skip
        _require(self.weighting in SYNC_WEIGHTINGS, "sync weighting", self.weighting, f"choose one of {SYNC_WEIGHTINGS}")
        _require(0 <= self.store_port <= 65535, "store_port", self.store_port, "must be in [0, 65535]; 0 picks a free port")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """The parameter server process: address, run config it dictates, limits."""

    #: Interface to bind. 127.0.0.1 by default; "0.0.0.0" (all interfaces) is an explicit choice.
    host: str = "127.0.0.1"
    #: TCP port; 0 picks a free one (read it from ``ParameterServer.port``).
    port: int = 29500
    #: The outer optimizer; None = the mode's default: ``ASYNC_OUTER`` (Delayed Nesterov,
    #: the configuration the benchmark suite shows to win) or ``SYNC_OUTER`` (DiLoCo).
    outer: OuterConfig | None = None
    #: H, inner steps each worker runs between two pushes (dictated to workers on Join);
    #: under DyLU the fastest live worker's.
    local_steps: int = DEFAULT_LOCAL_STEPS
    #: Largest payload chunk in bytes, both directions (gRPC messages stay far below its limits).
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    #: Largest model payload accepted, in bytes.
    max_payload_bytes: int = 16 * 1024**3
    #: Seconds without any RPC from a worker before its lease expires.
    lease_s: float = 60.0
    #: Largest magnitude a pushed value may have; larger ones would overflow θ (refused).
    max_abs_value: float = 1e9
    #: Threads serving RPCs; each in-flight push or pull holds one.
    max_concurrent_rpcs: int = 64
    #: Bytes of receive buffers that pushes in flight may hold at once (one push is always
    #: admitted); the others wait, so server memory does not grow with the number of workers.
    receive_buffer_bytes: int = 64 * 1024**2
    #: Most versions of the model encoded for pulls at once (each costs one payload of
    #: memory); with 1, a pull of a new version waits for the pulls of the previous one.
    pull_snapshots: int = 2
    #: Staleness histogram buckets; the last bucket counts every larger τ.
    histogram_buckets: int = 32
    #: Dynamic Local Updates (Liu et al. 2024, Eq. 6): tell each worker H_w = ⌊v_w/max v · H⌋
    #: from its inner-step rate v_w (reported by the worker from its first round on).
    dylu: bool = True
    #: How push replies are grouped (schedule.py; Liu et al. 2024, Alg. 2): "window" holds
    #: them until every expected worker has pushed or ``grace_s`` after the group's first
    #: arrival; "barrier" until the Delayed Nesterov buffer of N arrivals is complete or
    #: ``group_max_wait_s``; "off" replies at once.
    grouping: str = "window"
    #: The window, seconds from a group's first arrival; None = auto: one round of the
    #: fastest live worker, at least 1.5 inner steps of the slowest (``schedule.auto_window_s``).
    grace_s: float | None = None
    #: "barrier": the longest a reply is held, seconds; None = auto: the longest round
    #: (H_w / v_w) of a live worker plus the window.
    group_max_wait_s: float | None = None
    #: Checkpoints and write-ahead log; None keeps the state in memory only.
    durability: DurabilityConfig | None = None
    #: Token and TLS; None serves plaintext without authentication.
    security: ServerSecurityConfig | None = None
    #: "async" (pushes applied on arrival) or "sync" (quorum rounds, allreduce among workers).
    mode: str = "async"
    #: Sync mode settings (ignored in async mode).
    sync: SyncConfig = dataclasses.field(default_factory=SyncConfig)
    #: Encoding of pseudo-gradient pushes and pulls on the wire (codec.py): "raw" (each
    #: parameter in its dtype), "bf16" (2 bytes/element, relative error ≤ 2^-8) or "int8"
    #: (block-wise absmax: 1 byte/element + 4 bytes/block, error ≤ absmax_block/254).
    #: Master weights and momentum stay fp32. Async mode only.
    wire_codec: str = "raw"
    #: int8: elements per absmax block (ignored by raw and bf16).
    codec_block_size: int = DEFAULT_BLOCK_SIZE
    #: TCP port of the optional bulk data channel (ps/bulk.py: push/pull payloads as raw
    #: bytes beside gRPC, same host, TLS and token); 0 picks a free one; None = off.
    bulk_port: int | None = None

    def __post_init__(self) -> None:
        _require(self.mode in MODES, "mode", self.mode, f"choose one of {MODES}")
        if self.outer is None:
            object.__setattr__(self, "outer", ASYNC_OUTER if self.mode == "async" else SYNC_OUTER)
        _require(
            self.mode == "async" or self.outer.optimizer in ("nesterov", "sgd"),
            "outer optimizer",
            self.outer.optimizer,
            "sync mode applies one outer step per round on the mean: use nesterov (sync DiLoCo) or sgd (LocalSGD)",
        )
        _require(0 <= self.port <= 65535, "port", self.port, "must be in [0, 65535]; 0 picks a free port")
        _require(self.bulk_port is None or 0 <= self.bulk_port <= 65535, "bulk_port", self.bulk_port,
                 "must be in [0, 65535] (0 picks a free port), or None for no bulk channel")
        _require(self.local_steps >= 1, "local_steps", self.local_steps, "H must be >= 1 inner step")
        _require(
            1024 <= self.chunk_bytes <= 64 * 1024**2,
            "chunk_bytes",
            self.chunk_bytes,
            "must be in [1 KiB, 64 MiB]; 4 MiB is the measured sweet spot",
        )
        _require(self.max_payload_bytes >= 1, "max_payload_bytes", self.max_payload_bytes, "must be >= 1 byte")
        _require(
            0 < self.max_abs_value < 1e30, "max_abs_value", self.max_abs_value, "must be in (0, 1e30) (fp32 overflows at 3.4e38)"
        )  # fmt: skip
        _require(0 < self.lease_s <= 86400, "lease_s", self.lease_s, "must be in (0, 86400] seconds")
        _require(self.max_concurrent_rpcs >= 4, "max_concurrent_rpcs", self.max_concurrent_rpcs, "must be >= 4")
        _require(self.receive_buffer_bytes >= 0, "receive_buffer_bytes", self.receive_buffer_bytes,
                 "must be >= 0 bytes (0 still admits one push at a time)")  # fmt: skip
        _require(self.pull_snapshots >= 1, "pull_snapshots", self.pull_snapshots, "must be >= 1 version")
        _require(self.histogram_buckets >= 2, "histogram_buckets", self.histogram_buckets, "must be >= 2")
        _require(self.grouping in GROUPINGS, "grouping", self.grouping, f"choose one of {GROUPINGS}")
        _require(self.grouping != "barrier" or self.outer.optimizer == "delayed_nesterov", "grouping", self.grouping,
                 f"a barrier waits for the Delayed Nesterov buffer, which {self.outer.optimizer!r} has none of: "
                 "use --outer-optimizer delayed_nesterov, or --grouping window")  # fmt: skip
        _require(self.grace_s is None or 0 <= self.grace_s <= 600, "grace_s", self.grace_s,
                 "must be in [0, 600] seconds, or None (auto: one round of the fastest worker)")  # fmt: skip
        _require(self.group_max_wait_s is None or 0 < self.group_max_wait_s <= 3600, "group_max_wait_s",
                 self.group_max_wait_s, "must be in (0, 3600] seconds, or None (auto: the longest round)")  # fmt: skip
        _require(self.wire_codec in WIRE_CODECS, "wire_codec", self.wire_codec, f"choose one of {WIRE_CODECS}")
        _require(
            1 <= self.codec_block_size <= MAX_BLOCK_SIZE, "codec_block_size", self.codec_block_size,
            f"must be in [1, {MAX_BLOCK_SIZE}] elements per int8 block (default {DEFAULT_BLOCK_SIZE}; multiples of 64 are fastest)",
        )  # fmt: skip
        _require(
            self.mode == "async" or self.wire_codec == "raw", "wire_codec", self.wire_codec,
            "sync mode moves exact fp32 state (allreduce, round results, healing pulls): use --wire-codec raw "
            "with --mode sync, or --mode async to compress pushes and pulls",
        )  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    """How a worker talks to the server (the run config itself comes from the server)."""

    #: "HOST:PORT" of the parameter server.
    server: str = "127.0.0.1:29500"
    #: Name shown in the server's status and reports.
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
    #: keeping the local progress made meanwhile (overlap.py; Streaming DiLoCo, arXiv
    #: 2501.18512; eager updates, arXiv 2502.12996). The sync worker refuses it.
    overlap: bool = False
    #: Token and TLS; None talks plaintext without a token.
    security: ClientSecurityConfig | None = None
    #: Push and pull over the server's bulk data channel when it offers one
    #: (RunConfig.bulk_port > 0), falling back to gRPC per call; False = gRPC only.
    bulk_channel: bool = True

    def __post_init__(self) -> None:
        host, sep, port = self.server.rpartition(":")
        _require(
            bool(sep) and bool(host) and port.isdigit() and 1 <= int(port) <= 65535,
            "server",
            self.server,
            "give HOST:PORT with a port in [1, 65535], e.g. 127.0.0.1:29500",
        )
        for name in ("rpc_timeout_s", "timeout_s_per_mib", "initial_backoff_s", "max_backoff_s"):
            value = getattr(self, name)
            _require(0 < value <= 86400, name, value, "must be in (0, 86400] seconds")
        _require(self.join_timeout_s >= 0, "join_timeout_s", self.join_timeout_s, "must be >= 0 seconds")
        _require(isinstance(self.overlap, bool), "overlap", self.overlap, "must be True or False")
        _require(
            self.max_backoff_s >= self.initial_backoff_s,
            "max_backoff_s",
            self.max_backoff_s,
            f"must be >= initial_backoff_s={self.initial_backoff_s}",
        )
        _require(
            self.heartbeat_s is None or 0 < self.heartbeat_s <= 3600, "heartbeat_s", self.heartbeat_s,
            "must be in (0, 3600] seconds, or None for a third of the server's lease",
        )  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyncWorkerConfig:
    """Sync mode on the worker: collective timeouts, rendezvous, fault injection."""

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
    #: Fault injection for tests (like torchft's ``fail_at``): in this worker's first
    #: allreduce for round ``fail_at_round`` (1-based) or a later one, do ``fail_mode`` (once).
    fail_at_round: int | None = None
    #: Fault injection: only in a round whose quorum has at least this many members.
    fail_min_world_size: int = 1
    #: "kill": SIGKILL this process with the allreduce in flight; "hang": stop
    #: responding before the allreduce (sleep); "raise": fail the collective here.
    fail_mode: str = "kill"

    def __post_init__(self) -> None:
        for name in ("allreduce_timeout_s", "quorum_timeout_s"):
            value = getattr(self, name)
            _require(math.isfinite(value) and value > 0, name, value, "must be a finite number of seconds > 0")
        _require(self.fail_at_round is None or self.fail_at_round >= 1, "fail_at_round", self.fail_at_round,
                 "must be >= 1 or None")  # fmt: skip
        _require(self.fail_mode in FAIL_MODES, "fail_mode", self.fail_mode, f"choose one of {FAIL_MODES}")
        _require(self.fail_min_world_size >= 1, "fail_min_world_size", self.fail_min_world_size, "must be >= 1")
