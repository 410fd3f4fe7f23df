"""Numeric headroom of one record, read from its statistics row alone (never its bytes): how many
powers of two its values may still grow before its dtype overflows, how far its largest value
sits above the dtype's smallest normal, and what the row can say about the smallest values.

The row holds min, max, mean, L2 norm, numel and the NaN/+Inf/-Inf/zero counts. From them:

- max |x| = max(|min|, |max|) exactly, so the overflow headroom log2(finfo.max) - log2(max |x|)
  is exact (to the statistics' float64);
- the share of exact zeros is exact, but not why they are zero: values that underflowed look
  the same as a ReLU's or a mask's zeros;
- the smallest nonzero |x| is not recorded. It is known only when every element is nonzero and
  of one sign (it is then |min| or |max|); otherwise the row bounds it from above: it is at most
  the RMS of the nonzero elements (norm / sqrt(numel - zeros)), and for one-signed data at most
  their mean. A bound from above on the smallest value is a bound from above on its distance to
  the smallest normal: the smallest value is at least that close to underflowing, maybe closer.

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


def record_headroom(row: dict[str, Any]) -> dict[str, Any] | None:
    """The headroom of one statistics row (a dict with the /records columns), or None for a
    non-float dtype or an empty record.

    Keys:
        dtype, max_abs
        overflow_bits: log2(finfo.max) - log2(max |x|), see `overflow_bits`
        underflow_bits: log2(max |x|) - log2(finfo.tiny): how many halvings of the *largest*
            value before every element is subnormal or zero (inf for an all-zero record: no
            value left to lose; None when max |x| is not finite)
        zero_share: zeros / numel (exact zeros, whatever made them)
        smallest_bits: log2(smallest nonzero |x|) - log2(finfo.tiny) where the row pins it,
            else an upper bound of it (see the module doc); None when no nonzero finite value
            exists or the bound is not measurable (a norm that underflowed in the sums)
        smallest_exact: whether smallest_bits is exact rather than a bound from above
        nonfinite: NaN + Inf count
    """
    logs = _LOG2_RANGES.get(str(row.get("dtype")))
    numel = int(row.get("numel", 0))
    if logs is None or not numel:
        return None
    log_tiny = logs[1]
    zeros = int(row.get("zeros", 0))
    bad = int(row.get("nan", 0)) + int(row.get("posinf", 0)) + int(row.get("neginf", 0))
    lo, hi = float(row.get("min", math.nan)), float(row.get("max", math.nan))
    m = max_abs(row)
    over = overflow_bits(row)
    under = (None if not math.isfinite(m) else math.inf if m == 0 else math.log2(m) - log_tiny)
    smallest, exact = None, False
    nonzero = numel - zeros
    if not bad and nonzero and math.isfinite(m) and m > 0:
        if lo > 0 or hi < 0:  # one sign, no zero: the smallest magnitude is an extreme
            smallest, exact = (lo if lo > 0 else -hi), True
        else:
            bound = float(row.get("norm", math.nan)) / math.sqrt(nonzero)
            if lo >= 0 or hi <= 0:  # one-signed with zeros: the mean of the nonzeros is tighter
                mean_nz = abs(float(row.get("mean", math.nan))) * numel / nonzero
                if math.isfinite(mean_nz) and mean_nz > 0:
                    bound = min(bound, mean_nz)
            smallest = bound if math.isfinite(bound) and bound > 0 else None
    return {"dtype": str(row.get("dtype")), "max_abs": m, "overflow_bits": over,
            "underflow_bits": under, "zero_share": zeros / numel,
            "smallest_bits": None if smallest is None else math.log2(smallest) - log_tiny,
            "smallest_exact": exact, "nonfinite": bad}
