"""Per-record tensor statistics: min, max, mean, L2 norm, NaN/Inf/zero counts and a checksum.

Speed matters here: the capture hooks call this for every record. float32, bfloat16 and
float16 on CPU (and integers and bool, in a scalar pass) go through the statistics kernel,
`tracer.storage._stats_kernel`, a small C extension (tracer/storage/_stats_kernel.c, built by
setup.py where a C compiler exists) that reads the tensor once and computes every statistic in
that pass (with the GIL released from 64K elements), at 3-4x the speed of the numpy path
(benchmarks/RESULTS.md). Without the kernel, and for other dtypes, `numpy_host_stats`
(tracer.storage._numpy_stats) runs cheap reductions. A transposed or permuted tensor whose
elements fill a dense span is read in memory order, without a copy (both paths).

The two paths agree exactly on min, max, counts and checksum, and to float rounding on mean and
norm; one process always uses the same path, so the sync and async writers agree to the bit.

Entry points:
- `host_stats(t)`: CPU tensors, a dict at once (both writers; the async one calls it in its
  writer thread on the snapshot; the result does not depend on the chunk size).
- `copy_stats(dst, src)` and `difference_stats(a, b, out)`: the kernel's one-pass forms for the
  parameter records (a copy, or the update `a - b`, and its statistics in the same pass, while
  each chunk is in cache); None where the kernel cannot, and the caller uses torch.
- `device_stats(t)` (tracer.storage._device_stats): CUDA tensors, the same values packed into
  one int64 tensor on the device, with no host sync, decoded by `decode_packed`.

The paths share the statistics' fields and the dtype and shape columns' text
(tracer.storage._stat_fields) and how a tensor's elements are read (tracer.storage._elements).
"""
from __future__ import annotations

import math
from typing import Any

import torch

from tracer.storage._elements import _flat, _wrap, memory_span
from tracer.storage._numpy_stats import numpy_host_stats
from tracer.storage._stat_fields import _NAN, empty_stats

_STRIDED = torch.strided

try:  # the optional one-pass C kernel (setup.py builds it where a C compiler exists)
    from tracer.storage import _stats_kernel as _kernel
except ImportError:
    _kernel = None
# dtype -> the kernel's dtype code for every one-pass form (copies, differences)
_COPY_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# the dtypes `stats` alone takes besides those: integers and bool in one scalar pass (their
# numpy path cost ~35 us for 512 token ids, 150 us in a training step with cold caches)
_STATS_CODES = {**_COPY_CODES, torch.int64: 3, torch.int32: 4, torch.int16: 5, torch.int8: 6,
                torch.uint8: 7, torch.bool: 7}
# the checksum's width in bits by kernel code (see element_bits)
_CODE_BITS = (32, 16, 16, 64, 32, 16, 8, 8)


def host_stats(t: torch.Tensor, *, blocks_per_op: int = 8) -> dict:
    """Statistics of `t` as a dict with the keys of STAT_FIELDS (Python floats and ints).

    float32, bfloat16, float16, the signed integers, uint8 and bool go through the one-pass C
    kernel when it was built (`kernel_available()`); everything else (float64, complex, fp8),
    or every dtype without the kernel, through `numpy_host_stats`.
    """
    code = _STATS_CODES.get(t.dtype) if _kernel is not None else None
    if code is not None and t.is_cpu and t.layout == torch.strided and t.is_contiguous() \
            and not t.is_neg():
        # the common record: straight to the kernel, no detach or reshape (~2 us saved)
        n = t.numel()
        return _kernel_stats(t, n, code) if n else empty_stats()
    t = t.detach()
    span = memory_span(t)  # a transpose or permutation: its memory, in memory order
    if span is None and code is not None and code <= 2 and _strided is not None and t.is_cpu \
            and t.layout == torch.strided and not t.is_neg() and not t.is_conj() \
            and 0 < t.numel() < _STRIDED_MAX and t.dim() <= 16:
        # gaps or overlaps (a split's q, k, v; an expand): the kernel reads it with its strides,
        # which gives the statistics of its C-order copy to the bit, without the copy
        n = t.numel()
        return _kernel_dict(_strided(t.data_ptr(), n, code, t.shape, t.stride()), n, code)
    flat = span if span is not None else _flat(t)
    n = flat.numel()
    if n == 0 or flat.is_meta:
        return empty_stats()
    if code is not None and flat.is_cpu:
        return _kernel_stats(flat, n, code)
    return numpy_host_stats(flat, blocks_per_op=blocks_per_op)


