"""Reading the tensor bytes of a record pair for `tracer.diff`: in bounded chunks, straight from
each step file's packed `/tensors` dataset, in C order whatever the stored strides, and checked
against the checksum stored with them, so a byte damaged on disk is named as such instead of
showing up as a divergence. numpy and h5py only.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Callable

import numpy as np

from tracer._errors import DumpFormatError
from tracer.analysis._compare import TensorMetrics, Tolerance, itemsize, judge_tensor
from tracer.storage import (c_order_bytes, dense_strides, open_h5, parse_shape,
                            read_sketches, sketch_row, stored_extent)

# errors h5py and numpy raise on a damaged file, besides OSError
READ_ERRORS = (DumpFormatError, OSError, RuntimeError, ValueError, KeyError, TypeError,
               IndexError, UnicodeDecodeError)


class ReadError(DumpFormatError):
    """A side's step file failed while it was being compared: which side, file and state
    ("damaged" for bytes that do not match their checksum, else "read_error")."""

    def __init__(self, side: str, path: Path, message: str, state: str = "read_error") -> None:
        super().__init__(message)
        self.side, self.path, self.state = side, path, state


class TensorReader:
    """Reads byte ranges of one step file's packed tensor dataset, in bounded chunks.

    The writer lays `/tensors` out contiguously, so its bytes are read with `os.preadv` at the
    dataset's file offset: no h5py call per chunk, no copy, and the GIL is released while the
    kernel reads. A chunked or compressed dataset falls back to h5py slicing.
    """

    def __init__(self, path: Path, side: str = "A") -> None:
        self.path, self.side = path, side
        self.fd: int | None = None
        try:
            # refuses links out of the file and datasets that claim more than it stores
            # (UntrustedFileError is no read error: it stops the diff)
            self.file = open_h5(path)
            self.data = self.file["tensors"] if "tensors" in self.file else None
            self.attrs = {k: self.file.attrs[k] for k in ("level", "mode", "config")
                          if k in self.file.attrs}
            # files without the column cannot be checked (every format so far has it)
            self.checksums = "checksum" in (self.file["records"].dtype.names or ())
        except READ_ERRORS as e:
            raise ReadError(side, path, f"unreadable: {e}") from e
        self.base: int | None = None
        if self.data is not None and self.data.size:
            try:
                offset = self.data.id.get_offset()
            except Exception:  # noqa: BLE001 - any h5py refusal means: use slicing
                offset = None
            if offset is not None and self.data.compression is None and hasattr(os, "preadv"):
                self.base = int(offset)
                self.fd = os.open(path, os.O_RDONLY)
        self._bufs: dict[int, np.ndarray] = {}
        self._sketches: tuple[np.ndarray | None, str] | None = None

    def read(self, offset: int, nbytes: int, slot: int = 0) -> np.ndarray:
        """`nbytes` bytes at `offset` of /tensors as uint8; the array is reused by the next call
        with the same `slot`."""
        if self.data is None:
            raise ReadError(self.side, self.path, "damaged: records point at tensor bytes but "
                             "the file has no /tensors dataset", "damaged")
        if offset < 0 or offset + nbytes > self.data.shape[0]:
            raise ReadError(self.side, self.path, f"damaged: a record points at bytes "
                             f"{offset}..{offset + nbytes} of /tensors, which holds "
                             f"{self.data.shape[0]}: the /records table is damaged", "damaged")
        if self.fd is None:
            try:
                return self.data[offset:offset + nbytes]
            except READ_ERRORS as e:
                raise ReadError(self.side, self.path, f"read error: {e}") from e
        buf = self._bufs.get(slot)
        if buf is None or buf.nbytes < nbytes:
            buf = self._bufs[slot] = np.empty(max(nbytes, 4096), np.uint8)
        view = buf[:nbytes]
        got = 0
        while got < nbytes:
            try:
                n = os.preadv(self.fd, [memoryview(view[got:])], self.base + offset + got)
            except OSError as e:
                raise ReadError(self.side, self.path, f"read error: {e}") from e
            if n <= 0:
                raise ReadError(self.side, self.path, "read error: the file ends inside a "
                                 "tensor (truncated while it was read?)")
            got += n
        return view

    def sketch(self, row: int) -> tuple[np.ndarray | None, str]:
        """(the sketch of the record in /records row `row`, the file's sketch scheme), or
        (None, scheme) when that record has none; the file's /sketches is read once."""
        if self._sketches is None:
            try:
                self._sketches = read_sketches(self.file, self.path)
            except DumpFormatError as e:
                raise ReadError(self.side, self.path, f"damaged: {e}", "damaged") from e
        table, scheme = self._sketches
        return sketch_row(table, row), scheme

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        try:
            self.file.close()
        except Exception:  # noqa: BLE001 - closing a damaged file is best effort
            pass


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
