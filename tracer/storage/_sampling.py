"""A record's sketch taken from a tensor (the rule and the format: tracer.storage._sketch).

On CPU the C kernel reads the sampled elements where they lie (`sample`, one call, no copy);
elsewhere (a device, a dtype the kernel does not read, no kernel) torch picks them with one
`index_select` over the tensor's memory, so a strided tensor is never copied whole. On a device
the index tensor is made once per shape, layout and device and the values stay there: the
writers copy them to the host with the statistics (`device_stats`), with no extra wait.
"""
from __future__ import annotations

import numpy as np
import torch

from tracer.storage import _sketch
from tracer.storage._layout import stored_extent
from tracer.storage._stats import _STATS_CODES, _kernel

_sample = getattr(_kernel, "sample", None)  # None: no kernel, or one built before `sample`
_diff_sample = getattr(_kernel, "diff_sample", None)
_FLOAT32 = torch.float32
_STRIDED = torch.strided
_INDEX: dict[tuple, torch.Tensor] = {}  # (shape, strides, device) -> the sampled offsets there
_INDEX_MAX = 4096


def _sampled(t: torch.Tensor) -> bool:
    """Whether `t` has a sketch: a strided tensor of real values with elements."""
    return t.layout is _STRIDED and not t.dtype.is_complex and t.numel() > 0


def sketch_of(t: torch.Tensor) -> np.ndarray | None:
    """The sketch of `t`'s values (SKETCH_SIZE float64, NaN-padded), or None where it has none:
    no elements, a meta tensor, complex values, or not a strided tensor."""
    if t.is_meta or not _sampled(t):
        return None
    if t.is_cpu and _sample is not None and not t.is_neg():
        code = _STATS_CODES.get(t.dtype)
        if code is not None:
            where = _sketch.offsets(tuple(t.shape), t.stride())
            return np.frombuffer(_sample(t.data_ptr(), code, where), dtype=np.float64)
    values = device_sample(t)
    return values.cpu().numpy()


def device_sample(t: torch.Tensor) -> torch.Tensor:
    """The sketch of `t` as a float64 tensor on `t`'s device (NaN-padded), made by kernels
    queued there; the host waits only the first time a shape and layout are seen (the index
    tensor is copied to the device then). `t` is a strided tensor with elements."""
    shape, strides = tuple(t.shape), t.stride()
    key = (shape, strides, t.device)
    index = _INDEX.get(key)
    if index is None:
        where = np.frombuffer(_sketch.offsets(shape, strides), dtype=np.int64)
        index = torch.from_numpy(where[where >= 0].copy()).to(t.device)
        if len(_INDEX) >= _INDEX_MAX:
            _INDEX.clear()
        _INDEX[key] = index
    # element offsets from `t`'s first element, over the memory its strides reach
    span = t.detach().as_strided((stored_extent(shape, strides),), (1,))
    values = span.index_select(0, index).to(torch.float64)
    missing = _sketch.SKETCH_SIZE - values.numel()
    if missing:
        values = torch.cat([values, values.new_full((missing,), float("nan"))])
    return values


def with_sketch(packed: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """`device_stats(t)`'s packed vector with `t`'s sketch after it, as float64 bits
    (`decode_packed` returns it as the statistics' "sketch"); `packed` alone where `t` has no
    sketch."""
    if not _sampled(t):
        return packed
    return torch.cat([packed, device_sample(t).view(torch.int64)])


def difference_sketch(a: torch.Tensor, b: torch.Tensor) -> np.ndarray | None:
    """The sketch of the float32 difference `a - b` without making it (the parameter update
    that `difference_stats` measured without writing it): the two sketches subtracted as
    float32 subtraction rounds."""
    if _diff_sample is not None and a.dtype is _FLOAT32 and b.dtype is _FLOAT32 \
            and a.is_cpu and b.is_cpu and a.layout is _STRIDED and b.layout is _STRIDED \
            and a.is_contiguous() and b.is_contiguous() and not a.is_neg() \
            and not b.is_neg() and a.numel() and a.shape == b.shape:
        # the kernel reads both where they lie, at the offsets both share
        where = _sketch.offsets(tuple(a.shape), a.stride())
        return np.frombuffer(_diff_sample(a.data_ptr(), b.data_ptr(), where), dtype=np.float64)
    sa, sb = sketch_of(a), sketch_of(b)
    if sa is None or sb is None:
        return None
    return _sketch.difference(sa, sb)
