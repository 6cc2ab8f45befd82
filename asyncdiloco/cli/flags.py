"""The command line's settings, each declared once: its flag, the config field it sets,
how its text parses, its choices and its help with the unit.

A ``FlagTable`` serves the three uses of one such table:

- ``add_to(parser)``: the argparse arguments, with the default read from the config
  dataclass itself (and, where the default is None or empty, what that means);
- ``build(table.given(args))``: the config (``ServerConfig``, ``WorkerConfig``,
  ``SyncWorkerConfig``, ``JobConfig``) from the flags given; a flag not given leaves
  the field at the config's own default;
- ``argv(config)``: the flags that rebuild ``config`` in a child process (the demo's and
  the real-clock suite's server and workers): config → argv → parse → config is the
  identity (tests/test_flags.py).

A field is a dotted path below the table's config class: ``outer.lr`` is
``ServerConfig.outer.lr``, ``durability.checkpoint_every`` is
``ServerConfig.durability.checkpoint_every``. A nested config that is None by default
(durability, security) is built once one of its flags is given.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

from asyncdiloco.algo.config import OUTER_OPTIMIZERS, STALENESS_WEIGHTINGS
from asyncdiloco.algo.lr_schedule import LR_SCHEDULES
from asyncdiloco.algo.schedule import GROUPINGS
from asyncdiloco.errors import ConfigError
from asyncdiloco.job.config import JobConfig
from asyncdiloco.ps.config import MODES, SYNC_WEIGHTINGS, ServerConfig
from asyncdiloco.wire.codec import WIRE_CODECS
from asyncdiloco.worker.config import SyncWorkerConfig, WorkerConfig

#: How a flag sets its field: "value" takes an argument; "set" / "unset" are switches
#: that set a bool field True / False; "on_off" is a pair --x / --no-x.
ACTIONS = ("value", "set", "unset", "on_off")


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class Flag:
    """One command-line setting and the config field it sets."""

    #: The flag, e.g. "--outer-lr".
    flag: str
    #: The field it sets: a dotted path below the table's config class, e.g. "outer.lr".
    field: str
    #: What it sets, with the unit; the default is appended from the config class.
    help: str
    #: Text → flag value; None: the field's own type (int, float or str).
    parse: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    #: One of ``ACTIONS``.
    action: str = "value"
    #: Other spellings, e.g. "-H".
    aliases: tuple[str, ...] = ()
    #: What the default means where the field's default is None or empty (shown as the
    #: default in --help, e.g. "auto: one round of the fastest worker").
    default_means: str | None = None
    metavar: str | None = None
    required: bool = False
    #: Flag value → field value and back, where their units differ (MiB vs bytes).
    to_field: Callable[[Any], Any] | None = None
    to_flag: Callable[[Any], Any] | None = None
    #: Flag value → its text in an argv (``str`` unless None has a spelling, e.g. "auto").
    text: Callable[[Any], str] = str

    def __post_init__(self) -> None:
        assert self.action in ACTIONS, self.action

    @property
    def dest(self) -> str:
        """The attribute argparse stores the value under."""
        return self.flag.lstrip("-").replace("-", "_")

    def field_value(self, flag_value: Any) -> Any:
        return self.to_field(flag_value) if self.to_field is not None else flag_value

    def flag_value(self, field_value: Any) -> Any:
        return self.to_flag(field_value) if self.to_flag is not None else field_value


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _dataclass_of(hint: Any) -> type | None:
    """The dataclass in a field's type (``OuterConfig | None`` → OuterConfig), if any."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return next((a for a in typing.get_args(hint) if isinstance(a, type) and dataclasses.is_dataclass(a)), None)
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


def _scalar_of(hint: Any) -> type:
    """int, float, str or bool of a field's type (``int | None`` → int)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    assert hint in (int, float, str, bool), hint
    return hint


def field_type(cls: type, path: str) -> Any:
    """The type hint of the field at ``path`` below the dataclass ``cls``."""
    head, _, rest = path.partition(".")
    hint = _hints(cls)[head]
    if not rest:
        return hint
    nested = _dataclass_of(hint)
    assert nested is not None, path
    return field_type(nested, rest)


def _class_default(cls: type, name: str) -> Any:
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def value_at(config: Any, cls: type, path: str) -> Any:
    """The value at ``path`` in ``config`` (of class ``cls``); below a nested config that
    is None, that config class's own default (``dataclasses.MISSING`` for a required field)."""
    head, _, rest = path.partition(".")
    if config is None:
        value = _class_default(cls, head)
    else:
        value = getattr(config, head)
    if not rest:
        return value
    nested = _dataclass_of(_hints(cls)[head])
    assert nested is not None, path
    return value_at(None if value is dataclasses.MISSING else value, nested, rest)


