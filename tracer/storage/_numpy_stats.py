"""Statistics with torch and numpy reductions only: `numpy_host_stats`, the path for any dtype
where the C kernel is not built or does not take it (tracer.storage._stats).

Measured on the 2-core CPU (see docs/architecture.md): `isnan().sum()` and `(x == 0).sum()` cost
15-40x a plain read, while numpy's min and max, torch's float32 sum and norm, and a same-width
integer sum of the raw bits run near memory speed. So one pass of each cheap reduction runs over
cache-sized chunks (the later passes then read from cache); zeros are counted only when 0 lies in
[min, max], and NaN/+Inf/-Inf only when min, max or the sum says they exist (they propagate
through all three). Sums are float32 for float32 data, per fixed block and combined exactly; on
overflow the rare path redoes them in float64.
"""
from __future__ import annotations

import math
import threading

import numpy as np
import torch

from tracer.storage._elements import _DIRECT_FLOATS, _bits_view, _compute_dtype, _flat, _wrap
from tracer.storage._stat_fields import _NAN, empty_stats

# Float sums are taken per block of _BLOCK elements (torch's parallel grain size, 128 KiB of
# float32): one op over one block runs on one thread. Several blocks per op by default, since
# 1 MiB of float32 still fits in L2 and the later passes then read from cache.
_BLOCK = 1 << 15


def _checksum(flat: torch.Tensor, chunk: int) -> int:
    bits_t, bits = _bits_view(flat)
    # summing in the element's own width wraps exactly like the format asks, and is 10x faster
    # on CPU than widening to int64
    n = bits_t.numel()
    if n <= chunk:  # the common small record: no slicing ops
        return _wrap(int(bits_t.sum(dtype=bits_t.dtype)), bits)
    total = 0
    for i in range(0, n, chunk):
        total += int(bits_t[i:i + chunk].sum(dtype=bits_t.dtype))
    return _wrap(total, bits)


def _counts(flat: torch.Tensor, chunk: int) -> tuple[int, int, int]:
    if flat.dtype.is_complex:
        parts = torch.view_as_real(flat)
        nan = int(parts.isnan().any(-1).sum())
        return nan, int((parts == math.inf).any(-1).sum()), int((parts == -math.inf).any(-1).sum())
    if not flat.dtype.is_floating_point:
        return 0, 0, 0
    nan = posinf = neginf = 0
    for i in range(0, flat.numel(), chunk):
        c = flat[i:i + chunk]
        if c.dtype not in _DIRECT_FLOATS:
            c = c.float()
        nan += int(c.isnan().sum())
        posinf += int((c == math.inf).sum())
        neginf += int((c == -math.inf).sum())
    return nan, posinf, neginf


def _block_sums(c: torch.Tensor, sums: list[float], norms: list[float]) -> None:
    """Append the sum and L2 norm of each _BLOCK-element block of `c` (the last may be short).

    Summation order is fixed per block (full blocks as rows of one 2-D reduction, a short last
    block as one 1-D reduction), and blocks are combined with math.fsum (exact), so the result
    does not depend on how many blocks one call covers: the sync writer (big chunks) and the
    async writer thread (one block per op, so its kernels stay single-threaded) agree to the
    bit.
    """
    k = c.numel() // _BLOCK
    if k:
        rows = c[:k * _BLOCK].view(k, _BLOCK)
        sums += rows.sum(1).tolist()
        norms += torch.linalg.vector_norm(rows, dim=1).tolist()
    if c.numel() % _BLOCK:
        tail = c[k * _BLOCK:] if k else c
        sums.append(float(tail.sum()))
        norms.append(float(torch.linalg.vector_norm(tail)))


def _exact_sum(values: list[float]) -> float:
    try:
        return math.fsum(values)
    except ValueError:  # +inf and -inf
        return _NAN


_scratch = threading.local()


def _zeros_in(a: np.ndarray) -> int:
    """Elements of `a` equal to zero (+0 and -0). `np.equal` into a reused bool buffer and
    numpy's vectorised bool count run at ~4x the speed of `torch.count_nonzero` here."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.size < a.size:
        buf = _scratch.buf = np.empty(max(a.size, _BLOCK), dtype=np.bool_)
    view = buf[:a.size]
    np.equal(a, 0, out=view)
    return int(np.count_nonzero(view))


def numpy_host_stats(t: torch.Tensor, *, blocks_per_op: int = 8) -> dict:
    """`host_stats` with torch and numpy reductions only (any dtype; no C kernel needed).

    `blocks_per_op` sets how many elements one torch call reduces (x _BLOCK): 1 keeps every
    kernel below torch's parallel grain size, for a background thread that should not compete
    with the training thread's thread pool. The result is the same for every value.
    """
    flat = _flat(t)
    n = flat.numel()
    if n == 0 or flat.is_meta:
        return empty_stats()
    chunk = _BLOCK * max(1, blocks_per_op)
    out = empty_stats()
    out["checksum"] = _checksum(flat, chunk)
    cdt = _compute_dtype(flat.dtype)
    if cdt is None:  # complex: counts only
        out["zeros"] = n - int(torch.count_nonzero(flat))
        out["nan"], out["posinf"], out["neginf"] = _counts(flat, chunk)
        return out
    lo, hi, zeros = math.inf, -math.inf, 0
    sums: list[float] = []
    norms: list[float] = []
    saw_nan = False
    for i in range(0, n, chunk):
        c = flat[i:i + chunk] if n > chunk else flat
        if c.dtype != cdt:
            c = c.to(cdt)
        a = c.numpy()
        # numpy's min and max (two vectorised passes over a cached chunk) beat torch.aminmax
        # by 2x here; both propagate NaN, and min/max are exact, so any method gives the same
        cmin, cmax = float(a.min()), float(a.max())
        if cmin != cmin or cmax != cmax:
            saw_nan = True
        else:
            lo, hi = min(lo, cmin), max(hi, cmax)
        _block_sums(c, sums, norms)
        if not (cmin > 0 or cmax < 0):  # a zero is possible only when 0 is in [min, max]
            zeros += _zeros_in(a)
    out["zeros"] = zeros
    finite = not saw_nan and math.isfinite(lo) and math.isfinite(hi)
    total = _exact_sum(sums)
    sq = _exact_sum([v * v for v in norms])
    if finite and not (math.isfinite(total) and math.isfinite(sq)):
        # every element is finite but a float32 block sum overflowed: redo wide (rare)
        sums, norms = [], []
        for i in range(0, n, chunk):
            _block_sums(flat[i:i + chunk].to(torch.float64), sums, norms)
        total, sq = _exact_sum(sums), _exact_sum([v * v for v in norms])
    if not finite:
        out["nan"], out["posinf"], out["neginf"] = _counts(flat, chunk)
        if out["nan"]:
            lo = hi = _NAN
    out["min"], out["max"] = lo, hi
    out["mean"] = total / n if not saw_nan else _NAN
    out["norm"] = math.sqrt(sq) if not saw_nan else _NAN
    return out
