"""The statistics' fields (STAT_FIELDS) and those of a tensor with no elements, and the text of
a record's dtype and shape columns, cached: a step repeats the same few of each.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

STAT_FIELDS = ("min", "max", "mean", "norm", "nan", "posinf", "neginf", "zeros", "checksum")
_NAN = float("nan")

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
