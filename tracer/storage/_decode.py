"""Decoding a record's stored bytes: dtype names to numpy, the dtypes numpy lacks (bfloat16,
float8) upcast exactly from their raw bits, and bytes stored in memory order with strides put
back in C order. numpy only (no torch, no h5py): the reader, the diff's tensor reader and the
export decode through here (docs/dump-format.md, /tensors).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from tracer._errors import DumpFormatError


class RawTensor(NamedTuple):
    """`Dump.tensor(..., raw=True)`: the stored bits as unsigned integers of the element width,
    and the logical dtype name (e.g. "bfloat16") they encode."""

    bits: np.ndarray
    dtype: str


# dtype name -> (numpy dtype of the stored bytes, unsigned view of the same width)
_NATIVE = {
    "float64": np.float64, "float32": np.float32, "float16": np.float16,
    "int64": np.int64, "int32": np.int32, "int16": np.int16, "int8": np.int8,
    "uint64": np.uint64, "uint32": np.uint32, "uint16": np.uint16, "uint8": np.uint8,
    "bool": np.bool_, "complex64": np.complex64, "complex128": np.complex128,
}
# float8 layouts: (exponent bits, mantissa bits, bias, "fn": no inf / "fnuz": NaN only at 0x80,
# "e8m0": exponent only)
_FLOAT8 = {
    "float8_e4m3fn": (4, 3, 7, "fn"), "float8_e5m2": (5, 2, 15, "ieee"),
    "float8_e4m3fnuz": (4, 3, 8, "fnuz"), "float8_e5m2fnuz": (5, 2, 16, "fnuz"),
    "float8_e8m0fnu": (8, 0, 127, "e8m0"),
}
_UINT_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _float8_table(ebits: int, mbits: int, bias: int, kind: str) -> np.ndarray:
    """float32 value of each of the 256 codes of a float8 format (exact)."""
    out = np.empty(256, dtype=np.float32)
    for code in range(256):
        if kind == "e8m0":
            out[code] = np.nan if code == 0xFF else np.float32(2.0 ** (code - bias))
            continue
        sign = -1.0 if code & 0x80 else 1.0
        exp = (code >> mbits) & ((1 << ebits) - 1)
        man = code & ((1 << mbits) - 1)
        emax = (1 << ebits) - 1
        if kind == "fnuz" and code == 0x80:
            out[code] = np.nan
            continue
        if kind == "fn" and exp == emax and man == (1 << mbits) - 1:
            out[code] = np.nan
            continue
        if kind == "ieee" and exp == emax:
            out[code] = sign * np.inf if man == 0 else np.nan
            continue
        if exp == 0:
            value = man / (1 << mbits) * 2.0 ** (1 - bias)
        else:
            value = (1 + man / (1 << mbits)) * 2.0 ** (exp - bias)
        out[code] = sign * value
    return out


_F8_TABLES: dict[str, np.ndarray] = {}


def decode_bits(raw: np.ndarray, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Stored bytes (uint8) -> numpy array; bf16/fp8 upcast exactly to float32."""
    if dtype in _NATIVE:
        return raw.view(_NATIVE[dtype]).reshape(shape)
    if dtype == "bfloat16":
        bits = raw.view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape)
    if dtype in _FLOAT8:
        table = _F8_TABLES.get(dtype)
        if table is None:
            table = _F8_TABLES[dtype] = _float8_table(*_FLOAT8[dtype])
        return table[raw].reshape(shape)
    raise DumpFormatError(f"cannot decode dtype {dtype!r} with numpy; use "
                          f"Dump.tensor_torch() or raw=True")


def parse_shape(shape: str) -> tuple[int, ...]:
    """The `shape` (or `strides`) column's text -> a tuple: "8,128" -> (8, 128); "" -> ()."""
    return tuple(int(s) for s in shape.split(",")) if shape else ()


def c_order_bytes(raw: np.ndarray, itemsize: int, shape: tuple[int, ...],
                  strides: tuple[int, ...]) -> np.ndarray:
    """Bytes stored in memory order of a tensor with these element `strides` -> the same
    tensor's bytes in C order (uint8, a new array)."""
    if len(strides) != len(shape):
        raise DumpFormatError(f"strides {strides} do not match shape {shape}")
    if not raw.size:
        return raw
    uint = _UINT_OF_SIZE.get(itemsize)
    if uint is None:  # 16-byte elements (complex128): move them as pairs of uint64
        elems = raw.view(np.uint64).reshape(-1, itemsize // 8)
        view = np.lib.stride_tricks.as_strided(
            elems, shape + (itemsize // 8,), tuple(s * itemsize for s in strides) + (8,))
    else:
        elems = raw.view(uint)
        view = np.lib.stride_tricks.as_strided(elems, shape,
                                               tuple(s * itemsize for s in strides))
    if view.size and (min(strides) < 0
                      or sum((n - 1) * s for n, s in zip(shape, strides)) >= elems.shape[0]):
        raise DumpFormatError(f"strides {strides} of shape {shape} reach past the stored bytes")
    return np.ascontiguousarray(view).reshape(-1).view(np.uint8)


def element_size(dtype: str) -> int:
    """Bytes per element of a logical dtype name; 0 when numpy cannot decode it."""
    if dtype in _NATIVE:
        return np.dtype(_NATIVE[dtype]).itemsize
    if dtype == "bfloat16":
        return 2
    if dtype in _FLOAT8:
        return 1
    return 0


def raw_bits(data: np.ndarray, dtype: str, shape: tuple[int, ...]) -> RawTensor:
    """Stored bytes (uint8, C order) -> a RawTensor: the bits as unsigned integers of the
    element width (flat uint64 pairs for 16-byte elements), and the logical dtype name."""
    uint = _UINT_OF_SIZE.get(element_size(dtype))
    if uint is None:
        return RawTensor(data.view(np.uint64), dtype)
    return RawTensor(data.view(uint).reshape(shape), dtype)
