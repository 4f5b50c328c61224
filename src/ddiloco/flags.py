"""Command-line flags generated from config dataclasses: one helper for every command.

Each field of a frozen config dataclass becomes `--field-name` (with an optional prefix), typed from
the field's default and documented by the field's docstring when the class carries one; the parsed
namespace is turned back into the config, whose `__post_init__` validates it.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
from typing import Any, TypeVar

T = TypeVar("T")


def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (the string literal right after a field) of a dataclass, by field name."""
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


def _dest(prefix: str, name: str) -> str:
    return f"{prefix}{name}"


def add_config_flags(parser: argparse.ArgumentParser, cls: type, *, prefix: str = "",
                     skip: tuple[str, ...] = (), title: str | None = None) -> None:
    """Add one flag per field of `cls`, defaulting to None so unset flags keep the config default."""
    group = parser.add_argument_group(title or cls.__name__)
    docs = field_docs(cls)
    for field in dataclasses.fields(cls):
        if field.name in skip:
            continue
        default = field.default
        flag = "--" + (prefix + field.name).replace("_", "-")
        help_text = f"{docs.get(field.name, '')} (default: {default})".strip()
        kwargs: dict[str, Any] = {"dest": _dest(prefix, field.name), "default": None,
                                  "help": help_text.replace("%", "%%")}
        if isinstance(default, bool):
            kwargs["action"] = argparse.BooleanOptionalAction
        elif isinstance(default, int | float | str):
            kwargs["type"] = type(default)
            kwargs["metavar"] = type(default).__name__.upper()
        else:
            continue
        group.add_argument(flag, **kwargs)


def config_from_args(cls: type[T], args: argparse.Namespace, *, prefix: str = "", **overrides: Any) -> T:
    """Build `cls` from the flags set on the command line (unset flags keep the defaults)."""
    values = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        value = getattr(args, _dest(prefix, field.name), None)
        if value is not None:
            values[field.name] = value
    values.update(overrides)
    return cls(**values)
