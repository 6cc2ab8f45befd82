"""A command-line setting declared once (``Flag``) and a table of them (``FlagTable``) with
its three uses: ``add_to(parser)`` (the argparse arguments, each default read from the
config dataclass), ``build(table.given(args))`` (the config from the flags given; the
rest keep the config's defaults) and ``argv(config)`` (the flags that rebuild ``config``
in a child process: config → argv → parse → config is the identity, tests/test_flags.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

from asyncdiloco.errors import ConfigError

#: How a flag sets its field: "value" takes an argument; "set" / "unset" are switches
#: that set a bool field True / False; "on_off" is a pair --x / --no-x.
ACTIONS = ("value", "set", "unset", "on_off")


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
            parse = f.parse if f.parse is not None else _scalar_of(field_type(self.config, f.field))
            kwargs.update(type=parse, choices=f.choices, metavar=f.metavar)
        else:
            kwargs["action"] = argparse.BooleanOptionalAction if f.action == "on_off" else "store_true"
        group.add_argument(f.flag, *f.aliases, **kwargs)

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
