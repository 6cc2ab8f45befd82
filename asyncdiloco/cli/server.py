"""``asyncdiloco server``: the parameter server process, until SIGINT or SIGTERM; it drains
for ``--drain-s`` and gives the calls in flight ``GRACE_S`` (docs/operations.md, "Health").
"""

from __future__ import annotations

import argparse
import math
import pathlib
import signal
import threading

from asyncdiloco._atomic import write_atomically
from asyncdiloco.cli.shards import add_shard_flags, run_shards, sharded
from asyncdiloco.errors import ConfigError
from asyncdiloco.flags.settings import SERVER
from asyncdiloco.ps.config import ServerConfig
from asyncdiloco.ps.tier.rebase import DEFAULT_PARENT_EVERY, UpstreamConfig


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "server",
        help="run the parameter server",
        description="The parameter server: holds the global model, applies the workers' pseudo-gradients "
        "(or, with --mode sync, their rounds) and serves pulls, until SIGINT or SIGTERM.",
    )
    p.add_argument("--port-file", help="write the bound port to this file once listening (default: none)")
    p.add_argument(
        "--drain-s",
        type=float,
        default=DRAIN_S,
        metavar="S",
        help="on SIGTERM/SIGINT: answer health checks NOT_SERVING but keep serving for S seconds, so load "
        "balancers and readiness probes stop sending new work before the port closes (default %(default)s)",
    )
    add_shard_flags(p)
    SERVER.add_to(p)
    tier = p.add_argument_group("hierarchical tier (this server as a regional one; ps/tier/upstream.py)")
    tier.add_argument(
        "--parent",
        metavar="HOST:PORT",
        help="a parent (global) parameter server: this one applies its workers' pushes and, every "
        "--parent-every of them, pushes its own pseudo-gradient to the parent, pulls the global model "
        "and rebases onto it (default: none, a flat server)",
    )
    tier.add_argument(
        "--parent-every",
        type=int,
        default=DEFAULT_PARENT_EVERY,
        metavar="K",
        help="regional pushes applied between two pushes to the parent (default %(default)s)",
    )
    tier.add_argument(
        "--parent-name", default="", help="the name the parent knows this server by (default: region-HOSTNAME:PORT)"
    )
    tier.add_argument("--parent-token-file", help="the parent's shared token (first line); default: none")
    tier.add_argument("--parent-tls-ca", help="PEM CA bundle: reach the parent over TLS; default: plaintext")
    p.set_defaults(func=run)


#: Seconds of serving on, NOT_SERVING, after a stop signal (``--drain-s``).
DRAIN_S = 1.0
#: Seconds the calls in flight get once the drain is over.
GRACE_S = 2.0


def stop_kwargs(args: argparse.Namespace) -> dict[str, float]:
    """``ParameterServer.stop``'s arguments from the flags.

    Raises:
        ConfigError: ``--drain-s`` is negative or not finite.
    """
    if not 0 <= args.drain_s < math.inf:
        raise ConfigError(f"--drain-s {args.drain_s:g} is invalid: give seconds >= 0 (0: stop at once)")
    return {"grace_s": GRACE_S, "drain_s": args.drain_s}


def config(args: argparse.Namespace) -> ServerConfig:
    """The server's configuration from the parsed flags."""
    return SERVER.build(SERVER.given(args))


def upstream(args: argparse.Namespace) -> UpstreamConfig | None:
    """The link to ``--parent`` (None: a flat server).

    Raises:
        ConfigError: a bad --parent, --parent-every < 1, a --parent-* flag without
            --parent, an unreadable token/CA file, or --parent-token-file without
            --parent-tls-ca to a parent beyond the loopback (without --insecure-trusted-network).
    """
    if not args.parent:
        given = [
            f
            for f, v in (("--parent-token-file", args.parent_token_file), ("--parent-tls-ca", args.parent_tls_ca))
            if v
        ]
        if given or args.parent_name or args.parent_every != DEFAULT_PARENT_EVERY:
            raise ConfigError(
                f"{', '.join(given) or '--parent-every/--parent-name'} given without --parent: "
                "add --parent HOST:PORT or drop them"
            )
        return None
    from asyncdiloco.wire.security import ClientSecurityConfig, check_client_transport

    security = None
    if args.parent_token_file or args.parent_tls_ca:
        security = ClientSecurityConfig(
            token_file=args.parent_token_file,
            tls_ca=args.parent_tls_ca,
            insecure_trusted_network=getattr(args, "insecure_trusted_network", False),  # the server's own opt-in
        )
    check_client_transport(
        args.parent, security, token_flag="--parent-token-file", tls_flag="--parent-tls-ca", address_flag="--parent"
    )
    return UpstreamConfig(parent=args.parent, every=args.parent_every, name=args.parent_name, security=security)


def run(args: argparse.Namespace) -> int:
    import torch

    from asyncdiloco._malloc import keep_large_blocks
    from asyncdiloco.ps import ParameterServer

    cfg, stopping, parent = config(args), stop_kwargs(args), upstream(args)
    torch.set_num_threads(1)  # one intra-op thread: the outer step competes with the RPC threads for cores
    keep_large_blocks()  # reuse payload-sized memory instead of faulting it in again for every push
    if sharded(args):
        if parent is not None:
            raise ConfigError(
                "--parent and --shards/--shard-index cannot be combined: a regional server is one "
                "process; run the sharded server as the global (parent) one, or drop --shards"
            )
        return run_shards(args, cfg, stopping)
    server = ParameterServer(cfg, parent).start()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # before announcing: a caller may signal right after
        signal.signal(sig, lambda *_: stop.set())
    if args.port_file:  # written before the "listening" line, which tells watchers it is ready
        assert server.port is not None, "a started server has its port"
        write_atomically(pathlib.Path(args.port_file), lambda f: f.write(f"{server.port}\n".encode()))
    print(f"asyncdiloco server listening on {server.address}", flush=True)
    if parent is not None:
        print(f"asyncdiloco server: regional tier of {parent.parent}, pushing every {parent.every}", flush=True)
    if server.bulk_port:
        print(f"asyncdiloco server: bulk data channel on port {server.bulk_port}", flush=True)
    if server.metrics_port:
        host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
        url = f"http://{host}:{server.metrics_port}"
        print(f"asyncdiloco server: dashboard at {url}/, Prometheus metrics at {url}/metrics", flush=True)
    stop.wait()
    link = server.upstream
    server.stop(**stopping)  # the drain, the grace, then the final checkpoint (--checkpoint-dir)
    print(_final_line(server.state.status(), server.config.mode), flush=True)
    if link is not None:
        print(
            f"asyncdiloco server: {link.pushes} pushes to the parent applied, {link.rebases} rebases onto its model "
            f"(last: version {link.parent_version}), {link.failures} calls found it unreachable",
            flush=True,
        )
    return 0


def _final_line(st, mode: str) -> str:
    """The server's last line: its version and counters (sync: a push is one member's
    contribution to a round, so rounds are counted apart from contributions)."""
    if mode == "sync":
        return (
            f"asyncdiloco server stopped at version {st.version}: {st.rounds_committed} rounds committed, "
            f"{st.rounds_failed} aborted, {st.applied_pushes} member contributions applied, "
            f"{st.rejected_pushes} refused, {st.pulls} pulls"
        )
    return (
        f"asyncdiloco server stopped at version {st.version}: {st.applied_pushes} pushes applied, "
        f"{st.rejected_pushes} refused, {st.pulls} pulls"
    )
