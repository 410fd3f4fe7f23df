"""The HDF5 step file (docs/dump-format.md): its columns, and `StepFile`, which writes one.

Writing is arranged around two measured costs (docs/architecture.md): an h5py dataset costs ~150 us to
create, so a step has exactly three (`/records`, `/tensors`, optional `/hits`); and h5py keeps
the GIL while it writes, which stalls the training thread. So tensor bytes never go through
h5py: `/tensors` is a contiguous dataset whose file space HDF5 allocates up front (and never
fills), and after HDF5 has closed the file its bytes are written with `os.pwritev` /
`os.copy_file_range`, which release the GIL. Bytes of a large step are spilled as they come to a
side file (`step{S}.h5.data.partial`) so memory stays bounded, at the offset `/tensors` will have
(`SPILL_OFFSET`, which HDF5's alignment setting gives it); at the end the few bytes HDF5 wrote
are copied around them and the side file becomes the step file, so the bulk is written once.

The file is built as `step{S}.h5.partial`, fsynced and renamed: a file without the suffix is
always complete. The root attribute `records_crc32` holds the CRC-32 of /records' bytes, so a
reader tells a table changed on disk from one written so (HDF5 checksums its metadata blocks,
never a dataset's data).
"""
from __future__ import annotations

import datetime as _dt
import errno
import json
import os
import zlib
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, NamedTuple

import h5py
import numpy as np
from h5py import h5a, h5d, h5f, h5p, h5s, h5t

from tracer.storage._sketch import SCHEME as SKETCH_SCHEME
from tracer.storage._sketch import SKETCH_SIZE


FORMAT_VERSION = "3.4"
FORMAT_MAJOR = 3

_STR = h5py.string_dtype("utf-8")
RECORD_COLUMNS: tuple[tuple[str, Any], ...] = (
    ("seq", np.int64), ("name", _STR), ("module", _STR), ("op", _STR), ("phase", _STR),
    ("direction", _STR), ("index", np.int32), ("call", np.int32), ("dtype", _STR),
    ("shape", _STR), ("numel", np.int64), ("min", np.float64), ("max", np.float64),
    ("mean", np.float64), ("norm", np.float64), ("nan", np.int64), ("posinf", np.int64),
    ("neginf", np.int64), ("zeros", np.int64), ("checksum", np.int64), ("source", _STR),
    ("data_offset", np.int64), ("data_nbytes", np.int64), ("strides", _STR), ("caller", _STR),
)
RECORD_DTYPE = np.dtype(list(RECORD_COLUMNS))
RECORD_FIELDS = tuple(name for name, _ in RECORD_COLUMNS)


class RecordMeta(NamedTuple):
    """Who made a record; the capture side fills it (see docs/dump-format.md for each column)."""

    name: str
    module: str
    op: str
    phase: str
    direction: str
    index: int
    call: int
    source: str
    caller: str = ""


class RecordRow(NamedTuple):
    """One /records row, in column order: what both writers put in a step file, what the row
    sinks get, and what the reader gives back (`from_stored`). Made in one place, `make`."""

    seq: int
    name: str
    module: str
    op: str
    phase: str
    direction: str
    index: int
    call: int
    dtype: str
    shape: str
    numel: int
    min: float
    max: float
    mean: float
    norm: float
    nan: int
    posinf: int
    neginf: int
    zeros: int
    checksum: int
    source: str
    data_offset: int
    data_nbytes: int
    strides: str
    caller: str

    @classmethod
    def make(cls, seq: int, meta: RecordMeta, dtype: str, shape: str, numel: int, stats: dict,
             data_offset: int = -1, data_nbytes: int = 0, strides: str = "") -> RecordRow:
        """The row of record `seq`: who made it (`meta`), its dtype and shape as the columns
        spell them, its statistics (the keys of `host_stats`), and where its bytes are stored
        (-1, 0, "": none)."""
        name, module, op, phase, direction, index, call, source, caller = meta
        return cls(seq, name, module, op, phase, direction, index, call, dtype, shape, numel,
                   stats["min"], stats["max"], stats["mean"], stats["norm"], stats["nan"],
                   stats["posinf"], stats["neginf"], stats["zeros"], stats["checksum"], source,
                   data_offset, data_nbytes, strides, caller)

    @classmethod
    def from_stored(cls, row: np.void) -> RecordRow:
        """A row of a step file's /records as Python values: text decoded, "" for a column an
        older file lacks (no `strides` before format 2.0, no `caller` before 3.2)."""
        names = row.dtype.names or ()
        values = []
        for field in cls._fields:
            if field not in names:
                values.append("")
                continue
            value = row[field]
            if isinstance(value, bytes):
                value = value.decode("utf-8")
            values.append(value if isinstance(value, str) else value.item())
        return cls(*values)

    def as_dict(self, **extra: Any) -> dict[str, Any]:
        """The row as a dict of its columns, with `extra` keys after them (an observer's
        `step` and `rank`)."""
        out = dict(zip(self._fields, self))
        out.update(extra)
        return out


