"""A step file's HDF5 objects, written through h5py's low-level API into an open file: the
root attributes, the tables (/records, /hits, /calls), /sketches and the allocation of /tensors
(`write_objects`), and the packing of rows into those tables (`table_array`).

An h5py dataset costs ~150 us to create whatever its size (docs/architecture.md), so a step
file holds a handful of them, never one a record: /records, /tensors and the optional /hits,
/sketches and /calls. /tensors is only allocated here; its bytes are written around HDF5
(tracer.storage._step_file).
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any

import h5py
import numpy as np
from h5py import h5a, h5d, h5p, h5s, h5t

from tracer.storage._format import _STR, records_crc32
from tracer.storage._sketch import SCHEME as SKETCH_SCHEME


def write_objects(fid: Any, attrs: dict[str, Any], complete: int, table: np.ndarray,
                  hits: np.ndarray | None, nbytes: int, sketches: np.ndarray | None = None,
                  calls: np.ndarray | None = None) -> int:
    """Everything a step file holds but the tensor bytes, into the open file `fid`: the root
    attributes, `complete`, /records, /hits, /sketches, /calls and /tensors (`nbytes`
    allocated); returns the offset of /tensors (0 when empty)."""
    for key, value in attrs.items():
        _write_attr(fid, key, value)
    _write_attr(fid, "complete", int(complete))
    _write_attr(fid, "records_crc32", records_crc32(table))
    _write_table(fid, b"records", table)
    if hits is not None:
        _write_table(fid, b"hits", hits)
    if sketches is not None:
        sketches = np.ascontiguousarray(sketches, dtype="<f4")
        _write_attr(fid, "sketch_scheme", SKETCH_SCHEME)
        _write_attr(fid, "sketches_crc32", records_crc32(sketches))
        _write_matrix(fid, b"sketches", sketches)
    if calls is not None:
        _write_table(fid, b"calls", calls)
    return _allocate_tensors(fid, nbytes)


def _file_plist() -> Any:
    """File creation properties: the root group's attributes stay in its object header
    (compact) up to 64 of them; HDF5's default moves more than 8 into a fractal heap, which is
    slower to build. And no times in the root group's header (the datasets have none either, as
    h5py makes them), so a file's bytes depend only on its content."""
    fcpl = h5p.create(h5p.FILE_CREATE)
    fcpl.set_attr_phase_change(64, 48)
    fcpl.set_obj_track_times(False)
    return fcpl


# HDF5 through h5py's low-level API: the high-level one took 5.0 ms for a statistics step
# file of 204 records (File, 11 attributes, /records) where this takes 2.9 ms (same-process
# A/B on the 2-core VM), most of the difference Python around each call. The objects made are
# those h5py's File, attrs and create_dataset make for the same values (variable-length UTF-8
# string and int64 scalar attributes; contiguous datasets without modification times), so
# readers see no difference.
_SCALAR = h5s.create(h5s.SCALAR)
_VLEN_STR = h5py.string_dtype("utf-8")
_VLEN_STR_TYPE = h5t.py_create(_VLEN_STR, logical=True)
# (numpy dtype, its fields' string encodings) -> (file type, memory type). The encodings are
# part of the key because numpy dtypes that differ only in them (h5py keeps the encoding in
# the dtype's metadata) compare and hash equal, while HDF5 stores them differently.
_TABLE_TYPES: dict[tuple, tuple[Any, Any]] = {}


def _write_attr(fid: Any, key: str, value: Any) -> None:
    """One scalar attribute of the root group, stored as h5py stores a str (variable-length
    UTF-8), an int (int64) or a float (float64); a bool is stored as an int."""
    if isinstance(value, str):
        data, ftype = np.array(value, dtype=_VLEN_STR), _VLEN_STR_TYPE
    elif isinstance(value, (int, np.integer)):
        data, ftype = np.array(int(value), dtype=np.int64), h5t.STD_I64LE
    elif isinstance(value, (float, np.floating)):
        data, ftype = np.array(float(value), dtype=np.float64), h5t.IEEE_F64LE
    else:
        raise TypeError(f"step file attribute {key!r}: {type(value).__name__} is not a str, "
                        f"int or float")
    attr = h5a.create(fid, key.encode(), ftype, _SCALAR)
    try:
        attr.write(data)
    finally:
        attr.close()


def _dataset_plist() -> Any:
    """Dataset creation properties as h5py's create_dataset sets them: no modification times."""
    dcpl = h5p.create(h5p.DATASET_CREATE)
    dcpl.set_obj_track_times(False)
    return dcpl


