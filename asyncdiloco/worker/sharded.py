"""A client of a sharded parameter server: one ``ParameterServerClient`` per shard behind the
same methods, shard 0 sequencing every push (docs/worker.md, "The sharded client";
docs/operations.md, "A sharded server"), and ``connect``, which builds a worker's client.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar, cast

import torch

from asyncdiloco.errors import ConfigError, ServerUnavailableError, StalePushError
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.shards import ShardMap
from asyncdiloco.wire.tensors import Manifest
from asyncdiloco.worker.client import ParameterServerClient, Pulled
from asyncdiloco.worker.config import WorkerConfig

log = logging.getLogger(__name__)

#: gRPC metadata key of shard 0's decision (the server's ps/push/shard_order.py ``METADATA_KEY``).
ORDER_KEY = "adl-shard-order"
#: Wire codecs whose payload is element-wise (a shard's part is a byte range of the whole).
SLICEABLE_CODECS = ("raw", "bf16", "")

_T = TypeVar("_T")


def shard_addresses(server: str) -> list[str]:
    """The shard addresses of a worker's ``server`` setting: "HOST:PORT" (one server) or
    "HOST:PORT,HOST:PORT,..." (shard 0 first)."""
    return [a.strip() for a in server.split(",") if a.strip()]


class ShardedClient:
    """The calls of ``ParameterServerClient`` over S shards (docs/worker.md, "The sharded client").

    Args:
        addresses: "HOST:PORT" of every shard, shard 0 first.
        **client_kwargs: passed to each shard's ``ParameterServerClient`` (the bulk
            channel is not used: the shard order travels as gRPC metadata).
    Raises:
        ConfigError: no address.
    """

    def __init__(self, addresses: list[str], **client_kwargs) -> None:
        if not addresses:
            raise ConfigError("a sharded client needs at least one shard address (shard 0 first)")
        client_kwargs["bulk_channel"] = False
        self.addresses = list(addresses)
        self.address = addresses[0]
        self.clients = [ParameterServerClient(a, **client_kwargs) for a in addresses]
        self.rpc_timeout_s = self.clients[0].rpc_timeout_s
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(addresses) - 1), thread_name_prefix="shard")
        self._maps: dict[str, ShardMap] = {}
        #: shard 0's worker id → the worker's id on every shard.
        self._ids: dict[int, list[int]] = {}
        self._codec = "raw"
        #: Parts of pseudo-gradients refused by a follower as too late (filled with zeros there).
        self.late_parts = 0

    @property
    def num_shards(self) -> int:
        return len(self.clients)

    @property
    def corrupted_transfers(self) -> int:
        return sum(c.corrupted_transfers for c in self.clients)

    @property
    def group_wait_s(self) -> float:
        return self.clients[0].group_wait_s

    def shard_map(self, manifest: Manifest) -> ShardMap:
        """The byte-balanced map of ``manifest`` over this client's shards (wire/shards.py)."""
        key = manifest.manifest_hash
        if key not in self._maps:
            self._maps[key] = ShardMap.balance(manifest, self.num_shards)
        return self._maps[key]

    def _on_all(self, call: Callable[[int, ParameterServerClient], _T], start: int = 0) -> list[_T]:
        """``call(i, client_i)`` for shards ``start..S-1`` in parallel (the first on this thread)."""
        futures = [self._pool.submit(call, i, c) for i, c in enumerate(self.clients) if i > start]
        first = call(start, self.clients[start])
        return [first, *(f.result() for f in futures)]

    def _ranges(self, manifest: Manifest) -> list[tuple[int, int]]:
        """Each shard's byte range of the whole payload (raw: the manifest's dtypes; bf16: 2 bytes)."""
        smap = self.shard_map(manifest)
        if self._codec == "bf16":
            return [(2 * lo, 2 * hi) for lo, hi in zip(smap.bounds, smap.bounds[1:])]
        out, pos = [], 0
        for size in smap.sizes_bytes():
            out.append((pos, pos + size))
            pos += size
        return out

    def _ids_of(self, worker_id: int) -> list[int]:
        ids = self._ids.get(worker_id)
        if ids is None:
            return [worker_id] * self.num_shards  # not joined through this client (an observer's 0)
        return ids

    # ------------------------------------------------------------------ calls
    def join(self, manifest: Manifest, worker_name: str = "", steps_per_s: float = 0.0, ranks: int = 1) -> pb.JoinReply:
        """Join every shard with its sub-manifest; shard 0's reply (its id stands for the worker).

        Raises:
            ConfigError: the run's wire codec is int8 (block-wise: not sliceable by shard).
            The shards' Join errors.
        """
        smap = self.shard_map(manifest)
        replies = self._on_all(lambda i, c: c.join(smap.sub_manifest(i), worker_name, steps_per_s, ranks))
        codec = replies[0].run_config.wire_codec
        if codec not in SLICEABLE_CODECS:
            raise ConfigError(
                f"the run's wire codec is {codec!r}; a sharded parameter server supports {SLICEABLE_CODECS[:2]} "
                f"(int8's absmax blocks cross shard boundaries); start the shards with --wire-codec raw or bf16"
            )
        self._codec = codec or "raw"
        self._ids[replies[0].worker_id] = [r.worker_id for r in replies]
        return replies[0]

    def push(
        self,
        payload: torch.Tensor,
        *,
        worker_id: int,
        push_id: int,
        base_version: int,
        num_local_steps: int = 0,
        num_tokens: int = 0,
        compute_s: float = 0.0,
        kind: pb.PushKind = pb.PUSH_KIND_PSEUDO_GRADIENT,
        quorum_id: int = 0,
        last: bool = False,
    ) -> pb.PushReply:
        """Push ``payload`` (uint8 (total_bytes,), the whole model's wire layout) over the
        shards; shard 0's reply. Raises what ``ParameterServerClient.push`` raises."""
        manifest = self._manifest_of(payload)
        ranges = self._ranges(manifest)
        parts = [payload[a:b] for a, b in ranges]
        ids = self._ids_of(worker_id)
        common = dict(
            push_id=push_id,
            base_version=base_version,
            num_local_steps=num_local_steps,
            num_tokens=num_tokens,
            compute_s=compute_s,
            kind=kind,
            quorum_id=quorum_id,
        )
        first = self.clients[0].push(parts[0], worker_id=ids[0], last=last, **common)  # type: ignore[arg-type]
        if self.num_shards == 1 or not first.applied:
            return first
        metadata = self._shard_order(push_id) if kind == pb.PUSH_KIND_PSEUDO_GRADIENT else ()

        def follow(i: int, client: ParameterServerClient) -> None:
            try:
                client.push(parts[i], worker_id=ids[i], last=True, metadata=metadata, **common)  # type: ignore[arg-type]
            except StalePushError as exc:
                if kind != pb.PUSH_KIND_PSEUDO_GRADIENT:
                    log.info("shard %d: initial parameters already there (%s)", i, exc)
                    return
                self.late_parts += 1
                log.warning("shard %d dropped a late part of push %d: %s", i, push_id, exc)

        self._on_all(follow, start=1)[1:]
        return first

    def _shard_order(self, push_id: int) -> tuple[tuple[str, str], ...]:
        """Shard 0's decision on the push it applied (its reply's trailing metadata), as the
        metadata the other shards' parts carry.

        Raises:
            ConfigError: shard 0 sent none: it was not started as shard 0 of this many.
        """
        order = dict(self.clients[0].last_push_trailer).get(ORDER_KEY)
        if order is None:
            raise ConfigError(
                f"shard 0 at {self.address} applied push {push_id} without a shard order: it was not started "
                f"as shard 0 of {self.num_shards} (asyncdiloco server --shards {self.num_shards}, or "
                f"--shard-index 0 --shard-map FILE)"
            )
        return ((ORDER_KEY, order),)

    def _manifest_of(self, payload: torch.Tensor) -> Manifest:
        """The manifest this payload belongs to (the one joined with)."""
        for smap in self._maps.values():
            size = smap.manifest.total_bytes if self._codec != "bf16" else 2 * smap.manifest.numel
            if size == payload.numel():
                return smap.manifest
        raise ConfigError(
            f"a payload of {payload.numel()} bytes matches no manifest joined through this sharded client; join first"
        )

    def pull(self, manifest: Manifest, worker_id: int = 0, buffer: torch.Tensor | None = None) -> Pulled:
        """Pull every shard (in parallel) at one version; the whole payload assembled.

        Raises:
            ServerUnavailableError: the shards' versions did not meet within ``rpc_timeout_s``.
            What ``ParameterServerClient.pull`` raises.
        """
        smap = self.shard_map(manifest)
        ids = self._ids_of(worker_id)
        pulled = self._on_all(lambda i, c: c.pull(smap.sub_manifest(i), ids[i]))
        deadline = time.monotonic() + self.rpc_timeout_s
        while len({p.version for p in pulled}) > 1:
            if time.monotonic() > deadline:
                raise ServerUnavailableError(
                    f"the shards' versions {[p.version for p in pulled]} did not meet within {self.rpc_timeout_s} s "
                    f"(a follower shard is behind shard 0); check the shards' logs, then pull again"
                )
            top = max(p.version for p in pulled)
            for i, p in enumerate(pulled):
                if p.version < top:
                    self._wait_for_version(i, top, deadline)
                    pulled[i] = self.clients[i].pull(smap.sub_manifest(i), ids[i])
        total = sum(p.payload.numel() for p in pulled)
        out = buffer if buffer is not None and buffer.numel() == total else torch.empty(total, dtype=torch.uint8)
        torch.cat([p.payload for p in pulled], out=out)
        return Pulled(pulled[0].version, out, pulled[0].run_config)

    def _wait_for_version(self, shard: int, version: int, deadline: float) -> None:
        """Until shard ``shard`` reports ``version`` (or the deadline): asked with the small
        Status call, 5 ms doubling to 100 ms between asks, so a follower a version behind is
        pulled once it has caught up instead of its whole part again every few milliseconds."""
        pause_s = 0.005
        while self.clients[shard].status().version < version and time.monotonic() < deadline:
            time.sleep(pause_s)
            pause_s = min(2 * pause_s, 0.1)

    def heartbeat(self, worker_id: int, steps_per_s: float = 0.0) -> pb.HeartbeatReply:
        """Renew the lease on every shard; shard 0's reply."""
        ids = self._ids_of(worker_id)
        return self._on_all(lambda i, c: c.heartbeat(ids[i], steps_per_s))[0]

    def leave(self, worker_id: int) -> None:
        ids = self._ids_of(worker_id)
        self._on_all(lambda i, c: c.leave(ids[i]))

    def status(self) -> pb.StatusReply:
        """Shard 0's status (its version is the run's)."""
        return self.clients[0].status()

    def statuses(self) -> list[pb.StatusReply]:
        """Every shard's status (in parallel), shard 0 first."""
        return self._on_all(lambda i, c: c.status())

    def combined_status(self, manifest: Manifest) -> pb.StatusReply:
        """The run's status across the shards: shard 0's (version, pushes, tokens, staleness,
        workers, evaluations: shard 0 sequences every push), with ``bytes_pushed`` and
        ``bytes_pulled`` summed over every shard and ``manifest`` (the whole model's, in
        place of shard 0's sub-manifest). ``pulls`` stays shard 0's: a pull reads every shard.
        """
        replies = self.statuses()
        out = pb.StatusReply()
        out.CopyFrom(replies[0])
        out.bytes_pushed = sum(r.bytes_pushed for r in replies)
        out.bytes_pulled = sum(r.bytes_pulled for r in replies)
        if replies[0].initialized:
            out.manifest.CopyFrom(manifest.to_proto())
        return out

    def report_eval(self, version: int, loss: float, num_tokens: int, evaluator: str = "") -> None:
        """Report a held-out loss of the whole global model to shard 0 (its status and dashboard)."""
        self.clients[0].report_eval(version, loss, num_tokens, evaluator)

    def close(self) -> None:
        for c in self.clients:
            c.close()
        self._pool.shutdown(wait=False)

    def __enter__(self) -> ShardedClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(config: WorkerConfig, mode: str) -> ParameterServerClient:
    """A worker's client: one server, or every shard of a sharded one (async mode).

    Raises:
        ConfigError: ``config.server`` lists several shards for a sync-mode worker.
    """
    addresses = shard_addresses(config.server)
    if len(addresses) == 1:
        return ParameterServerClient(
            addresses[0],
            rpc_timeout_s=config.rpc_timeout_s,
            timeout_s_per_mib=config.timeout_s_per_mib,
            security=config.security,
            bulk_channel=config.bulk_channel,
        )
    if mode != "async":
        raise ConfigError(
            f"server lists {len(addresses)} shards ({config.server!r}) but a sharded parameter server "
            f"runs async mode only; give one server address for --mode {mode}"
        )
    sharded = ShardedClient(
        addresses,
        rpc_timeout_s=config.rpc_timeout_s,
        timeout_s_per_mib=config.timeout_s_per_mib,
        security=config.security,
    )
    return cast(ParameterServerClient, sharded)  # the async worker's subset of its calls
