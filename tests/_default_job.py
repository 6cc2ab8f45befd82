"""An in-process server holding the default job's model, driven by raw pushes: what the
tests of the tools (status, eval, export) look at."""

from __future__ import annotations

import torch
from helpers import load

from asyncdiloco.job.config import JobConfig
from asyncdiloco.job.dataset import CharCorpus
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.tensors import Manifest
from asyncdiloco.worker.client import ParameterServerClient


def default_model(job: JobConfig | None = None) -> torch.nn.Module:
    """The default job's model from its seed: the server's version 0."""
    return (job or JobConfig()).build(CharCorpus.default())


class DefaultJobRun:
    """Workers of the default job against the server at ``address``: joins, the initial
    push and small random pseudo-gradients, each push with the next push id."""

    def __init__(self, address: str) -> None:
        self.client = ParameterServerClient(address)
        self.model = default_model()
        self.manifest = Manifest.from_module(self.model)
        self.push_ids: dict[int, int] = {}
        self.rates: dict[int, float] = {}  # worker id -> its inner steps per second (0: not said)

    def join(self, name: str, steps_per_s: float = 0.0) -> int:
        reply = self.client.join(self.manifest, name, steps_per_s=steps_per_s)
        self.push_ids[reply.worker_id] = 0
        self.rates[reply.worker_id] = steps_per_s
        if reply.initialize:
            self._push(reply.worker_id, list(self.model.parameters()), pb.PUSH_KIND_INITIAL_PARAMETERS, 0)
        return reply.worker_id

    def push(self, worker_id: int, seed: int, scale: float = 1e-2) -> pb.PushReply:
        """One pseudo-gradient Δ ~ scale·N(0, 1) from the newest version."""
        gen = torch.Generator().manual_seed(seed)
        delta = [scale * torch.randn(t.shape, generator=gen) for t in self.manifest.tensors]
        return self._push(worker_id, delta, pb.PUSH_KIND_PSEUDO_GRADIENT, self.client.status().version)

    def _push(self, worker_id: int, tensors: list, kind: int, base_version: int) -> pb.PushReply:
        self.push_ids[worker_id] += 1
        rate = self.rates[worker_id]
        return self.client.push(
            self.manifest.pack([t.detach() for t in tensors]),
            worker_id=worker_id,
            push_id=self.push_ids[worker_id],
            base_version=base_version,
            num_local_steps=20,
            num_tokens=20 * 32 * 64,
            kind=kind,
            compute_s=20 / rate if rate else 0.0,
        )

    def close(self) -> None:
        self.client.close()


def model_with(params: torch.Tensor, job: JobConfig | None = None) -> torch.nn.Module:
    """The default job's model holding the flat fp32 θ ``params`` (N,)."""
    model = default_model(job)
    load(model, params)
    return model
