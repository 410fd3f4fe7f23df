"""Per-record tensor statistics: min, max, mean, L2 norm, NaN/Inf/zero counts and a checksum.

Speed matters here: the capture hooks call this for every record. Measured on the 2-core CPU
(see DESIGN.md): `isnan().sum()` and `(x == 0).sum()` cost 15-40x a plain read, while aminmax,
float32 sum, norm, `count_nonzero` and a same-width integer sum of the raw bits run near memory
speed. So one pass of each cheap reduction runs over cache-sized chunks (the later passes then
read from cache), and NaN/+Inf/-Inf are counted only when min, max or the sum says they exist
(they propagate through all three). Sums are float32 for float32 data; on overflow the rare
path redoes them in float64.

Two entry points:
- `host_stats(t)` returns a dict at once (a host sync on CUDA: the sync writer's path).
- `device_stats(t)` returns the same values packed into one int64 tensor on t's device, with no
  host sync (the async writer's path on CUDA: the vector is copied to pinned memory on a side
  stream and decoded later by `decode_packed`). It counts NaN/Inf unconditionally, since
  deciding would need a sync.
"""
from __future__ import annotations

import math

import torch

STAT_FIELDS = ("min", "max", "mean", "norm", "nan", "posinf", "neginf", "zeros", "checksum")
_CHUNK = 1 << 18  # elements; 1 MiB of float32 fits in L2, so passes 2..5 read from cache
_NAN = float("nan")

# Signed integer of the element width, for the checksum over raw bits.
_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_DIRECT_FLOATS = (torch.float32, torch.float64)


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> "bfloat16" (the format's dtype column)."""
    return str(dtype).removeprefix("torch.")


def shape_str(shape) -> str:
    """(8, 128) -> "8,128"; () -> ""."""
    return ",".join(str(int(s)) for s in shape)


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


def _checksum(flat: torch.Tensor) -> int:
    bits_t, bits = _bits_view(flat)
    # summing in the element's own width wraps exactly like the format asks, and is 10x faster
    # on CPU than widening to int64
    n = bits_t.numel()
    if n <= _CHUNK:  # the common small record: no slicing ops
        return _wrap(int(bits_t.sum(dtype=bits_t.dtype)), bits)
    total = 0
    for i in range(0, n, _CHUNK):
        total += int(bits_t[i:i + _CHUNK].sum(dtype=bits_t.dtype))
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


def _flat(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    return t.reshape(-1)


def _counts(flat: torch.Tensor) -> tuple[int, int, int]:
    if flat.dtype.is_complex:
        parts = torch.view_as_real(flat)
        nan = int(parts.isnan().any(-1).sum())
        return nan, int((parts == math.inf).any(-1).sum()), int((parts == -math.inf).any(-1).sum())
    if not flat.dtype.is_floating_point:
        return 0, 0, 0
    nan = posinf = neginf = 0
    for i in range(0, flat.numel(), _CHUNK):
        c = flat[i:i + _CHUNK]
        if c.dtype not in _DIRECT_FLOATS:
            c = c.float()
        nan += int(c.isnan().sum())
        posinf += int((c == math.inf).sum())
        neginf += int((c == -math.inf).sum())
    return nan, posinf, neginf


def host_stats(t: torch.Tensor) -> dict:
    """Statistics of `t` as a dict with the keys of STAT_FIELDS (Python floats and ints)."""
    flat = _flat(t)
    n = flat.numel()
    if n == 0 or flat.device.type == "meta":
        return empty_stats()
    out = empty_stats()
    out["checksum"] = _checksum(flat)
    cdt = _compute_dtype(flat.dtype)
    if cdt is None:  # complex: counts only
        out["zeros"] = n - int(torch.count_nonzero(flat))
        out["nan"], out["posinf"], out["neginf"] = _counts(flat)
        return out
    lo, hi, total, sq, nonzero = math.inf, -math.inf, 0.0, 0.0, 0
    saw_nan = False
    for i in range(0, n, _CHUNK):
        c = flat[i:i + _CHUNK] if n > _CHUNK else flat
        if c.dtype != cdt:
            c = c.to(cdt)
        cmin, cmax = torch.aminmax(c)
        cmin, cmax = float(cmin), float(cmax)
        if cmin != cmin or cmax != cmax:
            saw_nan = True
        else:
            lo, hi = min(lo, cmin), max(hi, cmax)
        total += float(c.sum())
        sq += float(torch.linalg.vector_norm(c)) ** 2
        nonzero += int(torch.count_nonzero(c))
    out["zeros"] = n - nonzero
    finite = not saw_nan and math.isfinite(lo) and math.isfinite(hi)
    if finite and not (math.isfinite(total) and math.isfinite(sq)):
        # every element is finite but float32 overflowed: redo the sums wide (rare)
        total, sq = 0.0, 0.0
        for i in range(0, n, _CHUNK):
            c = flat[i:i + _CHUNK].to(torch.float64)
            total += float(c.sum())
            sq += float(c.square().sum())
    if not finite:
        out["nan"], out["posinf"], out["neginf"] = _counts(flat)
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
    return out
