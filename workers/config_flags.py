"""Command-line flags derived from a config dataclass: one source of names, types, defaults,
choices and help.

    add_config_flags(parser, EngineConfig)             # --block-size, --dtype {..}, ...
    data = config_flags_set(args, EngineConfig)        # only the flags given: {"block_size": 8}

A field becomes `--field-name`. Its type comes from the annotation (`int`, `float`, `str`,
`bool` as `--x/--no-x`, and their `X | None`); its help is the field's entry in the class's
`Attributes:` docstring section, followed by the default; its choices are the field's
`metadata["choices"]`. Fields of other types (dicts, nested configs) get no flag: they come
from a YAML config file. A flag's argparse default is "not given", so flags override a config
file only where they are given, and the dataclass keeps the one default.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import inspect
import math
import re
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any

_SCALARS: tuple[type, ...] = (int, float, str, bool)
_ATTRIBUTE = re.compile(r"^(\s*)(\w+): (.*)$")


def add_config_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    config_class: type,
    *,
    exclude: Iterable[str] = (),
) -> list[str]:
    """Add one flag per scalar field of `config_class`; returns the fields that got one."""
    excluded = set(exclude)
    helps = attribute_docs(config_class)
    hints = typing.get_type_hints(config_class)
    added = []
    for field in dataclasses.fields(config_class):
        scalar = _scalar_type(hints[field.name])
        if field.name in excluded or scalar is None:
            continue
        flag = "--" + field.name.replace("_", "-")
        help_text = _help(helps.get(field.name, ""), _default_of(field))
        if scalar is bool:
            parser.add_argument(
                flag,
                dest=field.name,
                default=None,
                help=help_text,
                action=argparse.BooleanOptionalAction,
            )
        else:
            choices = field.metadata.get("choices")
            parser.add_argument(
                flag,
                dest=field.name,
                default=None,
                help=help_text,
                type=_parser_for(scalar, field.name),
                choices=tuple(choices) if choices else None,
                metavar=None if choices else field.name.upper(),  # argparse shows the choices
            )
        added.append(field.name)
    return added


def config_flags_set(args: argparse.Namespace, config_class: type) -> dict[str, Any]:
    """The fields of `config_class` whose flags were given on the command line."""
    names = {field.name for field in dataclasses.fields(config_class)}
    return {
        name: value for name, value in vars(args).items() if name in names and value is not None
    }


def attribute_docs(config_class: type) -> dict[str, str]:
    """Field name → its description in the class docstring's `Attributes:` section."""
    docs: dict[str, str] = {}
    lines = inspect.cleandoc(config_class.__doc__ or "").splitlines()
    try:
        start = lines.index("Attributes:") + 1
    except ValueError:
        return docs
    name, indent = None, None
    for line in lines[start:]:
        if not line.strip():
            continue
        match = _ATTRIBUTE.match(line)
        if match and (indent is None or len(match.group(1)) == indent):
            indent = len(match.group(1))
            name = match.group(2)
            docs[name] = match.group(3).strip()
        elif name is not None and indent is not None and len(line) - len(line.lstrip()) > indent:
            docs[name] += " " + line.strip()
        else:
            break  # the section ended
    return docs


def _scalar_type(annotation: Any) -> type | None:
    """`int` for `int` and `int | None`, `str` for a `StrEnum` (its values are the choices);
    None for anything that is no scalar."""
    if annotation in _SCALARS:
        return annotation
    if isinstance(annotation, type) and issubclass(annotation, enum.StrEnum):
        return str
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(members) == 1 and members[0] in _SCALARS:
            return members[0]
    return None


def _parser_for(scalar: type, name: str) -> Callable[[str], Any]:
    if scalar is not float:
        return scalar

    def finite(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{name} must be a finite number, got {text}")
        return value

    return finite


def _default_of(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def _help(description: str, default: Any) -> str:
    text = description.replace("%", "%%")  # argparse formats help with %
    return f"{text} (default: {default})".strip()
