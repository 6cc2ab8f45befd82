"""The command line's settings, one ``Flag`` each: its flag, the config field it sets (a
dotted path: ``outer.lr`` is ``ServerConfig.outer.lr``), how its text parses, its choices
and its help with the unit. Every config field is in a table or in the table's exclusions
below, with the reason (tests/test_flags.py checks both).
"""

from __future__ import annotations

import argparse

from asyncdiloco.algo.config import OUTER_OPTIMIZERS, STALENESS_WEIGHTINGS
from asyncdiloco.algo.lr_schedule import LR_SCHEDULES
from asyncdiloco.algo.schedule import GROUPINGS
from asyncdiloco.flags.table import Flag, FlagTable
from asyncdiloco.job.config import JobConfig
from asyncdiloco.ps.config import MODES, SYNC_LOCAL_STEPS, SYNC_WEIGHTINGS, ServerConfig
from asyncdiloco.wire.codec import WIRE_CODECS
from asyncdiloco.worker.config import SyncWorkerConfig, WorkerConfig


def seconds_or_auto(text: str) -> float | None:
    """A number of seconds, or "auto" (None: the server works it out from the workers' rates)."""
    if text.strip().lower() == "auto":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds or 'auto'") from None


def _seconds_or_auto_text(value: float | None) -> str:
    return "auto" if value is None else str(value)


_MIB = 2**20


_MODE_DEPENDS = {"mode": MODES}

#: Where and how the server listens (``asyncdiloco server`` only; the demo picks its own).
SERVER_ADDRESS = FlagTable.of(
    ServerConfig,
    "where the server listens",
    (
        Flag(flag="--host", field="host", help="interface to bind; 0.0.0.0 = all"),
        Flag(flag="--port", field="port", help="TCP port; 0 = pick a free one"),
        Flag(
            flag="--bulk-port",
            field="bulk_port",
            help="also serve push/pull payloads as raw bytes on this TCP port (same host, token and TLS; "
            "0 = pick a free one). Workers learn the port on Join",
            default_means="off, gRPC only",
        ),
        Flag(
            flag="--metrics-port",
            field="metrics_port",
            help="serve Prometheus metrics (/metrics), the dashboard (/) and the status (/status.json) over "
            "HTTP on this TCP port of --host (no token, no TLS: keep it on a trusted network; 0 = pick a free one)",
            default_means="off",
        ),
    ),
)

