"""Per-record tensor statistics: min, max, mean, L2 norm, NaN/Inf/zero counts and a checksum.

Speed matters here: the capture hooks call this for every record. float32, bfloat16 and
float16 on CPU (and integers and bool, in a scalar pass) go through the statistics kernel,
`tracer.storage._stats_kernel`, a small C extension (tracer/storage/_stats_kernel.c, built by
setup.py where a C compiler exists) that reads the tensor once and computes every statistic in
that pass (with the GIL released from 64K elements), at 3-4x the speed of the numpy path below
(benchmarks/RESULTS.md).

Without the kernel, and for other dtypes, `numpy_host_stats` runs cheap reductions. Measured on
the 2-core CPU (see docs/architecture.md): `isnan().sum()` and `(x == 0).sum()` cost 15-40x a plain read,
while numpy's min and max, torch's float32 sum and norm, and a same-width integer sum of the raw
bits run near memory speed. So one pass of each cheap reduction runs over cache-sized chunks
(the later passes then read from cache); zeros are counted only when 0 lies in [min, max], and
NaN/+Inf/-Inf only when min, max or the sum says they exist (they propagate through all three).
Sums are float32 for float32 data, per fixed block and combined exactly; on overflow the rare
path redoes them in float64. A transposed or permuted tensor whose elements fill a dense span is
read in memory order, without a copy (both paths).

The two paths agree exactly on min, max, counts and checksum, and to float rounding on mean and
norm; one process always uses the same path, so the sync and async writers agree to the bit.

Entry points:
- `host_stats(t)`: CPU tensors, a dict at once (both writers; the async one calls it in its
  writer thread on the snapshot; the result does not depend on the chunk size).
- `copy_stats(dst, src)` and `difference_stats(a, b, out)`: the kernel's one-pass forms for the
  parameter records (a copy, or the update `a - b`, and its statistics in the same pass, while
  each chunk is in cache); None where the kernel cannot, and the caller uses torch.
- `device_stats(t)`: CUDA tensors, the same values packed into one int64 tensor on the device,
  with no host sync (the vector is copied to pinned memory, on a side stream for the async
  writer, and decoded by `decode_packed`). It counts NaN/Inf unconditionally, since deciding
  would need a sync; and it sums in float64. Float32, bfloat16 and float16 take two Triton
  kernels (`tracer.storage._cuda_stats`) where Triton is there, other dtypes torch ops.
"""
from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np
import torch

from tracer.storage._cuda_stats import packed_stats
from tracer.storage._layout import dense_strides

STAT_FIELDS = ("min", "max", "mean", "norm", "nan", "posinf", "neginf", "zeros", "checksum")
# Float sums are taken per block of _BLOCK elements (torch's parallel grain size, 128 KiB of
# float32): one op over one block runs on one thread. Several blocks per op by default, since
# 1 MiB of float32 still fits in L2 and the later passes then read from cache.
_BLOCK = 1 << 15
_NAN = float("nan")
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


# Signed integer of the element width, for the checksum over raw bits.
_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_DIRECT_FLOATS = (torch.float32, torch.float64)