@dataclasses.dataclass(frozen=True)
class FlagTable:
    """The flags of one config class and their three uses (argparse, build, argv)."""

    #: The config dataclass the flags' fields are paths in.
    config: type
    #: (title in --help, flags), one per group of flags.
    groups: tuple[tuple[str, tuple[Flag, ...]], ...]
    #: The field other fields' defaults depend on, with its values: the server's outer
    #: optimizer is the mode's own (``ServerConfig(mode=...)``).
    depends_on: Mapping[str, tuple[Any, ...]] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(
        cls, config: type, title: str, flags: tuple[Flag, ...], depends_on: Mapping[str, tuple[Any, ...]] | None = None
    ) -> FlagTable:
        return cls(config, ((title, flags),), dict(depends_on or {}))

    def __post_init__(self) -> None:
        assert len(self.depends_on) <= 1, "one field others depend on"
        for f in self.flags:
            field_type(self.config, f.field)  # the path exists
        assert len({f.field for f in self.flags}) == len(self.flags), "one flag per field"

    @property
    def flags(self) -> tuple[Flag, ...]:
        return tuple(f for _, flags in self.groups for f in flags)

    def __add__(self, other: FlagTable) -> FlagTable:
        assert other.config is self.config
        return FlagTable(self.config, self.groups + other.groups, {**self.depends_on, **other.depends_on})

    # ------------------------------------------------------------ argparse
    def add_to(self, parser: argparse.ArgumentParser, default_means: Mapping[str, str] | None = None) -> None:
        """Add the flags to ``parser`` as one group; ``default_means`` replaces the default
        shown for some flags (by flag: e.g. where the caller supplies its own default)."""
        for title, flags in self.groups:
            group = parser.add_argument_group(title)
            for f in flags:
                self._add(group, f, (default_means or {}).get(f.flag))

    def _add(self, group: argparse._ArgumentGroup, f: Flag, default_means: str | None) -> None:
        shown = f"default: {default_means}" if default_means else self._default_text(f)
        help_text = f"{f.help} ({shown})" if shown else f.help
        kwargs: dict[str, Any] = {"dest": f.dest, "help": help_text.replace("%", "%%"), "default": argparse.SUPPRESS}
        if f.required:
            kwargs["required"] = True
        if f.action == "value":
            kwargs.update(type=self._parser_of(f), choices=f.choices, metavar=f.metavar)
        else:
            kwargs["action"] = argparse.BooleanOptionalAction if f.action == "on_off" else "store_true"
        group.add_argument(f.flag, *f.aliases, **kwargs)

    def _parser_of(self, f: Flag) -> Callable[[str], Any]:
        return f.parse if f.parse is not None else _scalar_of(field_type(self.config, f.field))

    def _defaults(self) -> list[tuple[str, Any]]:
        """(label, default config) for each value of the fields others depend on."""
        if not self.depends_on:
            return [("", None)]
        ((name, values),) = self.depends_on.items()
        return [(str(v), self.config(**{name: v})) for v in values]

    def _default_text(self, f: Flag) -> str:
        if f.action in ("set", "unset") or f.required:
            return ""
        defaults = [("", None)] if f.field in self.depends_on else self._defaults()
        shown = [(label, self._shown(f, value_at(cfg, self.config, f.field))) for label, cfg in defaults]
        if len({text for _, text in shown}) == 1:
            return f"default {shown[0][1]}" if shown[0][1] is not None else f"default: {f.default_means}"
        return "default: the mode's own: " + ", ".join(f"{label} {text}" for label, text in shown)

    def _shown(self, f: Flag, default: Any) -> str | None:
        if default is None or default == "" or default is dataclasses.MISSING:
            if f.default_means is None:
                raise AssertionError(f"{f.flag}: say what its default {default!r} means (default_means)")
            return None
        if f.action == "on_off":
            return "on" if default else "off"
        value = f.flag_value(default)
        return f"{value:g}" if isinstance(value, float) else str(value)

    # ---------------------------------------------------------- argv → config
    def given(self, args: argparse.Namespace) -> dict[str, Any]:
        """{field path: field value} of the flags given on the command line."""
        given = {}
        for f in self.flags:
            if hasattr(args, f.dest):
                value = getattr(args, f.dest)
                given[f.field] = (not value) if f.action == "unset" else f.field_value(value)
        return given

    def build(self, given: Mapping[str, Any], **fixed: Any) -> Any:
        """The config with the ``given`` field values ({path: value}) and the top-level
        fields ``fixed``; every other field keeps the config's own default.

        Raises:
            ConfigError: a value is invalid (the config's own check), or a flag of an
                optional part is given without the flag that part requires.
        """
        top = {path: v for path, v in given.items() if "." not in path} | fixed
        base = self.config(**{k: top[k] for k in self.depends_on if k in top})
        nested: dict[str, dict[str, Any]] = {}
        for path, value in given.items():
            if "." in path:
                head, rest = path.split(".", 1)
                nested.setdefault(head, {})[rest] = value
        for head, values in nested.items():
            top[head] = self._build_part(base, head, values)
        return self.config(**top)

    def _build_part(self, base: Any, head: str, values: dict[str, Any]) -> Any:
        assert all("." not in path for path in values), "one level of nesting"
        current = getattr(base, head)
        if current is not None:
            return dataclasses.replace(current, **values)
        cls = _dataclass_of(_hints(self.config)[head])
        assert cls is not None, head
        missing = [
            f.name
            for f in dataclasses.fields(cls)
            if f.name not in values and _class_default(cls, f.name) is dataclasses.MISSING
        ]
        if missing:
            needed = self._flag_of(f"{head}.{missing[0]}")
            given = ", ".join(self._flag_of(f"{head}.{name}").flag for name in values)
            verb = "needs" if len(values) == 1 else "need"
            raise ConfigError(f"{given} {verb} {needed.flag} {needed.metavar or ''}".rstrip())
        return cls(**values)

    def _flag_of(self, path: str) -> Flag:
        return next(f for f in self.flags if f.field == path)

    # ---------------------------------------------------------- config → argv
    def argv(self, config: Any) -> tuple[str, ...]:
        """The flags that rebuild ``config``: those whose field differs from the default
        (the default of ``config``'s own mode where a default depends on it)."""
        base = self.config(**{k: getattr(config, k) for k in self.depends_on})
        out: list[str] = []
        for f in self.flags:
            value = value_at(config, self.config, f.field)
            if value == value_at(None if f.field in self.depends_on else base, self.config, f.field):
                continue
            if f.action in ("set", "unset"):
                assert value == (f.action == "set"), f"{f.flag} cannot write {f.field}={value!r}"
                out.append(f.flag)
            elif f.action == "on_off":
                out.append(f.flag if value else "--no-" + f.flag[2:])
            else:
                text = f.text(f.flag_value(value))
                if value is None and text == "None":
                    raise ConfigError(f"{f.field}=None cannot be written as {f.flag}: leave it at its default")
                out += [f.flag, text]
        return tuple(out)

    def fields(self) -> set[str]:
        return {f.field for f in self.flags}