def kernel_available() -> bool:
    """True when the one-pass C kernel (tracer/storage/_stats_kernel.c) was built and is in use."""
    return _kernel is not None


_STRIDED_MAX = 1 << 20  # elements; a larger strided tensor is copied
# the kernel's strided pass (None from a build older than its sources: the copy is taken)
_strided = getattr(_kernel, "strided_stats", None)


def _kernel_stats(flat: torch.Tensor, n: int, code: int) -> dict:
    """host_stats through the C kernel; `flat` is a contiguous CPU tensor of `n` elements."""
    return _kernel_dict(_kernel.stats(flat.data_ptr(), n, code), n, code)


def _kernel_dict(result: tuple, n: int, code: int) -> dict:
    """The stats dict of a kernel result tuple over `n` elements of dtype `code`."""
    mn, mx, total, sq, zeros, nan, posinf, neginf, checksum = result
    if nan:
        mn = mx = mean = norm = _NAN
    else:
        mean, norm = total / n, math.sqrt(sq)
    return {"min": mn, "max": mx, "mean": mean, "norm": norm, "nan": nan, "posinf": posinf,
            "neginf": neginf, "zeros": zeros,
            "checksum": _wrap(checksum, _CODE_BITS[code])}


def _plain_cpu(*tensors: torch.Tensor) -> bool:
    """True when every tensor is a contiguous, non-empty CPU tensor whose memory holds its
    values, all of one dtype and shape (what the kernel's copy and difference read and write)."""
    first = tensors[0]
    dtype, shape = first.dtype, first.shape
    for t in tensors:
        if not (t.is_cpu and t.layout == _STRIDED and t.is_contiguous() and not t.is_neg()
                and t.dtype == dtype and t.shape == shape):
            return False
    return first.numel() > 0


def copy_stats(dst: torch.Tensor, src: torch.Tensor) -> dict | None:
    """Copy `src` into `dst` and return the statistics of the copy, in one pass over memory
    (`host_stats(dst)` exactly); None, with nothing copied, where the kernel cannot: not
    built, a dtype other than float32/bfloat16/float16, or not two contiguous CPU tensors of
    one dtype and shape. The copy bypasses torch: `dst`'s version counter is not bumped."""
    code = _COPY_CODES.get(src.dtype) if _kernel is not None else None
    if code is None or not _plain_cpu(dst, src):
        return None
    n = src.numel()
    return _kernel_dict(_kernel.copy_stats(dst.data_ptr(), src.data_ptr(), n, code),
                       n, code)


def copy_stats_into(dst: Any, src_address: int, count: int, dtype: torch.dtype) -> dict | None:
    """`copy_stats` from a raw host address into a writable buffer (a uint8 numpy array of at
    least `count` elements' bytes): copy `count` elements of `dtype` from `src_address` and
    return the copy's statistics, or None, with nothing copied, where the kernel cannot (not
    built, or a dtype other than float32, bfloat16, float16). The caller vouches for the
    source range (the snapshot path, whose checks are done)."""
    code = _COPY_CODES.get(dtype) if _kernel is not None else None
    if code is None or count <= 0:
        return None
    return _kernel_dict(_kernel.copy_stats_into(dst, src_address, count, code),
                       count, code)


def difference_stats(a: torch.Tensor, b: torch.Tensor,
                     out: torch.Tensor | None = None) -> dict | None:
    """The statistics of the float32 difference `a - b` (`host_stats(a - b)` exactly), in one
    pass over `a` and `b`; the difference is written to `out` when given (`out` may be `a`
    or `b`; its version counter is not bumped). None, with nothing written, where the kernel
    cannot: not built, not float32, or not contiguous CPU tensors of one shape."""
    tensors = (a, b) if out is None else (a, b, out)
    if _kernel is None or a.dtype != torch.float32 or not _plain_cpu(*tensors):
        return None
    n = a.numel()
    result = _kernel.diff_stats(a.data_ptr(), b.data_ptr(), 0 if out is None else out.data_ptr(),
                               n)
    return _kernel_dict(result, n, 0)
