"""``asyncdiloco server``'s sharded modes: ``--shards S`` (S shards in this process, the
manifest ``ROOT/shards.json`` rewritten every ``MANIFEST_EVERY_S``) and ``--shard-index i
--shard-map FILE`` (one shard per host); docs/operations.md "A sharded server".
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from asyncdiloco._atomic import write_atomically
from asyncdiloco.errors import ConfigError
from asyncdiloco.ps.config import DurabilityConfig, ServerConfig

if TYPE_CHECKING:
    from asyncdiloco.ps import ParameterServer

#: Seconds between two writes of ``ROOT/shards.json`` while serving.
MANIFEST_EVERY_S = 10.0


def add_shard_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sharding (async mode)")
    g.add_argument(
        "--shards",
        type=int,
        default=1,
        metavar="S",
        help="split the parameter vector over S shards served by this process on consecutive ports from "
        "--port (or --shard-ports); shard 0 sequences every push (default %(default)s: one unsharded server)",
    )
    g.add_argument(
        "--shard-ports",
        default="",
        metavar="P,P,...",
        help="with --shards S: the S ports, shard 0 first (default: --port + i; --port 0: free ports)",
    )
    g.add_argument(
        "--shard-index",
        type=int,
        default=None,
        metavar="I",
        help="serve only shard I of the shards listed in --shard-map (one shard per host; default: none, see --shards)",
    )
    g.add_argument(
        "--shard-map",
        default="",
        metavar="FILE",
        help='JSON {"shards": ["host:port", ...]}, shard 0 first: read with --shard-index, written (the bound '
        "addresses) with --shards (default: none)",
    )
    g.add_argument(
        "--shard-fill-timeout-s",
        type=float,
        default=30.0,
        metavar="S",
        help="a shard > 0 applies a push whose part has not come S seconds after the next one as a zero "
        "pseudo-gradient, keeping every shard at one version (default %(default)s)",
    )


def sharded(args: argparse.Namespace) -> bool:
    return args.shards != 1 or args.shard_index is not None


def _shard_configs(args: argparse.Namespace, cfg: ServerConfig) -> tuple[list[ServerConfig], Path | None]:
    """One ServerConfig per shard this process serves, and the root checkpoint folder (--shards).

    Raises:
        ConfigError: the flags contradict each other (each message names the flags and the fix).
    """
    from asyncdiloco.ps.durable.shard_files import check_root
    from asyncdiloco.wire.shards import load_shard_addresses

    common = dict(shard_fill_timeout_s=args.shard_fill_timeout_s)
    if args.shard_index is not None:
        if args.shards != 1:
            raise ConfigError(
                f"--shard-index {args.shard_index} with --shards {args.shards}: give one of them (--shards S serves "
                f"S shards here; --shard-index I --shard-map FILE serves one of the file's)"
            )
        if not args.shard_map:
            raise ConfigError("--shard-index needs --shard-map FILE listing every shard's host:port, shard 0 first")
        addresses = load_shard_addresses(args.shard_map)
        if not 0 <= args.shard_index < len(addresses):
            raise ConfigError(
                f"--shard-index {args.shard_index} is outside the {len(addresses)} shards of {args.shard_map}; "
                f"give 0..{len(addresses) - 1}"
            )
        port = int(addresses[args.shard_index].rpartition(":")[2])
        one = _shard(cfg, args.shard_index, len(addresses), port, cfg.durability, common)
        return [one], None
    if args.shards < 1:
        raise ConfigError(f"--shards {args.shards} is invalid: give S >= 1")
    ports = [int(p) for p in args.shard_ports.split(",") if p.strip()] if args.shard_ports else []
    if ports and len(ports) != args.shards:
        raise ConfigError(f"--shard-ports lists {len(ports)} ports for --shards {args.shards}; list one per shard")
    if not ports:
        ports = [cfg.port + i if cfg.port else 0 for i in range(args.shards)]
    root = Path(cfg.durability.checkpoint_dir) if cfg.durability is not None else None
    if root is not None:
        check_root(root, args.shards)
    configs = []
    for i in range(args.shards):
        durability = (
            dataclasses.replace(cfg.durability, checkpoint_dir=str(root / f"shard-{i}"))
            if cfg.durability is not None and root is not None
            else None
        )
        configs.append(_shard(cfg, i, args.shards, ports[i], durability, common))
    return configs, root


def _shard(
    cfg: ServerConfig, index: int, count: int, port: int, durability: DurabilityConfig | None, common: dict
) -> ServerConfig:
    shard = dataclasses.replace(cfg, shard_index=index, shard_count=count, port=port, durability=durability, **common)
    if index > 0:  # only shard 0 offers the bulk channel and the metrics endpoint
        shard = dataclasses.replace(shard, bulk_port=None, metrics_port=None)
    return shard


def run_shards(args: argparse.Namespace, cfg: ServerConfig, stopping: dict[str, float]) -> int:
    """Serve the shards until SIGINT or SIGTERM; write the shard map and the manifest."""
    from asyncdiloco.ps import ParameterServer
    from asyncdiloco.ps.durable.shard_files import write_manifest
    from asyncdiloco.wire.shards import write_shard_addresses

    configs, root = _shard_configs(args, cfg)
    servers: list[ParameterServer] = []
    try:
        for c in configs:
            servers.append(ParameterServer(c).start())
    except BaseException:
        for srv in servers:
            srv.stop(None)
        raise
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    if args.shard_index is None and args.shard_map:
        write_shard_addresses(args.shard_map, [s.address for s in servers])

    def manifest() -> None:
        if root is not None:
            write_manifest(root, [_manifest_entry(s) for s in servers])

    manifest()
    if args.port_file:
        write_atomically(Path(args.port_file), lambda f: f.write(f"{servers[0].port}\n".encode()))
    for s in servers:
        print(
            f"asyncdiloco server: shard {s.config.shard_index} of {s.config.shard_count} listening on {s.address}",
            flush=True,
        )
    print(f"asyncdiloco server listening on {servers[0].address}", flush=True)
    while not stop.wait(MANIFEST_EVERY_S):
        manifest()
    for s in reversed(servers):  # the followers first: shard 0 keeps sequencing until the end
        s.stop(**stopping)
    manifest()
    versions = ", ".join(f"shard {s.config.shard_index}: {s.state.version}" for s in servers)
    print(f"asyncdiloco server stopped: versions {versions}", flush=True)
    return 0


def _manifest_entry(srv: ParameterServer) -> dict:
    """One shard's entry in the root folder's shards.json."""
    durability = srv.config.durability
    return {
        "index": srv.config.shard_index,
        "address": srv.address,
        "checkpoint_dir": durability.checkpoint_dir if durability else None,
        "version": srv.state.version,
    }
