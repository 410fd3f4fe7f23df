"""Statistics of a device tensor packed into one int64 vector, and that vector decoded.

`device_stats(t)`: CUDA tensors, the values of `host_stats` packed into one int64 tensor on the
device, with no host sync (the vector is copied to pinned memory, on a side stream for the async
writer, and decoded by `decode_packed`). It counts NaN/Inf unconditionally, since deciding would
need a sync; and it sums in float64. Float32, bfloat16 and float16 take two Triton kernels
(`tracer.storage._cuda_stats`) where Triton is there, other dtypes torch ops.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from tracer.storage._cuda_stats import packed_stats
from tracer.storage._elements import _INT_OF_WIDTH, _bits_view, _compute_dtype, _flat, _wrap
from tracer.storage._stat_fields import _NAN, STAT_FIELDS


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