#: The run the server dictates: mode, H, the outer step, grouping, limits, sync quorums.
SERVER_RUN = FlagTable.of(
    ServerConfig,
    "the run the server dictates",
    (
        Flag(
            flag="--mode",
            field="mode",
            choices=MODES,
            help="async: apply pushes on arrival; sync: quorum rounds with an allreduce",
        ),
        Flag(flag="--min-workers", field="sync.min_workers", help="sync: workers a quorum needs"),
        Flag(
            flag="--quorum-wait-s",
            field="sync.join_timeout_s",
            help="sync: seconds after a round's first request after which a quorum forms without missing members",
        ),
        Flag(
            flag="--round-timeout-s",
            field="sync.round_timeout_s",
            help="sync: seconds from a quorum's formation by which every member must vote",
        ),
        Flag(
            flag="--sync-weighting",
            field="sync.weighting",
            choices=SYNC_WEIGHTINGS,
            help="sync: mean or token-weighted mean of the pseudo-gradients",
        ),
        Flag(
            flag="--sync-local-steps",
            field="sync.local_steps",
            choices=SYNC_LOCAL_STEPS,
            help="sync: inner steps per member of a round: fixed (H for everyone) or adaptive (DyLU inside a "
            "round: H_w = floor(v_w / max v * H) over the round's members' measured rates, so members of uneven "
            "speed finish together; H while a rate is unknown)",
        ),
        Flag(flag="--local-steps", aliases=("-H",), field="local_steps", help="H, inner steps between pushes"),
        Flag(flag="--outer-optimizer", field="outer.optimizer", choices=OUTER_OPTIMIZERS, help="outer optimizer"),
        Flag(flag="--outer-lr", field="outer.lr", help="outer learning rate η"),
        Flag(flag="--outer-momentum", field="outer.momentum", help="outer momentum μ"),
        Flag(
            flag="--staleness", field="outer.staleness", choices=STALENESS_WEIGHTINGS, help="staleness weighting s(τ)"
        ),
        Flag(flag="--staleness-a", field="outer.staleness_a", help="a: polynomial exponent / hinge slope"),
        Flag(flag="--staleness-b", field="outer.staleness_b", help="b: hinge grace, versions"),
        Flag(flag="--max-staleness", field="outer.max_staleness", help="refuse pushes staler than this many versions"),
        Flag(
            flag="--dn-buffer",
            field="outer.dn_buffer",
            help="delayed_nesterov: N arrivals per momentum update; 0 = number of workers",
        ),
        Flag(flag="--dn-c", field="outer.dn_c", help="delayed_nesterov: c in [0, 1/N]"),
        Flag(
            flag="--block-check",
            field="outer.block_check",
            action="set",
            help="delayed_nesterov: damp each tensor of a pseudo-gradient that opposes the outer momentum",
        ),
        Flag(
            flag="--outer-lr-schedule",
            field="outer.lr_schedule",
            choices=LR_SCHEDULES,
            help="schedule of η by version (updates applied so far): constant, or cosine decay to "
            "--outer-min-lr-ratio·η at --outer-total-versions; both after a linear warmup",
        ),
        Flag(
            flag="--outer-warmup-versions",
            field="outer.lr_warmup_versions",
            help="versions of linear warmup of η; 0 = none",
        ),
        Flag(
            flag="--outer-total-versions",
            field="outer.lr_total_versions",
            help="cosine: the version from which η stays at its floor; must exceed the warmup",
        ),
        Flag(
            flag="--outer-min-lr-ratio",
            field="outer.lr_min_ratio",
            help="cosine: η's floor as a fraction of --outer-lr",
        ),
        Flag(flag="--chunk-bytes", field="chunk_bytes", help="payload chunk size, bytes"),
        Flag(flag="--lease-s", field="lease_s", help="seconds of silence before a worker is dropped"),
        Flag(flag="--max-payload-bytes", field="max_payload_bytes", help="largest model accepted, bytes"),
        Flag(flag="--max-abs-value", field="max_abs_value", help="refuse pushed values larger in magnitude"),
        Flag(
            flag="--receive-buffer-mib",
            field="receive_buffer_bytes",
            parse=float,
            to_field=lambda mib: int(mib * _MIB),
            to_flag=lambda n: n / _MIB,
            help="MiB of push receive buffers in use at once (they also hold the old versions still being "
            "pulled); more pushes wait",
        ),
        Flag(
            flag="--pull-snapshots",
            field="pull_snapshots",
            help="with a wire codec: most model versions encoded for pulls at once, one payload of memory "
            "each (a raw fp32 model's pulls read the model in place)",
        ),
        Flag(
            flag="--dylu",
            field="dylu",
            action="on_off",
            help="Dynamic Local Updates: H_w = floor(v_w / max v * H) per worker, from the rates the workers "
            "report from their first round on",
        ),
        Flag(
            flag="--grouping",
            field="grouping",
            choices=GROUPINGS,
            help="hold push replies until every expected worker pushed or the window ends (window), until the "
            "Delayed Nesterov buffer is complete (barrier), or not at all (off)",
        ),
        Flag(
            flag="--grace-s",
            field="grace_s",
            parse=seconds_or_auto,
            text=_seconds_or_auto_text,
            help="grouping window, seconds from a group's first push, or auto",
            default_means="auto: one round of the fastest worker, at least 1.5 inner steps of the slowest",
        ),
        Flag(
            flag="--group-max-wait-s",
            field="group_max_wait_s",
            parse=seconds_or_auto,
            text=_seconds_or_auto_text,
            help="barrier: the longest a push reply is held, seconds, or auto",
            default_means="auto: the longest round",
        ),
        Flag(
            flag="--wire-codec",
            field="wire_codec",
            choices=WIRE_CODECS,
            help="encoding of pushes and pulls: raw, bf16 (half the bytes, relative error <= 2^-8) or int8 "
            "(block-wise absmax, ~a quarter, error <= block absmax/254); async only",
        ),
        Flag(flag="--codec-block-size", field="codec_block_size", help="int8: elements per absmax block"),
    ),
    depends_on=_MODE_DEPENDS,
)

#: Checkpoints and the write-ahead log (docs/operations.md): ``ServerConfig.durability``.
SERVER_DURABILITY = FlagTable.of(
    ServerConfig,
    "durability",
    (
        Flag(
            flag="--checkpoint-dir",
            field="durability.checkpoint_dir",
            metavar="DIR",
            help="keep checkpoints and a write-ahead log here; resume from them on start",
            default_means="none: the state lives in memory only",
        ),
        Flag(flag="--checkpoint-every", field="durability.checkpoint_every", help="applied pushes between checkpoints"),
        Flag(
            flag="--fallback-to-previous",
            field="durability.fallback_to_previous",
            action="set",
            help="if the newest checkpoint is corrupt, resume from the previous one instead of refusing to start",
        ),
        Flag(
            flag="--no-fsync",
            field="durability.fsync",
            action="unset",
            help="do not fsync the log before acknowledging (survives a killed process, not a power loss)",
        ),
    ),
)

