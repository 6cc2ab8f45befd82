"""The parameter server's configuration: address, the run it dictates, limits, durability,
sync-mode quorums.

Frozen, keyword-only dataclasses validated in ``__post_init__``: a bad value raises
``ConfigError`` naming the field, the value, the allowed range and the fix.
"""

from __future__ import annotations

import dataclasses
import math

from asyncdiloco.algo.config import ASYNC_OUTER, DEFAULT_LOCAL_STEPS, SYNC_OUTER, OuterConfig
from asyncdiloco.algo.schedule import GROUPINGS
from asyncdiloco.errors import ConfigError, require
from asyncdiloco.wire.codec import DEFAULT_BLOCK_SIZE, MAX_BLOCK_SIZE, WIRE_CODECS
from asyncdiloco.wire.security import ServerSecurityConfig, check_server_transport
from asyncdiloco.wire.tensors import DEFAULT_CHUNK_BYTES

MODES = ("async", "sync")
SYNC_WEIGHTINGS = ("mean", "tokens")
#: Sync mode's inner steps per member of a round: "fixed" (H for every member) or
#: "adaptive" (DyLU's H_w over the round's members, so they finish about together).
SYNC_LOCAL_STEPS = ("fixed", "adaptive")
#: The default of ``SyncConfig.local_steps`` (``--sync-local-steps``): one constant, to be
#: set to what the benchmark suite shows to win (docs/operations.md, "Sync mode").
DEFAULT_SYNC_LOCAL_STEPS = "fixed"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DurabilityConfig:
    """Where and how often the server makes its state durable (ps/durable/store.py).

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
        require(bool(self.checkpoint_dir), "checkpoint_dir", self.checkpoint_dir, "give a folder path")
        require(self.checkpoint_every >= 1, "checkpoint_every", self.checkpoint_every, "must be >= 1 applied push")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyncConfig:
    """Sync mode on the server: how quorums form and how long a round may take.

    A round's quorum forms once at least ``min_workers`` asked to join it and either
    every live member of the previous quorum is among them, or every live registered
    worker is, or ``join_timeout_s`` passed since the round's first request (the role
    torchft's lighthouse plays; see ps/sync/quorum.py).
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
    #: Inner steps each member runs per round: "fixed" = H for every member; "adaptive" =
    #: Dynamic Local Updates inside a round (Liu et al. 2024, arXiv 2401.09135, Eq. 6):
    #: H_w = max(1, ⌊v_w / max v · H⌋) over the round's members' rates (H while a rate is
    #: unknown), handed to each member with the round's decision (ps/sync/quorum.py), so a
    #: faster member no longer waits for the slowest at every round.
    local_steps: str = DEFAULT_SYNC_LOCAL_STEPS

    def __post_init__(self) -> None:
        require(self.min_workers >= 1, "min_workers", self.min_workers, "must be >= 1 worker")
        require(
            math.isfinite(self.join_timeout_s) and self.join_timeout_s >= 0,
            "join_timeout_s",
            self.join_timeout_s,
            "must be a finite number of seconds >= 0",
        )
        require(
            math.isfinite(self.round_timeout_s) and self.round_timeout_s > 0,
            "round_timeout_s",
            self.round_timeout_s,
            "must be a finite number of seconds > 0 (default 60)",
        )
        require(self.weighting in SYNC_WEIGHTINGS, "sync weighting", self.weighting, f"choose one of {SYNC_WEIGHTINGS}")
        require(
            self.local_steps in SYNC_LOCAL_STEPS,
            "sync local_steps",
            self.local_steps,
            f"choose one of {SYNC_LOCAL_STEPS} (--sync-local-steps)",
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """The parameter server process: address, run config it dictates, limits.

    Raises:
        ConfigError: a value is invalid, or a token would be served over plaintext on a
            host beyond the loopback without ``security.insecure_trusted_network``
            (wire/security.py ``check_server_transport``).
    """

    #: Interface to bind. 127.0.0.1 by default; "0.0.0.0" (all interfaces) is an explicit choice.
    host: str = "127.0.0.1"
    #: TCP port; 0 picks a free one (read it from ``ParameterServer.port``).
    port: int = 29500
    #: The outer optimizer; None = the mode's default: ``ASYNC_OUTER`` (Delayed Nesterov,
    #: the configuration the benchmark suite shows to win) or ``SYNC_OUTER`` (DiLoCo).
    outer: OuterConfig = None  # type: ignore[assignment]  # None: replaced by the mode's default
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
    #: admitted), together with the old versions of a raw fp32 model still being pulled
    #: (ps/pull/live_view.py); the others wait, so server memory does not grow with the number of
    #: workers or of versions being pulled.
    receive_buffer_bytes: int = 64 * 1024**2
    #: With a wire codec (or a model not all fp32): most versions of the model encoded for
    #: pulls at once (each costs one payload of memory); with 1, a pull of a new version
    #: waits for the pulls of the previous one. A raw fp32 model's pulls read θ in place.
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
    #: TCP port of the optional bulk data channel (ps/transport/bulk.py: push/pull payloads as raw
    #: bytes beside gRPC, same host, TLS and token); 0 picks a free one; None = off.
    bulk_port: int | None = None
    #: TCP port of the HTTP monitoring endpoint on ``host`` (metrics.py, dashboard.py):
    #: Prometheus metrics at /metrics, the dashboard at /, the status at /status.json;
    #: 0 picks a free one; None = off.
    metrics_port: int | None = None
    #: This server's place in a sharded parameter server (ps/push/shard_order.py): shard 0 sequences
    #: every push, shards 1..S-1 apply them in its order. 0 of 1 = one unsharded server.
    shard_index: int = 0
    #: S, the number of shards the parameter vector is split over (wire/shards.py).
    shard_count: int = 1
    #: A follower shard: seconds a push waits for the one before it in shard 0's order
    #: before that one is applied as a zero pseudo-gradient.
    shard_fill_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        self._check_shards()
        self._check_mode_and_ports()
        self._check_limits()
        self._check_grouping()
        self._check_codec()
        check_server_transport(self.host, self.security)  # a token goes over TLS or stays on the loopback

    def _check_shards(self) -> None:
        require(self.shard_count >= 1, "shard_count", self.shard_count, "must be >= 1 (1 = unsharded)")
        require(
            0 <= self.shard_index < self.shard_count,
            "shard_index",
            self.shard_index,
            f"must be in [0, {self.shard_count - 1}] for shard_count={self.shard_count}",
        )
        require(
            self.shard_count == 1 or self.mode == "async",
            "mode",
            self.mode,
            "a sharded parameter server runs async mode only; use one server (shard_count=1) for sync mode",
        )
        require(self.shard_fill_timeout_s > 0, "shard_fill_timeout_s", self.shard_fill_timeout_s, "must be > 0 s")

    def _check_mode_and_ports(self) -> None:
        require(self.mode in MODES, "mode", self.mode, f"choose one of {MODES}")
        if self.outer is None:
            object.__setattr__(self, "outer", ASYNC_OUTER if self.mode == "async" else SYNC_OUTER)
        require(
            self.mode == "async" or self.outer.optimizer in ("nesterov", "sgd"),
            "outer optimizer",
            self.outer.optimizer,
            "sync mode applies one outer step per round on the mean: use nesterov (sync DiLoCo) or sgd (LocalSGD)",
        )
        require(0 <= self.port <= 65535, "port", self.port, "must be in [0, 65535]; 0 picks a free port")
        require(
            self.bulk_port is None or 0 <= self.bulk_port <= 65535,
            "bulk_port",
            self.bulk_port,
            "must be in [0, 65535] (0 picks a free port), or None for no bulk channel",
        )
        require(
            self.metrics_port is None or 0 <= self.metrics_port <= 65535,
            "metrics_port",
            self.metrics_port,
            "must be in [0, 65535] (0 picks a free port), or None for no metrics endpoint",
        )

        self._check_distinct_ports()

    def _check_distinct_ports(self) -> None:
        """Each listener of this server on its own port (0, a free one, never clashes)."""
        listeners = [
            ("port", "--port", "the gRPC port", self.port),
            ("bulk_port", "--bulk-port", "the bulk channel's port", self.bulk_port),
            ("metrics_port", "--metrics-port", "the metrics port", self.metrics_port),
        ]
        seen: dict[int, tuple[str, str]] = {}
        for field, flag, what, port in listeners:
            if not port:
                continue
            if port in seen:
                other_field, other_what = seen[port]
                raise ConfigError(
                    f"{field}={port} is invalid: it is also {other_what} ({other_field}), and each listener needs "
                    f"its own: give another {flag}, or 0 for a free one"
                )
            seen[port] = (field, what)

    def _check_limits(self) -> None:
        require(self.local_steps >= 1, "local_steps", self.local_steps, "H must be >= 1 inner step")
        require(
            1024 <= self.chunk_bytes <= 64 * 1024**2,
            "chunk_bytes",
            self.chunk_bytes,
            "must be in [1 KiB, 64 MiB] (default 4 MiB)",
        )
        require(self.max_payload_bytes >= 1, "max_payload_bytes", self.max_payload_bytes, "must be >= 1 byte")
        require(
            0 < self.max_abs_value < 1e30,
            "max_abs_value",
            self.max_abs_value,
            "must be in (0, 1e30) (fp32 overflows at 3.4e38)",
        )
        require(0 < self.lease_s <= 86400, "lease_s", self.lease_s, "must be in (0, 86400] seconds")
        require(self.max_concurrent_rpcs >= 4, "max_concurrent_rpcs", self.max_concurrent_rpcs, "must be >= 4")
        require(
            self.receive_buffer_bytes >= 0,
            "receive_buffer_bytes",
            self.receive_buffer_bytes,
            "must be >= 0 bytes (0 still admits one push at a time)",
        )
        require(self.pull_snapshots >= 1, "pull_snapshots", self.pull_snapshots, "must be >= 1 version")
        require(self.histogram_buckets >= 2, "histogram_buckets", self.histogram_buckets, "must be >= 2")

    def _check_grouping(self) -> None:
        require(self.grouping in GROUPINGS, "grouping", self.grouping, f"choose one of {GROUPINGS}")
        require(
            self.grouping != "barrier" or self.outer.optimizer == "delayed_nesterov",
            "grouping",
            self.grouping,
            f"a barrier waits for the Delayed Nesterov buffer, which {self.outer.optimizer!r} has none of: "
            "use --outer-optimizer delayed_nesterov, or --grouping window",
        )
        require(
            self.grace_s is None or 0 <= self.grace_s <= 600,
            "grace_s",
            self.grace_s,
            "must be in [0, 600] seconds, or None (auto: one round of the fastest worker)",
        )
        require(
            self.group_max_wait_s is None or 0 < self.group_max_wait_s <= 3600,
            "group_max_wait_s",
            self.group_max_wait_s,
            "must be in (0, 3600] seconds, or None (auto: the longest round)",
        )

    def _check_codec(self) -> None:
        require(self.wire_codec in WIRE_CODECS, "wire_codec", self.wire_codec, f"choose one of {WIRE_CODECS}")
        require(
            1 <= self.codec_block_size <= MAX_BLOCK_SIZE,
            "codec_block_size",
            self.codec_block_size,
            f"must be in [1, {MAX_BLOCK_SIZE}] elements per int8 block "
            f"(default {DEFAULT_BLOCK_SIZE}; multiples of 64 are fastest)",
        )
        require(
            self.mode == "async" or self.wire_codec == "raw",
            "wire_codec",
            self.wire_codec,
            "sync mode moves exact fp32 state (allreduce, round results, healing pulls): use --wire-codec raw "
            "with --mode sync, or --mode async to compress pushes and pulls",
        )