def all_fields(cls: type, prefix: str = "") -> set[str]:
    """Every field path below the dataclass ``cls``, nested configs expanded."""
    paths = set()
    for name, hint in _hints(cls).items():
        nested = _dataclass_of(hint)
        paths |= all_fields(nested, f"{prefix}{name}.") if nested is not None else {prefix + name}
    return paths


# -------------------------------------------------------------------- the tables
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
            flag="--join-timeout-s",
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
        Flag(flag="--store-port", field="sync.store_port", help="sync: port of the rendezvous store; 0 = a free one"),
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
            help="MiB of push receive buffers in use at once; more pushes wait",
        ),
        Flag(
            flag="--pull-snapshots",
            field="pull_snapshots",
            help="most model versions encoded for pulls at once, one payload of memory each",
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

#: Checkpoints and the write-ahead log (server/README.md): ``ServerConfig.durability``.
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
}

#: How a worker reaches the server: ``WorkerConfig``.
WORKER = FlagTable.of(
    WorkerConfig,
    "connection",
    (
        Flag(flag="--server", field="server", required=True, metavar="HOST:PORT", help="the parameter server"),
        Flag(
            flag="--name",
            field="worker_name",
            help="name in the server's status",
            default_means="worker-I@HOST, I the --worker-index",
        ),
        Flag(flag="--join-timeout", field="join_timeout_s", help="seconds to keep trying to join"),
        Flag(
            flag="--overlap",
            field="overlap",
            action="set",
            help="push and pull in the background while the next inner steps run, then merge (async only)",
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