if RecordRow._fields != RECORD_FIELDS:  # pragma: no cover - the two are written side by side
    raise AssertionError("RecordRow's fields are not the /records columns")


HIT_COLUMNS: tuple[tuple[str, Any], ...] = (
    ("seq", np.int64), ("name", _STR), ("condition", _STR), ("value", np.float64),
    ("source", _STR),
)
HIT_DTYPE = np.dtype(list(HIT_COLUMNS))
HIT_FIELDS = tuple(name for name, _ in HIT_COLUMNS)

CALL_COLUMNS: tuple[tuple[str, Any], ...] = (("seq", np.int64), ("name", _STR), ("spec", _STR))
"""/calls (format 3.4, op level in tensor and full mode): one row per recorded op call, what
re-running it needs: `name` its records' stem ("{module}::{op}.{phase}.{call}"), `seq` that of
its first record, `spec` JSON (tracer.capture._calls: the overload, its non-tensor arguments,
its tensor arguments by input record index)."""
CALL_FIELDS = tuple(name for name, _ in CALL_COLUMNS)

_IOV_MAX = 1024
SPILL_OFFSET = 16 << 20
"""Offset of /tensors in a step file whose bytes were spilled: HDF5's metadata (records,
hits, attributes) must fit below it, else the spilled bytes are copied to where /tensors is.
Unwritten, the gap stays a hole in the file on filesystems that have them."""


def step_path(run_dir: str | os.PathLike, rank: int, step: int) -> Path:
    """RUN/dump/rank{R}/step{S}.h5"""
    return Path(run_dir) / "dump" / f"rank{rank}" / f"step{step}.h5"


@lru_cache(maxsize=1)
def _versions() -> tuple[str, str]:
    from importlib import metadata

    try:
        sleuth_version = metadata.version("sleuth")
    except metadata.PackageNotFoundError:
        sleuth_version = "unknown"
    try:
        import torch

        torch_version = str(torch.__version__)
    except ImportError:  # pragma: no cover - writers always have torch
        torch_version = "none"
    return sleuth_version, torch_version


def root_attrs(*, rank: int, world_size: int, step: int, level: str, mode: str,
               config: dict, run_id: str = "") -> dict[str, Any]:
    """The root attributes of a step file (docs/dump-format.md)."""
    sleuth_version, torch_version = _versions()
    return {
        "format_version": FORMAT_VERSION, "rank": int(rank), "world_size": int(world_size),
        "step": int(step), "run_id": run_id, "level": level, "mode": mode,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "sleuth_version": sleuth_version, "torch_version": torch_version,
        "config": json.dumps(config, sort_keys=True),
        # set from the writer's `complete` flag when the file is written (`mark_status`)
        "status": "complete", "status_reason": "",
    }


UNENDED = "the writer closed, or the next step began, while this step was open"
"""`status_reason` of an interrupted step whose writer was given no reason."""


def mark_status(attrs: dict[str, Any], complete: bool) -> None:
    """Set `status` ("complete" or "interrupted") and `status_reason` from `complete`.

    Every write path (HDF5 here or in the file-writer process) calls this
    before it uses the attributes, so `status` always agrees with `complete`: an interrupted
    step keeps the reason its writer set (`Writer.end_step(status_reason=...)`), or UNENDED."""
    if complete:
        attrs["status"], attrs["status_reason"] = "complete", ""
    else:
        attrs["status"] = "interrupted"
        attrs["status_reason"] = str(attrs.get("status_reason") or UNENDED)


