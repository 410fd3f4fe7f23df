"""The real floating dtypes' ends, and how far one statistics row's largest value sits below its
dtype's largest: shared by the watch conditions (tracer._watch_config), checked live while
recording, and the headroom reports of `tracer.analysis`.

No torch here: the dtype ranges are a table (tests check it against torch.finfo), so the
watchpoints and `sleuth check --headroom` run where the reader runs.
"""
from __future__ import annotations

import math
from typing import Any

FLOAT_RANGES: dict[str, tuple[float, float]] = {
    # dtype column -> (largest finite value, smallest normal): torch.finfo(dtype).max and .tiny
    "float64": (1.7976931348623157e308, 2.2250738585072014e-308),
    "float32": (3.4028234663852886e38, 1.1754943508222875e-38),
    "bfloat16": (3.3895313892515355e38, 1.1754943508222875e-38),
    "float16": (65504.0, 6.103515625e-05),
    "float8_e4m3fn": (448.0, 0.015625),
    "float8_e4m3fnuz": (240.0, 0.0078125),
    "float8_e5m2": (57344.0, 6.103515625e-05),
    "float8_e5m2fnuz": (57344.0, 3.0517578125e-05),
    "float8_e8m0fnu": (1.7014118346046923e38, 5.877471754111438e-39),
}
"""The real floating dtypes a dump names. Integers and bool cannot overflow into Inf or underflow
(they wrap or saturate silently, which no statistic shows) and complex rows carry no min/max, so
they have no headroom."""

_LOG2_RANGES = {k: (math.log2(hi), math.log2(lo)) for k, (hi, lo) in FLOAT_RANGES.items()}


def log2_range(dtype: str) -> tuple[float, float] | None:
    """(log2 largest finite, log2 smallest normal), None for non-float dtypes."""
    return _LOG2_RANGES.get(str(dtype))


def max_abs(row: dict[str, Any]) -> float:
    """max |x| of a row: inf when it holds an infinity, NaN when it holds a NaN (min and max are
    NaN then) or no element."""
    return max(abs(float(row.get("min", math.nan))), abs(float(row.get("max", math.nan))))


def overflow_bits(row: dict[str, Any]) -> float | None:
    """log2(finfo.max) - log2(max |x|): how many doublings of its largest value the record's
    dtype still holds. inf for an all-zero record, -inf for one holding an infinity, None for a
    non-float dtype, an empty record, or one holding a NaN (nothing to measure: `nan_inf`)."""
    logs = _LOG2_RANGES.get(str(row.get("dtype")))
    if logs is None or not int(row.get("numel", 0)):
        return None
    m = max_abs(row)
    if math.isnan(m):
        return None
    if m == 0:
        return math.inf
    return -math.inf if math.isinf(m) else logs[0] - math.log2(m)
