"""How a bad M3Config value is reported: one ConfigError naming the field, the value and what is allowed."""

from __future__ import annotations

import math
from typing import Any


# What the compiled programs can hold: counts, sizes and ids are int32, values float32 (a config value past these
# failed inside jax or MLIR, or became inf or 0; `rl.config` checks its own fields against them too)
INT32_MAX = 2 ** 31 - 1
FLOAT32_MAX, FLOAT32_SMALLEST = 3.4028234663852886e38, 1.401298464324817e-45  # float32's largest; 2^-149


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