class StepFile:
    """One step file being assembled: rows, tensor bytes and hits, written by `finish()`.

    Tensor bytes stay in memory until `spill_bytes` of them are held, then go to a side file.
    Not thread-safe: one thread (the training thread for sync, the writer thread for async)
    owns a StepFile.
    """

    def __init__(self, path: Path, attrs: dict[str, Any], *, spill_bytes: int) -> None:
        self.path = Path(path)
        self.attrs = attrs
        self.rows: list[tuple] = []
        self.hits: list[tuple] = []
        self.calls: list[tuple] = []
        self.sketches: list[tuple[int, np.ndarray]] = []  # (seq, sketch) of some records
        # prebuilt /records, /hits and /sketches arrays (the file-writer process gets tables)
        self.table: np.ndarray | None = None
        self.hit_table: np.ndarray | None = None
        self.call_table: np.ndarray | None = None
        self.sketch_table: np.ndarray | None = None
        self._spill_bytes = max(1, spill_bytes)
        self._buffers: list[memoryview] = []  # in memory, not yet spilled
        self._released: list[Callable[[], None]] = []  # to call once those are written
        self._buffered = 0
        self._spilled = 0  # bytes already in the side file
        self._spill_fd: int | None = None
        self.nbytes = 0  # offset of the next tensor in /tensors

    @property
    def spilled(self) -> bool:
        """True once tensor bytes went to the side file."""
        return self._spill_fd is not None

    @property
    def partial_path(self) -> Path:
        return self.path.with_name(self.path.name + ".partial")

    @property
    def spill_path(self) -> Path:
        return self.path.with_name(self.path.name + ".data.partial")

    def add_bytes(self, data: np.ndarray | memoryview | bytes,
                  on_written: Callable[[], None] | None = None) -> int:
        """Append one tensor's bytes to /tensors; returns its offset. Keeps a reference until
        the bytes are written (spilled, finished or aborted), then calls `on_written`."""
        view = memoryview(data).cast("B")
        offset = self.nbytes
        if not view.nbytes:
            if on_written is not None:
                on_written()
            return offset
        self._buffers.append(view)
        if on_written is not None:
            self._released.append(on_written)
        self._buffered += view.nbytes
        self.nbytes += view.nbytes
        if self._buffered >= self._spill_bytes:
            self._spill()
        return offset

    def add_row(self, row: tuple) -> None:
        self.rows.append(row)

    def add_sketch(self, seq: int, sketch: np.ndarray) -> None:
        """Keep record `seq`'s sketch (tracer.storage._sketch) for /sketches."""
        self.sketches.append((seq, sketch))

    def sketches_table(self, table: np.ndarray) -> np.ndarray | None:
        """The /sketches array for the /records array `table`: row i is the sketch of the
        record in row i (float32: what every float of 32 bits or fewer holds exactly), NaN for
        a record without one; None when no record has one."""
        if self.sketch_table is not None:
            return self.sketch_table
        if not self.sketches:
            return None
        out = np.full((len(table), SKETCH_SIZE), np.nan, dtype=np.float32)
        seqs = np.asarray(table["seq"])
        wanted = np.fromiter((seq for seq, _ in self.sketches), np.int64, len(self.sketches))
        rows = np.searchsorted(seqs, wanted).clip(0, max(len(seqs) - 1, 0))
        found = seqs[rows] == wanted if len(seqs) else np.zeros(len(wanted), bool)
        values = np.stack([sketch for _, sketch in self.sketches])
        out[rows[found]] = values[found]
        return out

    def records_table(self) -> np.ndarray:
        """The /records array: the prebuilt `table`, or the rows in seq order."""
        if self.table is not None:
            return self.table
        rows = self.rows
        if any(rows[i][0] > rows[i + 1][0] for i in range(len(rows) - 1)):
            rows = sorted(rows)  # rows made in two threads (async writer): seq order
        return table_array(rows, RECORD_COLUMNS)

    def hits_table(self) -> np.ndarray | None:
        """The /hits array, or None when the step has no hits."""
        if self.hit_table is not None:
            return self.hit_table
        return table_array(self.hits, HIT_COLUMNS) if self.hits else None

    def add_hit(self, hit: dict) -> None:
        self.hits.append(tuple(hit.get(k, "" if dt is _STR else 0) for k, dt in HIT_COLUMNS))

    def add_call(self, seq: int, name: str, spec: str) -> None:
        self.calls.append((seq, name, spec))

    def calls_table(self) -> np.ndarray | None:
        """The /calls array, or None when the step recorded no call."""
        if self.call_table is not None:
            return self.call_table
        return table_array(sorted(self.calls), CALL_COLUMNS) if self.calls else None

    def _spill(self) -> None:
        if self._spill_fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._spill_fd = os.open(self.spill_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self._spilled += _pwrite_all(self._spill_fd, self._buffers,
                                     SPILL_OFFSET + self._spilled)
        self._buffers, self._buffered = [], 0
        self._release()

    def _release(self) -> None:
        callbacks, self._released = self._released, []
        for callback in callbacks:
            callback()

    def finish(self, *, complete: bool = True) -> Path:
        """Write the file atomically and return its final path."""
        return self.write(complete=complete).commit()

    def write(self, *, complete: bool = True,
              metadata: Callable[[StepFile, bool], int | None] | None = None) -> PendingFile:
        """Write everything (metadata and bytes; the memory they held is released), but leave
        it under its temporary name: `commit()` of the result fsyncs and renames. Split so an
        async writer can write the next step while the disk syncs this one.

        `metadata(file, complete)`: writes the HDF5 part in the partial path instead of this
        thread (`write_metadata` in another process, tracer.storage._file_process) and returns the offset
        of /tensors, or None to have it written here."""
        mark_status(self.attrs, complete)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.partial_path
        offset = metadata(self, complete) if metadata is not None else None
        if offset is None:
            offset = self.write_metadata(complete)
        if offset == SPILL_OFFSET and self.spilled:
            return self._write_in_side_file(partial)
        fd = os.open(partial, os.O_WRONLY)
        try:
            if self._spill_fd is not None:
                _copy_range(self._spill_fd, fd, self._spilled, offset, SPILL_OFFSET)
            _pwrite_all(fd, self._buffers, offset + self._spilled)
        except BaseException:
            os.close(fd)
            raise
        finally:
            self._drop_spill()
        self._buffers = []
        self._release()
        return PendingFile(fd, partial, self.path)

    def _write_in_side_file(self, partial: Path) -> PendingFile:
        """The spilled bytes already lie where /tensors is: copy HDF5's bytes (everything
        outside /tensors) into the side file and add the unspilled tail; the side file becomes
        the step file at commit.
        """
        fd = self._spill_fd
        assert fd is not None
        try:
            src = os.open(partial, os.O_RDONLY)
            try:
                end = os.fstat(src).st_size
                tensors_end = SPILL_OFFSET + self.nbytes
                for start, stop in _data_extents(src, 0, min(SPILL_OFFSET, end)):
                    _copy_range(src, fd, stop - start, start, start)
                if end > tensors_end:
                    _copy_range(src, fd, end - tensors_end, tensors_end, tensors_end)
            finally:
                os.close(src)
            _pwrite_all(fd, self._buffers, SPILL_OFFSET + self._spilled)
        except BaseException:
            self._drop_spill()
            raise
        finally:
            try:
                partial.unlink()
            except OSError:
                pass
        self._spill_fd = None  # the pending file owns it now
        self._buffers = []
        self._release()
        return PendingFile(fd, self.spill_path, self.path)

    def abort(self) -> None:
        """Forget this step, removing what it wrote."""
        self._drop_spill()
        self._buffers = []
        self._release()
        try:
            self.partial_path.unlink()
        except OSError:  # best effort: the error that brought us here is the one to report
            pass

    def _drop_spill(self) -> None:
        if self._spill_fd is not None:
            os.close(self._spill_fd)
            self._spill_fd = None
            try:
                self.spill_path.unlink()
            except OSError:
                pass

    def write_metadata(self, complete: bool, *, spilled: bool | None = None) -> int:
        """Write the partial file's metadata, /records and /hits, and allocate /tensors
        (`nbytes`); returns its file offset. The bytes are written by `write`.

        `spilled` (default: whether bytes went to the side file): align allocations as large
        as /tensors (only it, unless a table is that large) to SPILL_OFFSET, so that /tensors
        is there when the metadata fits below it."""
        if spilled is None:
            spilled = self.spilled
        mark_status(self.attrs, complete)
        table = self.records_table()
        hits = self.hits_table()
        sketches = self.sketches_table(table)
        calls = self.calls_table()
        fapl = h5p.create(h5p.FILE_ACCESS)
        # closing the file closes whatever HDF5 object an error left open
        fapl.set_fclose_degree(h5f.CLOSE_STRONG)
        # no sieve buffer: a table's bytes are written by its write call, where a full disk is
        # an error; held back to the dataset's close, a failed write leaves HDF5 a dataset
        # that the file's close flushes again and crashes on (SIGSEGV in H5D__flush_all_cb,
        # HDF5 2.0): the user's run would die of the dump's full disk
        fapl.set_sieve_buf_size(0)
        if spilled and self.nbytes:
            fapl.set_alignment(max(1, self.nbytes), SPILL_OFFSET)
        fid = h5f.create(os.fsencode(self.partial_path), h5f.ACC_TRUNC, fapl=fapl,
                         fcpl=_file_plist())
        try:
            return write_objects(fid, self.attrs, complete, table, hits, self.nbytes, sketches,
                                 calls)
        finally:
            fid.close()


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


def records_crc32(table: np.ndarray) -> int:
    """CRC-32 of a table's bytes (/records, /sketches): what `write_objects` stores and the
    reader checks (the array h5py reads back has the bytes it was written from)."""
    return zlib.crc32(np.ascontiguousarray(table).tobytes())


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


class PendingFile:
    """A step file whose bytes are all written under a temporary name, not yet durable."""

    def __init__(self, fd: int, temp: Path, final: Path) -> None:
        self._fd: int | None = fd
        self.temp = temp
        self.path = final

    def commit(self) -> Path:
        """fsync and rename to the final name (a file without `.partial` is complete)."""
        fd, self._fd = self._fd, None
        if fd is None:
            raise RuntimeError(f"{self.path}: committed or aborted already")
        try:
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            self._unlink()
            raise
        os.close(fd)
        # no fsync of the directory: the rename is atomic either way, and on ext4 a directory
        # fsync waits for a journal commit (tens of ms per step when other processes write)
        os.replace(self.temp, self.path)
        return self.path

    def abort(self) -> None:
        """Close and remove the temporary file."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
            self._unlink()

    def _unlink(self) -> None:
        try:
            self.temp.unlink()
        except OSError:
            pass


def _pwrite_all(fd: int, buffers: list[memoryview], offset: int) -> int:
    """Write `buffers` back to back at `offset` (GIL released in the syscalls)."""
    written = 0
    pending = [b for b in buffers if b.nbytes]
    while pending:
        batch = pending[:_IOV_MAX]
        n = os.pwritev(fd, batch, offset + written)
        written += n
        # a short write (rare: signals, huge batches) resumes where it stopped
        while batch and n >= batch[0].nbytes:
            n -= batch[0].nbytes
            batch.pop(0)
            pending.pop(0)
        if n:
            pending[0] = pending[0][n:]
    return written


def _data_extents(fd: int, start: int, stop: int) -> list[tuple[int, int]]:
    """The ranges of [start, stop) of `fd` that hold data (not holes); all of it where the
    filesystem cannot tell."""
    out = []
    pos = start
    try:
        while pos < stop:
            try:
                data = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError as e:
                if e.errno == errno.ENXIO:  # only a hole is left
                    break
                raise
            if data >= stop:
                break
            hole = min(os.lseek(fd, data, os.SEEK_HOLE), stop)
            out.append((data, hole))
            pos = hole
    except (AttributeError, OSError):
        return [(start, stop)] if stop > start else []
    return out


def _copy_range(src: int, dst: int, nbytes: int, dst_offset: int, src_offset: int = 0) -> None:
    """Copy `nbytes` from `src_offset` of `src` to `dst_offset` of `dst`, in the kernel if it
    can."""
    done = 0
    try:
        while done < nbytes:
            n = os.copy_file_range(src, dst, nbytes - done, src_offset + done,
                                   dst_offset + done)
            if n == 0:
                break
            done += n
    except OSError:  # not supported across these filesystems: copy through user space
        pass
    while done < nbytes:
        chunk = os.pread(src, min(64 << 20, nbytes - done), src_offset + done)
        if not chunk:
            raise OSError(f"spill file ended after {done} of {nbytes} bytes")
        _pwrite_all(dst, [memoryview(chunk)], dst_offset + done)
        done += len(chunk)
