"""Command-line flags generated from config dataclasses: one helper for every command.

Each field of a frozen config dataclass becomes `--field-name` (with an optional prefix), typed from
the field's annotation and documented by the field's docstring when the class carries one; the parsed
namespace is turned back into the config, whose `__post_init__` validates it. A field declared with
`setting(...)` may carry its own flag name, metavar and choices; a field without a default is a required
flag; an optional field (`str | None = None`) takes a value of its inner type.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import math
import textwrap
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")

SCALARS = (bool, int, float, str)
"""The field types that become flags; a field of any other type (a nested config) is not a flag."""
FLAG, METAVAR, CHOICES = "flag", "metavar", "choices"
"""Keys of a field's metadata (`setting(...)`) read here."""


def setting(default: Any = dataclasses.MISSING, *, flag: str | None = None, metavar: str | None = None,
            choices: tuple[str, ...] | None = None) -> Any:
    """A dataclass field with how its flag is spelled: `flag` ("--learners" for `num_learners`), `metavar`
    ("HOST:PORT"), `choices`. No default: the flag is required."""
    metadata = {key: value for key, value in ((FLAG, flag), (METAVAR, metavar), (CHOICES, choices))
                if value is not None}
    return dataclasses.field(default=default, metadata=metadata)


def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (the string literal right after a field) of a dataclass and its bases, by field name."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            docs.update(_own_field_docs(klass))
    return docs


def _own_field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings written in `cls`'s own class body."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    docs: dict[str, str] = {}
    body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
    for node, following in zip(body, body[1:], strict=False):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


@functools.cache
def field_types(cls: type) -> dict[str, tuple[type | None, bool]]:
    """Field name -> (its scalar type, or None when the field is not a flag; whether None is allowed)."""
    hints = typing.get_type_hints(cls)
    types_: dict[str, tuple[type | None, bool]] = {}
    for field in dataclasses.fields(cls):
        annotation = hints[field.name]
        optional = False
        if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
            members = [a for a in typing.get_args(annotation) if a is not type(None)]
            optional = len(members) < len(typing.get_args(annotation))
            annotation = members[0] if len(members) == 1 else None
        types_[field.name] = (annotation if annotation in SCALARS else None, optional)
    return types_


def required(field: dataclasses.Field) -> bool:
    return field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING


def flag_of(field: dataclasses.Field, prefix: str = "") -> str:
    """The command-line flag of a field: its own (`setting(flag=...)`) or `--prefix-field-name`."""
    return field.metadata.get(FLAG) or "--" + (prefix + field.name).replace("_", "-")


def flag_fields(cls: type, *, prefix: str = "", skip: tuple[str, ...] = (),
                only: tuple[str, ...] | None = None) -> dict[str, dataclasses.Field]:
    """The fields of `cls` that are flags, by flag."""
    kinds = field_types(cls)
    return {flag_of(f, prefix): f for f in dataclasses.fields(cls)
            if kinds[f.name][0] is not None and f.name not in skip and (only is None or f.name in only)}


def _dest(prefix: str, name: str) -> str:
    return f"{prefix}{name}"


def whole_number(text: str) -> int:
    """An integer flag's value: `1000`, or one written with an exponent or a point that is still whole (`1e21`,
    `1.2e6`, `600.0`), as the numbers the docs quote are; `1.5` is refused. Exact for any `int(text)` can read."""
    try:
        return int(text)
    except ValueError:
        value = float(text)  # a ValueError here is argparse's "invalid int value"
        if not math.isfinite(value) or not value.is_integer():
            raise ValueError(f"{text!r} is not a whole number") from None
        return int(value)


whole_number.__name__ = "int"  # argparse names the type in its refusal: "invalid int value: '1.5'"


def add_config_flags(parser: argparse.ArgumentParser, cls: type, *, prefix: str = "",
                     skip: tuple[str, ...] = (), only: tuple[str, ...] | None = None, title: str | None = None,
                     keep_defaults: bool = False, enforce_required: bool = True) -> None:
    """Add one flag per scalar field of `cls`. Unset flags default to None, so that they keep the config's (or a
    settings file's) value; `keep_defaults` puts the field's own default in the namespace instead. A field without
    a default is a required flag, unless `enforce_required` is off (a settings file may give it instead)."""
    group = parser.add_argument_group(title or cls.__name__)
    docs = field_docs(cls)
    kinds = field_types(cls)
    for flag, field in flag_fields(cls, prefix=prefix, skip=skip, only=only).items():
        kind, _ = kinds[field.name]
        default = field.default
        suffix = "(required)" if required(field) else "" if default is None else f"(default: {default})"
        help_text = f"{docs.get(field.name, '')} {suffix}".strip()
        kwargs: dict[str, Any] = {"dest": _dest(prefix, field.name), "help": help_text.replace("%", "%%"),
                                  "default": default if keep_defaults and not required(field) else None}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = whole_number if kind is int else kind
            kwargs["metavar"] = field.metadata.get(METAVAR) or kind.__name__.upper()  # type: ignore[union-attr]
            if CHOICES in field.metadata:
                kwargs["choices"] = field.metadata[CHOICES]
        if required(field) and enforce_required:
            kwargs["required"] = True
        group.add_argument(flag, **kwargs)


def flag_values(cls: type, args: argparse.Namespace, *, prefix: str = "") -> dict[str, Any]:
    """The fields of `cls` set on the command line (a flag left out is None in the namespace, and absent here)."""
    values = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        value = getattr(args, _dest(prefix, field.name), None)
        if value is not None:
            values[field.name] = value
    return values


def config_from_args(cls: type[T], args: argparse.Namespace, *, prefix: str = "", **overrides: Any) -> T:
    """Build `cls` from the flags set on the command line (unset flags keep the defaults)."""
    return cls(**{**flag_values(cls, args, prefix=prefix), **overrides})


def as_flag_error(exc: ValueError, cls: type, *, prefix: str = "") -> ValueError:
    """'threads=0 is invalid: ...' -> '--threads=0 is invalid: ...': a config's error, named as the user wrote it."""
    message = str(exc)
    name, sep, rest = message.partition("=")
    by_name = {f.name: flag for flag, f in flag_fields(cls, prefix=prefix).items()}
    return ValueError(f"{by_name[name]}={rest}") if sep and name in by_name else exc
