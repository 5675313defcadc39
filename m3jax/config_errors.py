"""How a bad M3Config value is reported: one ConfigError naming the field, the value and what is allowed."""

from __future__ import annotations

import math
from typing import Any


class ConfigError(ValueError):
    """An invalid or unsupported config value: names the field, the value and what is allowed."""


def is_int(v) -> bool:
    """An int that is not a bool (JSON's true would pass isinstance(v, int))."""
    return isinstance(v, int) and not isinstance(v, bool)


def field_error(field: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"config field {field!r} = {value!r} is not supported: expected {allowed}")


def as_float(v: int | float) -> float:
    """float(v), an int past float's range as inf (which validate() refuses), not an OverflowError traceback."""
    try:
        return float(v)
    except OverflowError:
        return math.inf
