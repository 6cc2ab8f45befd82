"""The shard map: which contiguous element range of the flat parameter vector θ each
parameter-server shard owns, balanced by wire bytes, small tensors kept whole and a
split tensor's piece named ``"name#a:b"``. A pure function of the manifest and S, so
workers compute it themselves (parameter sharding as in Li et al. 2014, "Scaling
distributed machine learning with the parameter server", OSDI, Sec. 3-4; element ranges
as in Streaming DiLoCo's fragments, arXiv 2501.18512, Sec. 2.2); docs/architecture.md
"A sharded parameter server".
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from asyncdiloco.errors import ConfigError
from asyncdiloco.wire.tensors import Manifest, TensorSpec

#: A tensor holding at most this fraction of one shard's byte share is never split.
SMALL_FRACTION = 0.5


@dataclasses.dataclass(frozen=True)
class ShardMap:
    """S contiguous element ranges of the flat parameter vector, one per shard.

    Attributes:
        manifest: the whole model's manifest.
        bounds: S + 1 flat element offsets, ``bounds[0] == 0``, ``bounds[S] == numel``;
            shard i owns elements ``bounds[i]:bounds[i + 1]`` of θ (N,) float32.
    """

    manifest: Manifest
    bounds: tuple[int, ...]

    @classmethod
    def balance(cls, manifest: Manifest, num_shards: int) -> ShardMap:
        """The byte-balanced map of ``manifest`` over ``num_shards`` shards (module docstring).

        Raises:
            ConfigError: ``num_shards`` < 1, or more shards than parameter elements.
        """
        if num_shards < 1:
            raise ConfigError(f"num_shards is {num_shards}; it must be >= 1 (1 = one unsharded server)")
        if num_shards > manifest.numel:
            raise ConfigError(
                f"num_shards is {num_shards} but the model has only {manifest.numel} parameter elements; "
                f"use at most {manifest.numel} shards"
            )
        total = manifest.total_bytes
        share = total / num_shards
        # per tensor: (first element, first byte, spec)
        starts: list[tuple[int, int, TensorSpec]] = []
        elem = byte = 0
        for spec in manifest.tensors:
            starts.append((elem, byte, spec))
            elem, byte = elem + spec.numel, byte + spec.nbytes
        bounds = [0]
        for k in range(1, num_shards):
            target = k * share
            cut = _cut_near(starts, target, share)
            cut = max(cut, bounds[-1] + 1)  # every shard owns at least one element
            cut = min(cut, manifest.numel - (num_shards - k))
            bounds.append(cut)
        bounds.append(manifest.numel)
        return cls(manifest, tuple(bounds))

    @property
    def num_shards(self) -> int:
        return len(self.bounds) - 1

    def range_of(self, shard: int) -> tuple[int, int]:
        """Shard ``shard``'s flat element range [start, stop)."""
        return self.bounds[shard], self.bounds[shard + 1]

    def sub_manifest(self, shard: int) -> Manifest:
        """The manifest shard ``shard`` serves: its whole tensors, and ``"name#a:b"`` (shape (b − a,))
        for each piece of a split tensor (module docstring)."""
        lo, hi = self.range_of(shard)
        specs: list[TensorSpec] = []
        elem = 0
        for spec in self.manifest.tensors:
            a, b = max(lo, elem), min(hi, elem + spec.numel)
            if a < b:
                if a == elem and b == elem + spec.numel:
                    specs.append(spec)
                else:
                    specs.append(TensorSpec(f"{spec.name}#{a - elem}:{b - elem}", (b - a,), spec.dtype))
            elem += spec.numel
        return Manifest(tuple(specs))

    def split_flat(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``flat`` (float32 (N,)) per shard: float32 (bounds[i+1] − bounds[i],)."""
        if flat.dim() != 1 or flat.numel() != self.manifest.numel:
            raise ValueError(f"flat vector has shape {tuple(flat.shape)}; the shard map needs ({self.manifest.numel},)")
        return [flat[lo:hi] for lo, hi in zip(self.bounds, self.bounds[1:])]

    def sizes_bytes(self) -> list[int]:
        """Each shard's payload bytes (``sub_manifest(i).total_bytes``)."""
        return [self.sub_manifest(i).total_bytes for i in range(self.num_shards)]


def _cut_near(starts: list[tuple[int, int, TensorSpec]], target: float, share: float) -> int:
    """The flat element offset of a boundary near byte ``target`` (module docstring)."""
    for first_elem, first_byte, spec in starts:
        end_byte = first_byte + spec.nbytes
        if target >= end_byte:
            continue
        if spec.nbytes <= SMALL_FRACTION * share:  # a small tensor stays whole: its nearer edge
            return first_elem if target - first_byte <= end_byte - target else first_elem + spec.numel
        item = spec.nbytes // max(1, spec.numel)
        return first_elem + int((target - first_byte) // item)
    last_elem, _, last = starts[-1]
    return last_elem + last.numel


def load_shard_addresses(path: str | Path) -> list[str]:
    """The shard addresses of a shard-map file ``{"shards": ["host:port", ...]}``, shard 0 first.

    Raises:
        ConfigError: the file cannot be read, is not that JSON shape, or lists no shard.
    """
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f'shard map {str(path)!r} cannot be read as JSON ({exc}); write {{"shards": [...]}}') from exc
    shards = data.get("shards") if isinstance(data, dict) else None
    if not isinstance(shards, list) or not shards or not all(isinstance(a, str) and ":" in a for a in shards):
        raise ConfigError(
            f'shard map {str(path)!r} must be {{"shards": ["host:port", ...]}} with at least one address, '
            f"shard 0 first; got {data!r:.200}"
        )
    return list(shards)


def write_shard_addresses(path: str | Path, addresses: list[str]) -> None:
    """Write a shard-map file (see ``load_shard_addresses``)."""
    Path(path).write_text(json.dumps({"shards": list(addresses)}, indent=1) + "\n")