_DTYPE_NAMES: dict[torch.dtype, str] = {}
_SHAPE_STRS: dict[tuple, str] = {}


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> "bfloat16" (the format's dtype column)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def shape_str(shape) -> str:
    """(8, 128) -> "8,128"; () -> "". Cached: a step repeats the same few shapes."""
    text = _SHAPE_STRS.get(shape)
    if text is None:
        text = ",".join(str(int(s)) for s in shape)
        if len(_SHAPE_STRS) < 65536:
            _SHAPE_STRS[tuple(shape)] = text
    return text


def empty_stats() -> dict:
    """The statistics of a tensor with no elements (or no order)."""
    return {"min": _NAN, "max": _NAN, "mean": _NAN, "norm": _NAN,
            "nan": 0, "posinf": 0, "neginf": 0, "zeros": 0, "checksum": 0}


def _wrap(value: int, bits: int) -> int:
    """Wrap an integer into a signed `bits`-bit integer (two's complement)."""
    value &= (1 << bits) - 1
    return value - (1 << bits) if value >> (bits - 1) else value


def _bits_view(flat: torch.Tensor) -> tuple[torch.Tensor, int]:
    """`flat` reinterpreted as signed integers of its element width, and that width in bits."""
    size = flat.element_size()
    if flat.dtype == torch.bool:
        return flat.view(torch.int8), 8
    if size in _INT_OF_WIDTH:
        return flat.view(_INT_OF_WIDTH[size]), size * 8
    # complex128 (16 bytes): sum its two 64-bit halves
    return flat.view(torch.int64), 64


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


def _compute_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The dtype statistics are computed in, or None when only counts make sense."""
    if dtype in _DIRECT_FLOATS:
        return dtype
    if dtype.is_complex:
        return None
    if dtype.is_floating_point:  # float16, bfloat16, float8 variants
        return torch.float32
    return torch.float64  # bool and integers: exact below 2**53


def dense_span(t: torch.Tensor) -> bool:
    """True when `t`'s elements fill exactly `numel` consecutive slots of its storage (a
    transpose or permutation of a contiguous tensor): it can be read in memory order without
    a copy."""
    return dense_strides(tuple(t.shape), t.stride())


def memory_span(t: torch.Tensor) -> torch.Tensor | None:
    """`t`'s elements as a 1-D view in memory order when they fill one dense block of CPU
    memory (contiguous, or a transpose or permutation of a dense block), else None. Statistics
    do not depend on element order (except the last bits of float sums), so they, the
    snapshots and the stored bytes all read such a tensor this way, without a strided copy.
    A conjugate or negative view is excluded: its memory does not hold its values."""
    if t.layout != torch.strided or not t.is_cpu or t.is_conj() or t.is_neg():
        return None
    if t.is_contiguous():
        return t.reshape(-1)
    if dense_span(t):
        return t.as_strided((t.numel(),), (1,), t.storage_offset())
    return None


def _flat(t: torch.Tensor) -> torch.Tensor:
    """`t` as a contiguous 1-D tensor: its memory span when it has one (see `memory_span`),
    else a copy in logical order (a strided copy cost more than all the statistics)."""
    t = t.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    span = memory_span(t)
    # reshape may return a view with stride 0 (an expanded scalar): readers of raw memory need
    # the elements laid out one after another
    return span if span is not None else t.reshape(-1).contiguous()


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


def element_bits(dtype: torch.dtype) -> int:
    """Width in bits of the integers the checksum sums for `dtype` (see `_bits_view`)."""
    size = dtype.itemsize
    return 8 if dtype == torch.bool else (size * 8 if size in _INT_OF_WIDTH else 64)


# float64 NaN as int64 bits, so packed vectors are filled without a host-to-device copy
_NAN_BITS = 0x7FF8000000000000


def device_stats(t: torch.Tensor) -> torch.Tensor:
    """STAT_FIELDS packed in one int64 tensor on t's device, without a host sync.

    Floats are stored as the bits of float64 values; decode with
    `decode_packed(values, element_bits(t.dtype))`. Nothing here copies from the host (a
    `torch.tensor(..., device="cuda")` would wait for the device), only kernels are queued.
    """
    flat = _flat(t)
    n = flat.numel()
    dev = flat.device
    i64, f64 = torch.int64, torch.float64
    if n == 0:
        packed = torch.zeros(9, dtype=i64, device=dev)
        packed[:4] = _NAN_BITS
        return packed
    if flat.is_cuda:
        packed = packed_stats(flat)  # two kernels where Triton is there, not about forty
        if packed is not None:
            return packed
    bits_t, _ = _bits_view(flat)
    cdt = _compute_dtype(flat.dtype)
    if cdt is None:
        nan_f = torch.full((4,), _NAN, dtype=f64, device=dev)
        parts = torch.view_as_real(flat)
        counts = torch.stack([parts.isnan().any(-1).sum(), (parts == math.inf).any(-1).sum(),
                              (parts == -math.inf).any(-1).sum(),
                              n - torch.count_nonzero(flat)])
    else:
        c = flat.to(cdt) if flat.dtype != cdt else flat
        mn, mx = torch.aminmax(c)
        # float64 accumulation: no overflow worries, and cheap on a GPU (slow on CPU, which
        # takes host_stats instead)
        total = c.sum(dtype=f64)
        norm = torch.linalg.vector_norm(c, dtype=f64)
        nan_f = torch.stack([mn.to(f64), mx.to(f64), total / n, norm])
        if flat.dtype.is_floating_point:
            counts = torch.stack([c.isnan().sum(), (c == math.inf).sum(), (c == -math.inf).sum(),
                                  n - torch.count_nonzero(c)])
            # min/max/mean/norm are NaN when any element is NaN (aminmax already propagates)
            nan_f = torch.where(counts[0] > 0, torch.full_like(nan_f, _NAN), nan_f)
        else:
            zero = torch.zeros((), dtype=i64, device=dev)
            counts = torch.stack([zero, zero, zero, n - torch.count_nonzero(c)])
    checksum = bits_t.sum(dtype=i64)  # widened: wrapped to the element width on decode
    return torch.cat([nan_f.view(i64), counts.to(i64), checksum.reshape(1)])


def decode_packed(values: list[int], bits: int) -> dict:
    """Turn a packed vector (as a list of Python ints) back into a stats dict; `bits` is
    `element_bits(dtype)` of the tensor it describes."""
    import struct

    floats = struct.unpack("<4d", struct.pack("<4q", *values[:4]))
    out = dict(zip(STAT_FIELDS[:4], floats))
    out.update(nan=values[4], posinf=values[5], neginf=values[6], zeros=values[7],
               checksum=_wrap(values[8], bits))
    if len(values) > 9:  # a sketch's float64 bits follow (tracer.storage._sampling)
        out["sketch"] = np.array(values[9:], dtype=np.int64).view(np.float64)
    return out
