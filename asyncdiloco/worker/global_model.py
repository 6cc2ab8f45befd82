"""The live global model θ of a running server, loaded into an ``nn.Module``
(``load_global_model``): pulled as an observer (worker id 0, no Join, no lease), decoded
with the run's wire codec. docs/operations.md.
"""

from __future__ import annotations

import torch
from torch import nn

from asyncdiloco.errors import ManifestMismatchError, NotInitializedError
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.codec import codec_for
from asyncdiloco.wire.security import ClientSecurityConfig
from asyncdiloco.wire.tensors import Manifest
from asyncdiloco.worker.client import ParameterServerClient
from asyncdiloco.worker.flat import FlatParams
from asyncdiloco.worker.sharded import ShardedClient


def check_against_server(manifest: Manifest, client: ParameterServerClient | ShardedClient) -> None:
    """Check that the server holds a global model of ``manifest``'s layout (one Status call;
    a sharded server: one per shard, each against its part of the shard map, wire/shards.py).

    Raises:
        NotInitializedError: no worker has pushed initial parameters yet.
        ManifestMismatchError: the layouts differ; the message names the first difference.
        ServerUnavailableError, UnauthenticatedError: the server cannot be asked.
    """
    if isinstance(client, ShardedClient):
        smap = client.shard_map(manifest)
        for i, status in enumerate(client.statuses()):
            _check_status(smap.sub_manifest(i), status, f"{client.addresses[i]} (shard {i} of {client.num_shards})")
        return
    _check_status(manifest, client.status(), client.address)


def _check_status(manifest: Manifest, status: pb.StatusReply, where: str) -> None:
    if not status.initialized:
        raise NotInitializedError(
            f"the server at {where} has no global model yet: no worker has pushed its initial "
            f"parameters; start a worker, then try again"
        )
    diff = manifest.first_difference(Manifest.from_proto(status.manifest))
    if diff is not None:
        raise ManifestMismatchError(
            f"the module does not match the global model of the server at {where}: {diff} "
            f"('the worker' is the module given here); build the model the workers train, with the same "
            f"shapes and dtypes"
        )


def pull_into(client: ParameterServerClient | ShardedClient, model: nn.Module, manifest: Manifest | None = None) -> int:
    """Pull the newest global θ into ``model``'s parameters (cast to each one's dtype
    and device); the layout is checked first (``check_against_server``).

    Args:
        client: a client of the server (it pulls with worker id 0, as an observer); a
            ``ShardedClient`` assembles θ from every shard at one version.
        model: the module; its ``named_parameters()`` order is the manifest's.
        manifest: ``Manifest.from_module(model)``, when the caller has it already.
    Returns:
        The global version loaded.
    Raises:
        NotInitializedError, ManifestMismatchError (see ``check_against_server``),
        InvalidPayloadError (a corrupt pull), ServerUnavailableError.
    """
    manifest = manifest if manifest is not None else Manifest.from_module(model)
    check_against_server(manifest, client)
    pulled = client.pull(manifest)
    flat = codec_for(pulled.run_config, manifest).decode(pulled.payload, torch.empty(manifest.numel))  # (N,) fp32
    FlatParams(model).load(flat)
    return pulled.version


def load_global_model(
    model: nn.Module, server: str, *, security: ClientSecurityConfig | None = None, timeout_s: float = 60.0
) -> int:
    """Load the live global model of the server at ``server`` into ``model``.

    Example::

        model = MyModel()
        version = asyncdiloco.load_global_model(model, "ps-host:29500")

    Args:
        model: a module of the architecture the workers train (same parameter names,
            shapes and dtypes, in the same order); its parameters are overwritten.
        server: "HOST:PORT" of the parameter server.
        security: the token file and TLS settings, as a worker's (None: plaintext, no token).
        timeout_s: deadline of the pull, seconds (plus one per MiB of the model).
    Returns:
        The global version loaded (pseudo-gradients applied; rounds in sync mode).
    Raises:
        ManifestMismatchError: ``model`` differs from the server's model (the message
        names the first difference). NotInitializedError: the server has no model yet.
        ServerUnavailableError: the server cannot be reached. UnauthenticatedError: a
        wrong or missing token. ConfigError: a token or PEM file cannot be read.
    """
    with ParameterServerClient(server, rpc_timeout_s=timeout_s, security=security) as client:
        return pull_into(client, model)