#: Token and TLS of the server: ``ServerConfig.security``.
SERVER_SECURITY = FlagTable.of(
    ServerConfig,
    "security",
    (
        Flag(
            flag="--token-file",
            field="security.token_file",
            help="require the token in this file's first line on every call",
            default_means="none",
        ),
        Flag(
            flag="--tls-cert",
            field="security.tls_cert",
            help="PEM certificate chain of the server (with --tls-key: serve TLS)",
            default_means="plaintext",
        ),
        Flag(flag="--tls-key", field="security.tls_key", help="PEM private key of the server", default_means="none"),
        Flag(
            flag="--tls-client-ca",
            field="security.tls_client_ca",
            help="PEM CA that client certificates must chain to (mutual TLS)",
            default_means="no client certificates",
        ),
        Flag(
            flag="--insecure-trusted-network",
            field="security.insecure_trusted_network",
            action="set",
            help="accept the --token-file over plaintext on a --host beyond the loopback (and send the "
            "--parent-token-file so to a --parent beyond it), on a network you trust end to end (without it such "
            "a server refuses to start: give --tls-cert/--tls-key, --parent-tls-ca)",
        ),
    ),
)

#: Every flag of ``asyncdiloco server`` that sets a ``ServerConfig`` field.
SERVER = SERVER_ADDRESS + SERVER_RUN + SERVER_DURABILITY + SERVER_SECURITY

#: ``ServerConfig`` fields without a flag, and why.
SERVER_EXCLUDED = {
    # Threads serving RPCs: sized for any number of workers one machine runs; an embedder
    # who serves more sets it in ServerConfig.
    "max_concurrent_rpcs",
    # Buckets of the staleness histogram in the status: a reporting detail (the simulator sets it).
    "histogram_buckets",
    # A sharded server's place and fill timeout: set per shard by cli/shards.py from --shards,
    # --shard-index, --shard-map and --shard-fill-timeout-s (one flag set, S configs).
    "shard_index",
    "shard_count",
    "shard_fill_timeout_s",
}

#: How a worker reaches the server: ``WorkerConfig``.
WORKER = FlagTable.of(
    WorkerConfig,
    "connection",
    (
        Flag(
            flag="--server",
            field="server",
            required=True,
            metavar="HOST:PORT",
            help="the parameter server (a sharded one: HOST:PORT,HOST:PORT,... shard 0 first)",
        ),
        Flag(
            flag="--worker-name",
            aliases=("--name",),
            field="worker_name",
            help="the worker's identity: restarted under the same name it gets its worker id back; "
            "two processes must not share one",
            default_means="the name saved in --state-dir, else a new HOST-PID-XXXX",
        ),
        Flag(
            flag="--state-dir",
            field="state_dir",
            metavar="DIR",
            help="keep the worker's own state here (name, inner optimizer, data position, θ_base and unsent "
            "steps, push counter), saved after every sync; a worker restarted on it continues where it stopped",
            default_means="none: a restarted worker starts afresh",
        ),
        Flag(
            flag="--join-retry-s",
            field="join_timeout_s",
            help="seconds to keep retrying the join before giving up (exit status 1)",
        ),
        Flag(
            flag="--overlap",
            field="overlap",
            action="set",
            help="push and pull in the background while the next inner steps run, then merge (async only)",
        ),
        Flag(
            flag="--max-dropped-in-a-row",
            field="max_dropped_in_a_row",
            help="exit (status 1) after this many pseudo-gradients in a row were dropped, refused or not "
            "finite, none applied (a diverged model); 0: never",
        ),
        Flag(
            flag="--no-bulk-channel",
            field="bulk_channel",
            action="unset",
            help="push and pull over gRPC even when the server offers a bulk data channel",
        ),
        Flag(
            flag="--token-file",
            field="security.token_file",
            help="send the token in this file's first line (the server's --token-file)",
            default_means="none",
        ),
        Flag(
            flag="--tls-ca",
            field="security.tls_ca",
            help="PEM CA to verify the server's certificate with (connect over TLS)",
            default_means="plaintext",
        ),
        Flag(
            flag="--tls-cert",
            field="security.tls_cert",
            help="PEM client certificate, for a server with --tls-client-ca",
            default_means="none",
        ),
        Flag(
            flag="--tls-key",
            field="security.tls_key",
            help="PEM private key of the client certificate",
            default_means="none",
        ),
        Flag(
            flag="--tls-server-name",
            field="security.tls_server_name",
            help="name expected in the server's certificate",
            default_means="the host in --server",
        ),
        Flag(
            flag="--insecure-trusted-network",
            field="security.insecure_trusted_network",
            action="set",
            help="send the --token-file over plaintext to a --server beyond the loopback, on a network you trust "
            "end to end (without it the worker refuses to connect: give --tls-ca)",
        ),
    ),
)

