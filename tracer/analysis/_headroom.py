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

No torch here: the dtype ranges and the overflow headroom are tracer._dtype_ranges' (shared with
the watch conditions), so `sleuth check --headroom` runs where the reader runs.
"""
from __future__ import annotations

import math
from typing import Any

from tracer._dtype_ranges import log2_range, max_abs, overflow_bits


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
    logs = log2_range(str(row.get("dtype")))
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
