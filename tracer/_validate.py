"""Validating one scalar config value by its field's annotation, for `DumpConfig` and
`WatchConfig` alike: the type, finiteness and range, in a message that names the key, the
value and what to use instead.

A module of its own because both configs need it and the dump config validates its watchpoints
with `WatchConfig`: kept in either, the two would import each other.
"""
from __future__ import annotations

import math
from typing import Any

from tracer._errors import ConfigError


def check_scalar(key: str, value: Any, annotation: Any,
                 bounds: tuple[float, float, str] | None = None) -> None:
    """Validate one bool/int/float config value by its field annotation (a string under
    `from __future__ import annotations`): the type, finiteness, and `bounds` (low, high, unit;
    else >= 0). Other annotations are left to their own checks."""
    kind = str(getattr(annotation, "__name__", annotation)).replace(" ", "")
    optional = kind.endswith("|None")
    kind = kind.removesuffix("|None")
    if kind not in ("bool", "int", "float") or (optional and value is None):
        return
    if kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return
    ok = (int,) if kind == "int" else (int, float)
    if isinstance(value, bool) or not isinstance(value, ok):
        what = "a whole number" if kind == "int" else "a number"
        raise ConfigError(f"{key}: expected {what}, got {value!r}")
    low, high, unit = bounds or (0, math.inf, "")
    unit = f" {unit}" if unit else ""
    if not math.isfinite(value) or not low <= value <= high:
        def num(x: float) -> str:
            return str(int(x)) if float(x).is_integer() else f"{x:g}"

        span = (f" from {num(low)} to {num(high)}{unit}" if math.isfinite(high)
                else f" >= {num(low)}{unit}" if math.isfinite(low) else "")
        raise ConfigError(f"{key}: {value!r} is out of range; use a finite number{span}")
