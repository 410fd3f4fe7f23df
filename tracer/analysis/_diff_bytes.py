"""Comparing the tensor bytes of a record pair for `tracer.diff`: read in bounded chunks through
storage's `TensorReader`, in C order whatever the stored strides, and checked against the
checksum stored with them, so a byte damaged on disk is named as such instead of showing up as
a divergence. numpy only: no step file is opened here.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

from tracer.analysis._compare import TensorMetrics, Tolerance, itemsize, judge_tensor
from tracer.storage import (ReadError, TensorReader, c_order_bytes, dense_strides, parse_shape,
                            stored_extent)

_SIGNED = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


def _bits_sum(raw: np.ndarray, size: int) -> int:
    """The sum of a chunk's raw elements as signed integers of the element width (wrapping;
    16-byte complex128 as its two 64-bit halves): the dump format's checksum, chunk by chunk."""
    ints = _SIGNED.get(size, np.int64)
    return int(raw.view(ints).sum(dtype=ints))


def _verify(total: int, size: int, row: dict, f: TensorReader) -> None:
    """Raise ReadError ("damaged") unless the bytes read add up to the record's checksum."""
    bits = size * 8 if size in _SIGNED else 64
    total &= (1 << bits) - 1
    total = total - (1 << bits) if total >> (bits - 1) else total
    if total != int(row["checksum"]):
        raise ReadError(f.side, f.path, f"damaged: the tensor bytes of record {row['name']} do "
                         f"not match the checksum stored with them ({total} vs "
                         f"{int(row['checksum'])}): the file was damaged after it was written; "
                         f"dump that step again", "damaged")


def compare_tensor(ra: dict, rb: dict, fa: TensorReader, fb: TensorReader, tol: Tolerance,
                   progress: Callable[[int], None], chunk: int) -> dict:
    """The metrics and verdict of two records' tensors, read `chunk` elements at a time."""
    da, db = str(ra["dtype"]), str(rb["dtype"])
    rtol, atol, cos_min = tol.resolve(da, db)
    acc = TensorMetrics(rtol, atol)
    ia, ib = itemsize(da), itemsize(db)
    n = int(ra["numel"])
    oa, ob = int(ra["data_offset"]), int(rb["data_offset"])
    sa, sb = str(ra.get("strides") or ""), str(rb.get("strides") or "")
    _check_stored(ra, n, ia, sa, fa)
    _check_stored(rb, n, ib, sb, fb)
    if sa == sb and (not sa or dense_strides(parse_shape(str(ra["shape"])), parse_shape(sa))):
        # the same dense layout on both sides: element i of A's bytes is element i of B's
        read_a = lambda start, count: fa.read(oa + start * ia, count * ia)  # noqa: E731
        read_b = lambda start, count: fb.read(ob + start * ib, count * ib)  # noqa: E731
    else:  # a permutation, or a slice of another record's bytes: both in C order
        read_a = _c_order_reader(fa, oa, ia, n, str(ra["shape"]), sa)
        read_b = _c_order_reader(fb, ob, ib, n, str(rb["shape"]), sb)
    sum_a = sum_b = 0
    for start in range(0, n, chunk):
        count = min(chunk, n - start)
        xa, xb = read_a(start, count), read_b(start, count)
        equal = acc.add_raw(xa, xb, da, db, norms=n > chunk)
        chunk_a = _bits_sum(xa, ia) if fa.checksums else 0
        sum_a += chunk_a
        if fb.checksums:
            sum_b += chunk_a if equal and fa.checksums else _bits_sum(xb, ib)
        progress(count * (ia + ib))
    # a byte flipped on disk after writing shows here, not as a (false) divergence
    if fa.checksums:
        _verify(sum_a, ia, ra, fa)
    if fb.checksums:
        _verify(sum_b, ib, rb, fb)
    m = acc.result()
    m.pop("identical")
    m.update(judge_tensor(m, cos_min, atol))
    m.pop("rms")
    return m


def _check_stored(row: dict, n: int, size: int, strides: str, f: TensorReader) -> None:
    """Raise ReadError unless the record's `data_nbytes` is the range its dtype, shape and
    strides read (a damaged step file, or one not written by sleuth)."""
    want = _stored_nbytes(n, size, str(row["shape"]), strides)
    got = int(row["data_nbytes"])
    offset, held = int(row["data_offset"]), f.data.shape[0] if f.data is not None else 0
    if offset < 0 or offset + got > held or n != math.prod(parse_shape(str(row["shape"]))):
        # checked before the first chunk is read: the row's claims decide how long it reads
        raise ReadError(
            f.side, f.path,
            f"damaged: record {row['name']} claims {got:,} bytes at offset {offset:,} of "
            f"/tensors, which holds {held:,}, for {n:,} elements of shape [{row['shape']}]: "
            f"the /records table is damaged; dump that step again", "damaged")
    if got != want:
        raise ReadError(
            f.side, f.path,
            f"damaged: record {row['name']}: data_nbytes is {got}, but dtype "
            f"{row['dtype']}, shape [{row['shape']}] and strides [{strides}] read {want} bytes; "
            f"the step file is damaged or was not written by sleuth: dump that step again",
            "damaged")


def _stored_nbytes(n: int, size: int, shape: str, strides: str) -> int:
    """The bytes a record with `n` elements of `size` bytes reads (`data_nbytes`)."""
    if not strides:
        return n * size
    return stored_extent(parse_shape(shape), parse_shape(strides)) * size


def _c_order_reader(f: TensorReader, offset: int, size: int, n: int, shape: str,
                    strides: str) -> Callable[[int, int], np.ndarray]:
    """A reader of C-order element ranges `(start, count)` of one record. Stored in C order:
    read as asked. With `strides`: by rows of the first dimension when that dimension has
    the largest stride, so its rows follow one another in the stored bytes and a range reads
    only the rows it needs (memory stays bounded on a large slice or permutation); else the
    whole record at once."""
    if not strides:
        return lambda start, count: f.read(offset + start * size, count * size)
    dims, steps = parse_shape(shape), parse_shape(strides)
    if len(dims) < 2 or dims[0] < 2 or steps[0] < max(st for d, st in zip(dims, steps) if d > 1):
        return _whole_in_c_order(f, offset, size, dims, steps)
    row = n // dims[0]
    row_extent = stored_extent(dims[1:], steps[1:])  # stored elements one row reads

    def read(start: int, count: int) -> np.ndarray:
        first, stop = start // row, -(-(start + count) // row)
        raw = f.read(offset + first * steps[0] * size,
                     ((stop - first - 1) * steps[0] + row_extent) * size)
        rows = c_order_bytes(raw, size, (stop - first,) + dims[1:], steps)
        skip = (start - first * row) * size
        return rows[skip:skip + count * size]

    return read


def _whole_in_c_order(f: TensorReader, offset: int, size: int, dims: tuple[int, ...],
                      steps: tuple[int, ...]) -> Callable[[int, int], np.ndarray]:
    """Read one record stored with element strides `steps` whole, from its first element to
    its last (`stored_extent`), into C order (a copy: the next read reuses the reader's
    buffer); returns a reader of element ranges of it."""
    raw = c_order_bytes(f.read(offset, stored_extent(dims, steps) * size), size, dims, steps)
    return lambda start, count: raw[start * size:(start + count) * size]
