"""The durable part of the state: a consistent copy for checkpoints (tensors ``param/<name>``,
``momentum/<name>``, ``dn_delta/<name>``, fp32), its restore, and the replay of logged
pushes with the τ, s(τ) and N they were applied with, so θ and the outer optimizer come
back bit for bit (store.py writes and reads them). docs/operations.md, "Checkpoints,
and what a crash loses".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

import torch

from asyncdiloco.algo.outer import DelayedNesterov, make_outer_optimizer
from asyncdiloco.errors import CheckpointError
from asyncdiloco.ps.books import AppliedAs, Journal, LoggedJoin, StateDict
from asyncdiloco.ps.core import CoreParts
from asyncdiloco.ps.durable.wal import manifest_from_json, manifest_to_json
from asyncdiloco.ps.pull.snapshots import Snapshots
from asyncdiloco.ps.push.intake import PushKind
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.tensors import Manifest

#: Where the way to carry a checkpoint over to a changed model on purpose is written.
CONVERT_DOC = 'docs/operations.md, "Converting a checkpoint on purpose"'


def check_checkpoint_tensors(
    tensors: Mapping[str, torch.Tensor], manifest: Manifest, kinds: tuple[str, ...], source: str
) -> None:
    """Refuse a checkpoint whose tensors are not exactly the model's: for each of ``kinds``
    (``param`` and the outer optimizer's vectors) one float32 ``"<kind>/<name>"`` of each
    manifest tensor's shape, and nothing else; ``source`` names the file in the message.

    Raises:
        CheckpointError: naming every extra, missing, reshaped and re-typed tensor, and
            the documented way to convert a checkpoint (``CONVERT_DOC``).
    """
    expected = {f"{kind}/{spec.name}": spec.shape for kind in kinds for spec in manifest.tensors}
    extra = [k for k in tensors if k not in expected]
    missing = [k for k in expected if k not in tensors]
    reshaped = [k for k, shape in expected.items() if k in tensors and tuple(tensors[k].shape) != shape]
    retyped = [k for k in expected if k in tensors and tensors[k].dtype != torch.float32]
    if not (extra or missing or reshaped or retyped):
        return
    problems = []
    if extra:
        names = ", ".join(f"{k!r} ({_described(tensors[k])})" for k in extra)
        other = sorted({k.split("/", 1)[0] for k in extra} - {"param", *kinds})
        why = f"; {other} is another outer optimizer's state: restart with the checkpoint's settings" if other else ""
        problems.append(f"extra {names}: the model has no such tensor{why}")
    if missing:
        names = ", ".join(f"{k!r} (float32 {expected[k]})" for k in missing)
        problems.append(f"missing {names}")
    if reshaped:
        names = ", ".join(f"{k!r} is {tuple(tensors[k].shape)} where the model's is {expected[k]}" for k in reshaped)
        problems.append(f"reshaped: {names}")
    if retyped:
        names = ", ".join(f"{k!r} is {tensors[k].dtype} where the model's is torch.float32" for k in retyped)
        problems.append(f"re-typed: {names}")
    raise CheckpointError(
        f"{source} do not match the model of the checkpoint's manifest ({len(manifest.tensors)} tensors) and "
        f"the configured outer optimizer ({', '.join(kinds)}): {'; '.join(problems)}. A checkpoint restores only "
        f"the model it was written for; to carry it over to a changed model on purpose, export it "
        f"(asyncdiloco export), convert the parameters and start a fresh --checkpoint-dir from them "
        f"({CONVERT_DOC}); or restore the folder from a backup"
    )


def _described(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}"


class DurableRounds(Protocol):
    """Sync mode's round state around the model (sync/rounds.py ``SyncRounds``)."""

    def to_meta(self) -> dict:
        """The rounds' part of a checkpoint (called with the state's locks held)."""

    def load_meta(self, meta: dict | None) -> None:
        """Take a checkpoint's part (both locks held)."""

    def resume(self) -> None:
        """The restore so far is done: go on at the restored version (no lock held)."""


class Durability:
    """Checkpoint copies, restores and log replay of the state's parts (see the module docstring).

    Args:
        parts: the core parts (copied and restored; the journal is attached here).
        snapshots: the pull snapshots (cleared when θ is replaced).
        replayers: the push kinds a logged push is redone with, by ``pb.PUSH_KIND_*``.
        rounds: sync mode's round state (None in async mode).
    """

    def __init__(
        self,
        parts: CoreParts,
        snapshots: Snapshots,
        replayers: Mapping[int, PushKind],
        rounds: DurableRounds | None = None,
    ) -> None:
        self.locks = parts.locks
        self.model = parts.model
        self.registry = parts.registry
        self.counters = parts.counters
        self.journal = parts.journal
        self.clock = parts.clock
        self.snapshots = snapshots
        self.replayers = replayers
        self.rounds = rounds

    @property
    def version(self) -> int:
        """The global version (what the store checkpoints at)."""
        return self.model.version

    def replay_join(self, join: LoggedJoin) -> None:
        """Redo a logged Join (start-up replay): a resumed one keeps the record's counters
        and outcomes; ``join.seen_unix_s`` (wall clock) dates it."""
        with self.locks.books:
            self.registry.replay_join(join)

    def replay_seen(self, worker_id: int, seen_unix_s: float) -> None:
        """A logged push shows the worker alive at ``seen_unix_s`` (wall clock)."""
        with self.locks.books:
            self.registry.replay_seen(worker_id, seen_unix_s)

    def attach_journal(self, journal: Journal) -> None:
        """Log every Join and push into ``journal`` from now on."""
        with self.locks.books:
            self.journal.journal = journal

    def detach_journal(self, then: Callable[[], None] | None = None) -> None:
        """Stop logging; ``then`` runs under the books lock, so no append interleaves with it."""
        with self.locks.books:
            self.journal.journal = None
            if then is not None:
                then()

    def state_dict(self, while_locked: Callable[[], int] | None = None) -> StateDict:
        """A consistent copy of the durable state, for a checkpoint (store.py).

        Args:
            while_locked: called under both locks at the moment of the copy (the store
                starts a new log segment there); its result is returned.
        Returns:
            (meta, tensors, result): ``meta`` is JSON-serializable (version, manifest,
            worker table with the applied push ids and outcomes, counters);
            ``tensors`` maps ``"param/<name>"`` and ``"momentum/<name>"`` (and
            ``"dn_delta/<name>"``) to fp32 CPU tensors of the parameter's shape.
        """
        model, registry = self.model, self.registry
        with self.locks.apply, self.locks.books:
            result = while_locked() if while_locked is not None else 0
            meta = {
                "outer_arrivals": getattr(model.outer, "arrivals", 0),
                "outer_last_n": getattr(model.outer, "last_n", 0),
                "version": model.version,
                "initialized": model.initialized,
                "manifest": manifest_to_json(model.manifest) if model.manifest is not None else None,
                "next_worker_id": registry.next_worker_id,
                "initializer": registry.initializer,
                "counters": self.counters.to_meta(),
                "staleness_histogram": list(self.counters.staleness_histogram),
                "workers": registry.to_meta(),
            }
            if self.rounds is not None:
                meta["sync"] = self.rounds.to_meta()
            return meta, self._named_tensors(), result

    def _named_tensors(self) -> dict[str, torch.Tensor]:
        """θ and the outer optimizer's vectors, cut per parameter and cloned (apply lock held)."""
        tensors: dict[str, torch.Tensor] = {}
        if self.model.params is None:
            return tensors
        vectors = {"param": self.model.params, **self.model.outer_buffers()}
        pos = 0
        for spec in self.model.known_manifest.tensors:
            for kind, vec in vectors.items():
                tensors[f"{kind}/{spec.name}"] = vec[pos : pos + spec.numel].clone().view(spec.shape)
            pos += spec.numel
        return tensors

    def load_state_dict(self, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
        """Restore a fresh state from a checkpoint's ``state_dict``. Workers that were
        registered keep the rest of their lease (counted on the wall clock from their
        last contact; a full one for checkpoints that do not say), so they resume under
        their old ids; those that had left, expired, or were silent for longer than the
        lease by now stay gone (they rejoin under their name and get their id back).

        Raises:
            CheckpointError: the tensors do not match the model (``check_checkpoint_tensors``:
            extra, missing, reshaped or re-typed ones, each named).
        """
        model = self.model
        with self.locks.apply, self.locks.books:
            now = self.clock()
            model.manifest = manifest_from_json(meta["manifest"]) if meta["manifest"] is not None else None
            if meta["initialized"]:
                source = f"checkpoint tensors {meta.get('tensor_file', '(unnamed)')}"
                self._load_tensors(tensors, meta["outer_arrivals"], source, meta["outer_last_n"])
            model.version = meta["version"]
            self.counters.load_meta(meta["counters"], meta["staleness_histogram"])
            self.registry.load_meta(meta["workers"], meta["next_worker_id"], meta["initializer"], now)
            if self.rounds is not None:
                self.rounds.load_meta(meta.get("sync"))  # None: an async server's checkpoint
            self.snapshots.clear()
        if self.rounds is not None:
            self.rounds.resume()

    def _load_tensors(self, tensors: dict[str, torch.Tensor], arrivals: int, source: str, last_n: int = 0) -> None:
        model = self.model
        manifest = model.known_manifest
        model.params = torch.zeros(manifest.numel)  # filled below, once the tensors are checked
        model.outer = make_outer_optimizer(model.params, model.config.outer, manifest.block_sizes())
        buffers = model.outer_buffers()
        check_checkpoint_tensors(tensors, manifest, ("param", *buffers), source)
        model.params.copy_(self._named_to_flat(tensors, "param"))
        for kind, vec in buffers.items():
            vec.copy_(self._named_to_flat(tensors, kind))
        if isinstance(model.outer, DelayedNesterov):
            model.outer.arrivals = arrivals
            model.outer.last_n = last_n  # N for closing pushes (outer.py ``closing_workers``)

    def _named_to_flat(self, tensors: dict[str, torch.Tensor], kind: str) -> torch.Tensor:
        """Concatenate ``"<kind>/<name>"`` tensors in manifest order (checked beforehand)."""
        parts = [tensors[f"{kind}/{spec.name}"].reshape(-1) for spec in self.model.known_manifest.tensors]
        return torch.cat(parts) if parts else torch.zeros(0)

    def replay_push(self, header: pb.PushHeader, payload: torch.Tensor, applied: AppliedAs) -> None:
        """Redo a logged push with the τ and s(τ) it was applied with (start-up replay).

        Raises:
            CheckpointError: the log does not follow the state (unknown worker, or the
            version it produced does not follow), or its payload does not fit the codec.
        """
        model = self.model
        initial = header.kind == pb.PUSH_KIND_INITIAL_PARAMETERS
        delta = self._decode_logged(header, payload) if model.manifest is not None else None
        with self.locks.apply, self.locks.books:
            rec = self.registry.workers.get(header.worker_id)
            expected = model.version if initial else model.version + 1
            if rec is None or delta is None or expected != applied.version_after or initial == model.initialized:
                raise CheckpointError(
                    f"write-ahead log push {header.push_id} of worker {header.worker_id} "
                    f"(version {applied.version_after}) does not follow the checkpoint (version {model.version}); "
                    f"the log belongs to another run: restore the folder from a backup"
                )
            kind = self.replayers.get(header.kind)
            if kind is None:
                raise CheckpointError(
                    f"write-ahead log push {header.push_id} of worker {header.worker_id} is a "
                    f"{pb.PushKind.Name(header.kind)} record, which this server's mode does not replay: the folder "
                    f"was written by a server in the other --mode; restart with that mode"
                )
            self.snapshots.clear()  # before θ changes: a pull reading it in place finishes from a copy
            kind.replay(rec, header, delta, applied)
        if self.rounds is not None and header.kind == pb.PUSH_KIND_ROUND_RESULT:
            self.rounds.resume()

    def _decode_logged(self, header: pb.PushHeader, payload: torch.Tensor) -> torch.Tensor:
        """A logged push's payload as fp32 (N,): pseudo-gradients with the run's codec.

        Raises:
            CheckpointError: the payload's size does not fit this run's codec.
        """
        model, wire_codec = self.model, self.model.config.wire_codec
        manifest = model.known_manifest
        if header.kind == pb.PUSH_KIND_ROUND_RESULT:  # Δ̄, float32 (N,) whatever the dtypes
            if payload.numel() != manifest.numel * 4:
                raise CheckpointError(
                    f"write-ahead log round of quorum {header.push_id} holds {payload.numel()} bytes; the model's "
                    f"round result has {manifest.numel * 4}: the log belongs to another run: restore the folder "
                    f"from a backup"
                )
            return payload.view(torch.float32)
        codec = model.wire_codec() if header.kind == pb.PUSH_KIND_PSEUDO_GRADIENT else None
        expected = codec.wire_bytes if codec is not None else manifest.total_bytes
        if payload.numel() != expected:
            raise CheckpointError(
                f"write-ahead log push {header.push_id} of worker {header.worker_id} holds {payload.numel()} bytes; "
                f"this server's wire codec {wire_codec} expects {expected}: restart with the codec "
                f"the log was written with, or restore the folder from a backup"
            )
        if codec is None or wire_codec == "raw":
            return manifest.unpack_flat(payload)
        return codec.decode(payload, torch.empty(codec.numel, dtype=torch.float32))
