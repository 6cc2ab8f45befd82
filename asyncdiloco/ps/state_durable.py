"""Durability's part of the parameter server's state (``ParameterServerState`` inherits it):
a consistent copy of the state for checkpoints, its restore, and the replay of logged
Joins and pushes at start-up (store.py writes and reads them).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from asyncdiloco.algo.outer import make_outer_optimizer
from asyncdiloco.algo.schedule import StepRateMeter
from asyncdiloco.errors import (
    CheckpointError,
)
from asyncdiloco.ps.records import PushOutcome, WorkerRecord
from asyncdiloco.ps.store import manifest_from_json, manifest_to_json
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.tensors import Manifest

log = logging.getLogger(__name__)


class DurableState:
    """Methods of ``ParameterServerState`` for checkpoints and log replay (uses its locks
    and fields)."""

    def state_dict(self, while_locked: Callable[[], int] | None = None) -> tuple[dict, dict[str, torch.Tensor], int]:
        """A consistent copy of the durable state, for a checkpoint (store.py).

        Args:
            while_locked: called under the lock at the moment of the copy (the store
                starts a new log segment there); its result is returned.
        Returns:
            (meta, tensors, result): ``meta`` is JSON-serializable (version, manifest,
            worker table with the applied push ids and outcomes, counters);
            ``tensors`` maps ``"param/<name>"`` and ``"momentum/<name>"`` to fp32 CPU
            tensors of the parameter's shape (keyed by name, never by position).
        """
        with self._apply_lock, self._lock:
            result = while_locked() if while_locked is not None else 0
            tensors: dict[str, torch.Tensor] = {}
            if self.params is not None:
                vectors = {"param": self.params, **self._outer_buffers()}
                pos = 0
                for spec in self.manifest.tensors:
                    for kind, vec in vectors.items():
                        tensors[f"{kind}/{spec.name}"] = vec[pos : pos + spec.numel].clone().view(spec.shape)
                    pos += spec.numel
            meta = {
                "outer_arrivals": getattr(self.outer, "arrivals", 0),
                "version": self.version,
                "initialized": self.initialized,
                "manifest": manifest_to_json(self.manifest) if self.manifest is not None else None,
                "next_worker_id": self._next_worker_id,
                "initializer": self._initializer,
                "counters": {
                    "applied_pushes": self.applied_pushes,
                    "rejected_pushes": self.rejected_pushes,
                    "duplicate_pushes": self.duplicate_pushes,
                    "bytes_pushed": self.bytes_pushed,
                    "bytes_pulled": self.bytes_pulled,
                    "pulls": self.pulls,
                    "tokens": self.tokens,
                },
                "staleness_histogram": list(self.staleness_histogram),
                "workers": [
                    {
                        "worker_id": r.worker_id,
                        "name": r.name,
                        "alive": r.alive,
                        "applied_pushes": r.applied_pushes,
                        "rejected_pushes": r.rejected_pushes,
                        "tokens": r.tokens,
                        "local_steps": r.local_steps,
                        "outcomes": [
                            [pid, o.applied, o.version, o.staleness, o.staleness_weight, o.local_steps]
                            for pid, o in r.outcomes.items()
                        ],
                    }
                    for r in self._workers.values()
                ],
            }
        return meta, tensors, result

    def _outer_buffers(self) -> dict[str, torch.Tensor]:
        """The outer optimizer's state vectors: m (``momentum``) and, for Delayed
        Nesterov, the arrival buffer b (``dn_delta``); flat fp32 (N,) each."""
        out = {}
        for kind, attr in (("momentum", "momentum_buffer"), ("dn_delta", "delta_buffer")):
            vec = getattr(self.outer, attr, None)
            if vec is not None:
                out[kind] = vec
        return out

    def load_state_dict(self, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
        """Restore a fresh state from a checkpoint's ``state_dict``. Workers that were
        registered come back with a full lease, so they resume under their old ids;
        those that had left or expired stay gone (they rejoin, as before the restart).

        Raises:
            CheckpointError: the tensors do not match the stored manifest, or the
            momentum does not match the configured outer optimizer.
        """
        with self._apply_lock, self._lock:
            now = self._clock()
            self.manifest = manifest_from_json(meta["manifest"]) if meta["manifest"] is not None else None
            if meta["initialized"]:
                flat = self._named_to_flat(tensors, "param")
                self.params = flat
                self.outer = make_outer_optimizer(self.params, self.config.outer, self.manifest.block_sizes())
                buffers = self._outer_buffers()
                for kind, vec in buffers.items():
                    vec.copy_(self._named_to_flat(tensors, kind))
                extra = {k.split("/", 1)[0] for k in tensors} - {"param", *buffers}
                if extra:
                    raise CheckpointError(
                        f"checkpoint holds outer-optimizer state {sorted(extra)} that the configured "
                        f"{self.config.outer.optimizer} (momentum {self.config.outer.momentum:g}) does not use; "
                        f"restart with the checkpoint's outer-optimizer settings"
                    )
                if hasattr(self.outer, "arrivals"):
                    self.outer.arrivals = int(meta.get("outer_arrivals", 0))
            self.version = meta["version"]
            self._next_worker_id = meta["next_worker_id"]
            self._initializer = meta["initializer"]
            for key, value in meta["counters"].items():
                setattr(self, key, value)
            hist = meta["staleness_histogram"]
            self.staleness_histogram = (hist + [0] * len(self.staleness_histogram))[: len(self.staleness_histogram)]
            self._workers = {}
            self._rates = StepRateMeter()
            for w in meta["workers"]:
                rec = WorkerRecord(
                    w["worker_id"],
                    w["name"],
                    now,
                    now,
                    w["alive"],
                    w["applied_pushes"],
                    w["rejected_pushes"],
                    w["tokens"],
                    w["local_steps"],
                )
                for pid, applied, version, tau, weight, steps in w["outcomes"]:
                    rec.outcomes[pid] = PushOutcome(applied, False, version, tau, weight, steps)
                self._workers[rec.worker_id] = rec
                self._rates.start(rec.worker_id, now)
            self._snapshots.clear()

    def _named_to_flat(self, tensors: dict[str, torch.Tensor], kind: str) -> torch.Tensor:
        """Concatenate ``"<kind>/<name>"`` tensors in manifest order (looked up by name)."""
        parts = []
        for spec in self.manifest.tensors:
            key = f"{kind}/{spec.name}"
            t = tensors.get(key)
            if t is None or t.dtype != torch.float32 or tuple(t.shape) != spec.shape:
                raise CheckpointError(
                    f"checkpoint tensor {key!r} is {'missing' if t is None else f'{t.dtype} {tuple(t.shape)}'}; "
                    f"the manifest says float32 {spec.shape}: the checkpoint is inconsistent (or was written "
                    f"with other outer-optimizer settings); restart with its settings or restore an older one"
                )
            parts.append(t.reshape(-1))
        return torch.cat(parts) if parts else torch.zeros(0)

    def replay_join(self, worker_id: int, name: str, initialize: bool, manifest: Manifest | None) -> None:
        """Redo a logged Join (start-up replay)."""
        with self._lock:
            now = self._clock()
            self._register_locked(worker_id, name, initialize, manifest, now)

    def replay_push(
        self,
        header: pb.PushHeader,
        payload: torch.Tensor,
        tau: int,
        weight: float,
        version_after: int,
        num_workers: int,
    ) -> None:
        """Redo a logged push with the τ and s(τ) it was applied with (start-up replay).

        Raises:
            CheckpointError: the log does not follow the state (unknown worker, or the
            version it produced does not follow).
        """
        delta = self._decode_logged(header, payload) if self.manifest is not None else None
        with self._apply_lock, self._lock:
            rec = self._workers.get(header.worker_id)
            initial = header.kind == pb.PUSH_KIND_INITIAL_PARAMETERS
            expected = self.version if initial else self.version + 1
            if rec is None or delta is None or expected != version_after or initial == self.initialized:
                raise CheckpointError(
                    f"write-ahead log push {header.push_id} of worker {header.worker_id} (version {version_after}) "
                    f"does not follow the checkpoint (version {self.version}); the log belongs to another run: "
                    f"restore the folder from a backup"
                )
            self._apply_delta(header, delta, weight, num_workers, version_after)  # the logged version keys η
            self._record_push_locked(rec, header, tau, weight)
            self._snapshots.clear()

    def _decode_logged(self, header: pb.PushHeader, payload: torch.Tensor) -> torch.Tensor:
        """A logged push's payload as fp32 (N,): pseudo-gradients with the run's codec.

        Raises:
            CheckpointError: the payload's size does not fit this run's codec.
        """
        codec = self._wire_codec() if header.kind == pb.PUSH_KIND_PSEUDO_GRADIENT else None
        expected = codec.wire_bytes if codec is not None else self.manifest.total_bytes
        if payload.numel() != expected:
            raise CheckpointError(
                f"write-ahead log push {header.push_id} of worker {header.worker_id} holds {payload.numel()} bytes; "
                f"this server's wire codec {self.config.wire_codec} expects {expected}: restart with the codec "
                f"the log was written with, or restore the folder from a backup"
            )
        if codec is None or self.config.wire_codec == "raw":
            return self.manifest.unpack_flat(payload)
        return codec.decode(payload, torch.empty(codec.numel, dtype=torch.float32))
