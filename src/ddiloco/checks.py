"""Validation of settings: one wording for every "this value is invalid" error.

Every config dataclass, command and plan file says what is wrong the same way:
`field=value is invalid: expected what`, naming the field as the user wrote it (a flag, a YAML key or a
dataclass field). The checks raise ValueError and never clamp or guess.
"""

from __future__ import annotations

import math
from typing import Any


def invalid(field: str, value: Any, expected: str) -> ValueError:
    """The error for `field` holding `value` where `expected` was wanted (raise it)."""
    return ValueError(f"{field}={value!r} is invalid: expected {expected}")


def require(condition: bool, field: str, value: Any, expected: str) -> None:
    """Raise `invalid(field, value, expected)` unless `condition` holds."""
    if not condition:
        raise invalid(field, value, expected)


def require_choice(field: str, value: Any, choices: tuple[str, ...]) -> None:
    """`value` must be one of `choices`."""
    require(value in choices, field, value, "one of " + ", ".join(choices))


def require_int(name: str, value: Any, *, minimum: int) -> None:
    """`value` must be an int >= minimum (bool is an int subclass, but True as a count is a bug, not a 1)."""
    require(isinstance(value, int) and not isinstance(value, bool) and value >= minimum, name, value,
            f"an integer >= {minimum}")


def is_number(value: Any) -> bool:
    """A finite int or float that is not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def require_at_least(field: str, value: Any, low: float, unit: str = "") -> None:
    """`value` must be a finite number >= low."""
    require(is_number(value) and value >= low, field, value,
            f"a finite number >= {low:g}" + (f" ({unit})" if unit else ""))


def require_positive(field: str, value: Any, unit: str = "") -> None:
    """`value` must be a finite number > 0."""
    require(is_number(value) and value > 0, field, value, "a finite number > 0" + (f" ({unit})" if unit else ""))
