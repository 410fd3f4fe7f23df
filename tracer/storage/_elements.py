"""A tensor's elements as the statistics read them: in memory order where they fill a dense
block (`memory_span`), as signed integers of their width for the checksum (`_bits_view`, wrapped
by `_wrap`), and in the dtype their sums and extremes are computed in (`_compute_dtype`).
"""
from __future__ import annotations

import torch

from tracer.storage._layout import dense_strides

# Signed integer of the element width, for the checksum over raw bits.
_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_DIRECT_FLOATS = (torch.float32, torch.float64)


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
