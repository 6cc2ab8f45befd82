"""Copies between a model's parameters and flat fp32 vectors, and the host buffers they use
(pinned on CUDA; docs/worker.md, "Host copies").
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def host_buffer(numel: int, *, dtype: torch.dtype = torch.float32, pin: bool = False) -> torch.Tensor:
    """A zeroed CPU tensor of ``numel`` elements of ``dtype``, in pinned memory when ``pin``."""
    return torch.zeros(numel, dtype=dtype, pin_memory=pin)


def synchronize(devices: Iterable[torch.device]) -> None:
    """Wait until every CUDA device in ``devices`` has finished its queued work (copies
    included); CPU devices need no wait."""
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


class FlatParams:
    """A model's parameters seen as one flat fp32 vector (N,), in manifest order.

    Args:
        model: the module whose ``named_parameters()`` order is the manifest's.
    """

    def __init__(self, model: nn.Module) -> None:
        self.params = [p for _, p in model.named_parameters()]
        #: Elements per parameter, manifest order.
        self.sizes = [p.numel() for p in self.params]
        #: N, elements of the whole flat vector.
        self.numel = sum(self.sizes)
        #: The devices the parameters live on, in order of first appearance.
        self.devices = list(dict.fromkeys(p.device for p in self.params))
        #: ``load`` and ``add`` calls so far: a group's rank 0 sees whether a sync changed the model.
        self.writes = 0

    @property
    def on_cuda(self) -> bool:
        """Some parameter lives on CUDA: host buffers are pinned, copies are asynchronous."""
        return any(d.type == "cuda" for d in self.devices)

    @property
    def device(self) -> torch.device:
        """Where a device-side buffer for this model goes (sync mode's NCCL allreduce): the
        first CUDA device of the parameters, else the CPU."""
        return next((d for d in self.devices if d.type == "cuda"), torch.device("cpu"))

    def host_buffer(self, numel: int | None = None, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A CPU buffer for copies of this model: ``numel`` (default N) elements of ``dtype``,
        pinned when the model is on CUDA."""
        return host_buffer(self.numel if numel is None else numel, dtype=dtype, pin=self.on_cuda)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter 1-D views of ``flat`` (N,), manifest order (no copy)."""
        return list(torch.split(flat[: self.numel], self.sizes))

    def copy_into(self, dst: torch.Tensor) -> torch.Tensor:
        """θ_local → ``dst``: the parameters, as fp32, into the flat CPU vector ``dst`` (N,).

        Returns:
            ``dst``, complete: asynchronous copies into a pinned ``dst`` are waited for.
        """
        asynchronous = self.on_cuda and dst.is_pinned()  # into pageable memory CUDA copies synchronously
        with torch.no_grad():
            for p, view in zip(self.params, self.views(dst)):
                view.copy_(p.detach().reshape(-1), non_blocking=asynchronous and p.is_cuda)
        if asynchronous:
            self._wait()
        return dst

    def load(self, flat: torch.Tensor) -> None:
        """θ_local ← ``flat``: copy the flat fp32 CPU vector (N,) into the parameters
        (cast to each parameter's dtype and device)."""
        self.writes += 1
        with torch.no_grad():
            for p, view in zip(self.params, self.views(flat)):
                p.copy_(view.view(p.shape), non_blocking=p.is_cuda)
        self._wait()

    def add(self, flat: torch.Tensor) -> None:
        """θ_local ← θ_local + ``flat``, for a flat fp32 CPU vector (N,) (pinned when the
        model is on CUDA), parameter by parameter."""
        self.writes += 1
        with torch.no_grad():
            for p, view in zip(self.params, self.views(flat)):
                p.add_(view.view(p.shape).to(p.device, non_blocking=p.is_cuda))
        self._wait()

    def _wait(self) -> None:
        """Wait for the asynchronous copies on the parameters' devices: the host buffer may
        be read (device → host) or reused (host → device) next."""
        if self.on_cuda:
            synchronize(self.devices)