def _write_table(fid: Any, name: bytes, table: np.ndarray) -> None:
    """A 1-D contiguous dataset holding `table` (a compound array, see `table_array`)."""
    dtype = table.dtype
    key = (dtype, tuple((dtype[n].metadata or {}).get("h5py_encoding") for n in dtype.names or ()))
    types = _TABLE_TYPES.get(key)
    if types is None:
        if len(_TABLE_TYPES) >= 64:  # string widths vary with the names: keep the latest
            _TABLE_TYPES.clear()
        types = _TABLE_TYPES[key] = (h5t.py_create(dtype, logical=True), h5t.py_create(dtype))
    dset = h5d.create(fid, name, types[0], h5s.create_simple((len(table),)),
                      dcpl=_dataset_plist())
    try:
        if len(table):
            dset.write(h5s.ALL, h5s.ALL, np.ascontiguousarray(table), mtype=types[1])
    finally:
        dset.close()


def _write_matrix(fid: Any, name: bytes, values: np.ndarray) -> None:
    """A 2-D contiguous float32 dataset holding `values` (float32 already)."""
    dset = h5d.create(fid, name, h5t.IEEE_F32LE, h5s.create_simple(values.shape),
                      dcpl=_dataset_plist())
    try:
        if values.size:
            dset.write(h5s.ALL, h5s.ALL, values)
    finally:
        dset.close()


def _allocate_tensors(fid: Any, nbytes: int) -> int:
    """/tensors: `nbytes` of uint8 whose file space HDF5 allocates now and never fills (the
    bytes are written around HDF5); returns its file offset (0 when empty)."""
    dcpl = _dataset_plist()
    if nbytes:
        dcpl.set_layout(h5d.CONTIGUOUS)
        dcpl.set_alloc_time(h5d.ALLOC_TIME_EARLY)
        dcpl.set_fill_time(h5d.FILL_TIME_NEVER)
    dset = h5d.create(fid, b"tensors", h5t.NATIVE_UINT8, h5s.create_simple((nbytes,)),
                      dcpl=dcpl)
    try:
        if not nbytes:
            return 0
        offset = dset.get_offset()
    finally:
        dset.close()
    if offset is None:
        raise AssertionError("HDF5 did not allocate /tensors early")
    return int(offset)


def table_array(rows: list[tuple], columns: tuple[tuple[str, Any], ...]) -> np.ndarray:
    """Rows -> the compound array written as /records or /hits. String columns become
    fixed-length UTF-8 as wide as their longest value (format 2.0): HDF5 writes those at 3x the
    speed of variable-length strings, which cost ~9 us a row (a step of 700 op records: 6.4 ms
    against 1.9 ms). Packed by the C kernel's `pack_rows` (tracer/storage/_table.c) where it is
    built and the values are plain (0.1 ms for 700 rows against 2 ms in a step); by numpy otherwise,
    to the same array."""
    if _pack_rows is not None and type(rows) is list and rows:
        packed = _pack_rows(rows, _column_kinds(columns))
        if packed is not None:
            return np.frombuffer(packed[0], dtype=_packed_dtype(columns, packed[1]))
    cols = list(zip(*rows)) if rows else [()] * len(columns)
    fields: list[tuple[str, Any]] = []
    arrays = []
    for (name, dt), col in zip(columns, cols):
        if dt is _STR:
            try:
                a = np.array(col, dtype=np.bytes_) if col else np.zeros(0, "S1")
            except UnicodeEncodeError:  # not ASCII: encode each value
                a = np.array([v.encode("utf-8") for v in col], dtype=np.bytes_)
            width = max(1, a.dtype.itemsize)
            fields.append((name, h5py.string_dtype("utf-8", width)))
            arrays.append(a)
        else:
            fields.append((name, dt))
            arrays.append(np.asarray(col, dtype=dt))
    out = np.empty(len(rows), dtype=fields)
    for (name, _), a in zip(fields, arrays):
        out[name] = a
    return out


try:
    from tracer.storage._stats_kernel import pack_rows as _pack_rows
except ImportError:  # the kernel is not built: numpy packs the tables
    _pack_rows = None

_KINDS = {np.int64: "q", np.int32: "i", np.float64: "d", _STR: "s"}


@lru_cache(maxsize=8)
def _column_kinds(columns: tuple[tuple[str, Any], ...]) -> bytes:
    """`pack_rows`'s letter for each column."""
    return "".join(_KINDS[dt] for _, dt in columns).encode()


@lru_cache(maxsize=256)
def _packed_dtype(columns: tuple[tuple[str, Any], ...], widths: tuple[int, ...]) -> np.dtype:
    """The dtype `table_array` builds for these string widths (`pack_rows`'s layout)."""
    return np.dtype([(name, h5py.string_dtype("utf-8", w) if dt is _STR else dt)
                     for (name, dt), w in zip(columns, widths)])