#: ``WorkerConfig`` fields without a flag, and why: retry and deadline knobs whose
#: defaults suit every run the command starts; a library user sets them in WorkerConfig.
WORKER_EXCLUDED = {
    "rpc_timeout_s",
    "timeout_s_per_mib",
    "initial_backoff_s",
    "max_backoff_s",
    "heartbeat_s",
    "push_on_close",
}

#: A sync-mode worker's collectives: ``SyncWorkerConfig``.
SYNC_WORKER = FlagTable.of(
    SyncWorkerConfig,
    "sync mode",
    (
        Flag(
            flag="--allreduce-timeout-s",
            field="allreduce_timeout_s",
            help="sync: seconds a process-group build or allreduce may take",
        ),
        Flag(
            flag="--quorum-timeout-s",
            field="quorum_timeout_s",
            help="sync: seconds to wait for a quorum before training on locally",
        ),
        Flag(
            flag="--collective-host",
            field="collective_host",
            help="sync: address the gloo device binds",
            default_means="127.0.0.1 for a loopback server, else torch's",
        ),
    ),
)

#: ``SyncWorkerConfig`` fields without a flag: none.
SYNC_WORKER_EXCLUDED: set[str] = set()

#: The default job's model and data: ``JobConfig`` (the demo's and the worker's).
JOB = FlagTable.of(
    JobConfig,
    "model and data",
    (
        Flag(flag="--batch-size", field="batch_size", help="sequences per inner step"),
        Flag(flag="--context-len", field="context_len", help="characters per sequence"),
        Flag(flag="--n-layer", field="n_layer", help="transformer blocks"),
        Flag(flag="--n-embd", field="n_embd", help="model width"),
        Flag(flag="--n-head", field="n_head", help="attention heads"),
        Flag(flag="--inner-lr", field="inner_lr", help="AdamW learning rate"),
        Flag(flag="--seed", field="seed", help="model init and data order seed"),
    ),
)

#: The inner lr's schedule, keyed by the worker's own inner step (worker only).
INNER_SCHEDULE = FlagTable.of(
    JobConfig,
    "inner learning-rate schedule",
    (
        Flag(
            flag="--inner-lr-schedule",
            field="inner_lr_schedule",
            choices=LR_SCHEDULES,
            help="schedule of --inner-lr by inner step: constant, or cosine decay to --inner-min-lr-ratio·lr "
            "at --inner-total-steps; both after a linear warmup",
        ),
        Flag(flag="--inner-warmup-steps", field="inner_warmup_steps", help="inner steps of linear warmup; 0 = none"),
        Flag(
            flag="--inner-total-steps",
            field="inner_total_steps",
            help="cosine: the inner step from which the lr stays at its floor; must exceed the warmup",
        ),
        Flag(
            flag="--inner-min-lr-ratio", field="inner_min_ratio", help="cosine: the floor as a fraction of --inner-lr"
        ),
    ),
)

#: Every flag of ``asyncdiloco worker`` that sets a ``JobConfig`` field.
WORKER_JOB = JOB + INNER_SCHEDULE

#: ``JobConfig`` fields without a flag, and why.
JOB_EXCLUDED = {
    # AdamW's weight decay: part of the default job's recipe, not a knob of the demo.
    "weight_decay",
    # Batches of the demo's held-out evaluation, which runs in the demo process, not a worker.
    "eval_batches",
}

#: How ``asyncdiloco status`` reaches the server: the worker's own --server, token and
#: TLS flags (the same ``Flag`` objects, so they read and check the same), building a
#: ``WorkerConfig`` whose ``server`` and ``security`` the command uses.
STATUS = FlagTable.of(
    WorkerConfig,
    "connection",
    tuple(f for f in WORKER.flags if f.field == "server" or f.field.startswith("security.")),
)

#: ``asyncdiloco eval`` reaches the server as ``status`` does (its model: ``EVAL_MODEL``).
EVAL = STATUS

#: ``asyncdiloco eval``'s model: the shape flags of ``JOB`` only, which must be the
#: workers'. The parameters come from the server, and the held-out batches are the
#: default job's fixed set (so that every evaluator measures the same loss), so the
#: training flags (--batch-size, --inner-lr, --seed) mean nothing to it.
EVAL_MODEL = FlagTable.of(
    JobConfig,
    "the workers' model",
    tuple(f for f in JOB.flags if f.field in ("context_len", "n_layer", "n_embd", "n_head")),
)

#: ``asyncdiloco export``: the checkpoint folder it reads (never writes), as the
#: ``ServerConfig.durability`` of the server that wrote it.
EXPORT = FlagTable.of(
    ServerConfig,
    "the checkpoint folder",
    (
        Flag(
            flag="--checkpoint-dir",
            field="durability.checkpoint_dir",
            required=True,
            metavar="DIR",
            help="the server's --checkpoint-dir; read only, the server may be running",
        ),
    ),
)
