"""Config dataclasses as command-line flags, declared once: on the dataclass's fields.

Each field says in `field(metadata=...)` how it appears on the command line; the flag's
default is the field's default, its dest the field's name, so a parsed Namespace maps back
onto the dataclass without a hand-written table:

    block_size: int = field(default=16, metadata={"help": "tokens per KV block (a power of two)"})
    enable_prefix_caching: bool = field(default=True, metadata={"help": "...", "flag": "--no-prefix-caching"})
    check_integrity: bool = field(default=False, metadata={"help": "...", "cli": False})

metadata keys:

    help     what the field means (required for a field on the command line)
    cli      False: the field is set in code only, never a flag (default True)
    flag     the flag's name (default --field-name; --no-field-name for a bool whose default is True)
    choices  the values the flag accepts
    type     the value parser (default: from the annotation; required when that names several types)

Flag kinds, from the annotation and the default: a bool defaulting to False is a switch that
sets True, one defaulting to True a switch that sets False; `tuple[X, ...]` is a repeatable
flag whose values are collected in order; anything else takes one value (`X | None` parses
as X). Stdlib only.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any

METADATA_KEYS = frozenset({"help", "cli", "flag", "choices", "type"})


def cli_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of dataclass `cls` that are flags (metadata `cli` not False), in order.
    Raises TypeError naming a field whose metadata is malformed."""
    out = []
    for f in dataclasses.fields(cls):
        unknown = set(f.metadata) - METADATA_KEYS
        if unknown:
            raise TypeError(f"{cls.__name__}.{f.name}: unknown flag metadata {sorted(unknown)}; "
                            f"use {sorted(METADATA_KEYS)}")
        if f.metadata.get("cli", True) is False:
            continue
        if not f.metadata.get("help"):
            raise TypeError(f"{cls.__name__}.{f.name} is a flag without help: give metadata 'help', "
                            f"or 'cli': False to keep it off the command line")
        if f.default is dataclasses.MISSING:
            raise TypeError(f"{cls.__name__}.{f.name} is a flag without a default: give it `default=`")
        out.append(f)
    return out


def flag_name(f: dataclasses.Field) -> str:
    """The flag a field is set with: metadata 'flag', else --field-name (--no-field-name for a
    bool that defaults to True)."""
    if "flag" in f.metadata:
        return f.metadata["flag"]
    name = f.name.replace("_", "-")
    return f"--no-{name}" if f.default is True else f"--{name}"


def add_config_arguments(parser: argparse.ArgumentParser, cls: type, *, title: str | None = None,
                         only: Iterable[str] | None = None, defaults: Mapping[str, Any] | None = None,
                         notes: Mapping[str, str] | None = None) -> argparse._ArgumentGroup:
    """Add one flag per command-line field of dataclass `cls` to a new argument group of `parser`
    (`title`, default the class name). `only`: just these fields. `defaults`: the flag's default
    for these fields instead of the dataclass's (None reads back as "not given", see
    `namespace_values`). `notes`: text added to these flags' help (what this command does with
    them). Returns the group."""
    fields = cli_fields(cls)
    by_name = {f.name: f for f in fields}
    chosen = _known(cls, by_name, only, "only") if only is not None else list(by_name)
    defaults, notes = dict(defaults or {}), dict(notes or {})
    _known(cls, by_name, defaults, "defaults")
    _known(cls, by_name, notes, "notes")
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(title or cls.__name__)
    for name in chosen:
        f = by_name[name]
        default = defaults.get(name, f.default)
        help_text = "; ".join(text for text in (f.metadata["help"], notes.get(name)) if text).replace("%", "%%")
        kind, item = _kind(cls, f, hints[name])
        if kind == "switch":
            group.add_argument(flag_name(f), dest=name, action="store_false" if f.default else "store_true",
                               default=default, help=help_text)
            continue
        if default is not None and default != ():
            help_text += " (default: %(default)s)"
        kwargs: dict[str, Any] = {"dest": name, "type": f.metadata.get("type", item), "help": help_text}
        if "choices" in f.metadata:
            kwargs["choices"] = list(f.metadata["choices"])
        else:  # named after the flag, not the dest
            kwargs["metavar"] = flag_name(f).lstrip("-").replace("-", "_").upper()
        if kind == "repeat":
            group.add_argument(flag_name(f), action="append", default=None if default == () else list(default),
                               **kwargs)
        else:
            group.add_argument(flag_name(f), default=default, **kwargs)
    return group


def namespace_values(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The command-line fields of `cls` that `args` holds, as field name -> value. Fields the
    namespace lacks are left out; a None for a field whose type cannot be None means the flag
    was not given, and is left out too; repeated flags' lists become tuples."""
    hints = typing.get_type_hints(cls)
    values = {}
    for f in cli_fields(cls):
        if not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        if value is None and not _admits_none(hints[f.name]):
            continue
        values[f.name] = tuple(value) if isinstance(value, list) else value
    return values


def config_from_namespace(cls: type, args: argparse.Namespace, **overrides: Any):
    """Build `cls` from the flags in `args` (see `namespace_values`), `overrides` winning; fields
    neither gives keep their defaults. The dataclass validates the values as it always does."""
    return cls(**{**namespace_values(cls, args), **overrides})


# -- annotations ---------------------------------------------------------------------------------


def _known(cls: type, by_name: Mapping[str, dataclasses.Field], names: Iterable[str], what: str) -> list[str]:
    names = list(names)
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise TypeError(f"{what}: {unknown} are not command-line fields of {cls.__name__}; choose from {sorted(by_name)}")
    return names


def _members(annotation) -> tuple:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def _admits_none(annotation) -> bool:
    return type(None) in _members(annotation) or annotation is Any


def _kind(cls: type, f: dataclasses.Field, annotation) -> tuple[str, Any]:
    """("switch", None) | ("repeat", item type) | ("value", value type) for one field."""
    members = [m for m in _members(annotation) if m is not type(None)]
    where = f"{cls.__name__}.{f.name}"
    if members == [bool]:
        if not isinstance(f.default, bool):
            raise TypeError(f"{where}: a bool flag needs a default of True or False, got {f.default!r}")
        return "switch", None
    if len(members) == 1 and typing.get_origin(members[0]) is tuple:
        args = typing.get_args(members[0])
        if len(args) != 2 or args[1] is not Ellipsis:
            raise TypeError(f"{where}: a repeatable flag is annotated tuple[X, ...], got {annotation}")
        return "repeat", args[0]
    if "type" in f.metadata:
        return "value", f.metadata["type"]
    if len(members) == 1 and members[0] in (int, float, str):
        return "value", members[0]
    raise TypeError(f"{where}: cannot tell how to parse {annotation} from the command line; give metadata 'type'")
