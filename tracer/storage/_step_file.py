"""`StepFile`: one step file assembled (rows, tensor bytes, hits, sketches, calls) and written.

Writing is arranged around h5py keeping the GIL while it writes, which stalls the training
thread (docs/architecture.md). So tensor bytes never go through h5py: `/tensors` is a
contiguous dataset whose file space HDF5 allocates up front (and never fills,
tracer.storage._h5_objects), and after HDF5 has closed the file its bytes are written with
`os.pwritev` / `os.copy_file_range` (tracer.storage._file_io), which release the GIL. Bytes of a
large step are spilled as they come to a side file (`step{S}.h5.data.partial`) so memory stays
bounded, at the offset `/tensors` will have (`SPILL_OFFSET`, which HDF5's alignment setting
gives it); at the end the few bytes HDF5 wrote are copied around them and the side file becomes
the step file, so the bulk is written once.

The file is built as `step{S}.h5.partial` and handed back as a `PendingFile`, whose `commit`
fsyncs and renames it: a file without the suffix is always complete.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import numpy as np
from h5py import h5f, h5p

from tracer.storage._file_io import PendingFile, _copy_range, _data_extents, _pwrite_all
from tracer.storage._format import CALL_COLUMNS, HIT_COLUMNS, RECORD_COLUMNS, _STR, mark_status
from tracer.storage._h5_objects import _file_plist, table_array, write_objects
from tracer.storage._sketch import SKETCH_SIZE

SPILL_OFFSET = 16 << 20
"""Offset of /tensors in a step file whose bytes were spilled: HDF5's metadata (records,
hits, attributes) must fit below it, else the spilled bytes are copied to where /tensors is.
Unwritten, the gap stays a hole in the file on filesystems that have them."""


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
        a record without one; None when no record has one. A sketch is SKETCH_SIZE float64,
        as an array or as the statistics kernel's bytes."""
        if self.sketch_table is not None:
            return self.sketch_table
        if not self.sketches:
            return None
        seq_list, sketches = zip(*self.sketches)
        wanted = np.array(seq_list, dtype=np.int64)
        try:  # one copy of every sketch's bytes, the usual case
            values = np.frombuffer(b"".join(sketches), dtype=np.float64)
        except (TypeError, ValueError, BufferError):  # a non-contiguous array among them
            values = None
        if values is None or values.size != len(sketches) * SKETCH_SIZE:
            values = np.stack([np.frombuffer(s, np.float64) if type(s) is bytes
                               else np.asarray(s, np.float64) for s in sketches])
        values = values.reshape(len(sketches), SKETCH_SIZE)
        seqs = np.asarray(table["seq"])
        if len(seqs) == len(wanted) and np.array_equal(seqs, wanted):
            return values.astype(np.float32)  # every record has one, in row order
        out = np.full((len(table), SKETCH_SIZE), np.nan, dtype=np.float32)
        rows = np.searchsorted(seqs, wanted).clip(0, max(len(seqs) - 1, 0))
        found = seqs[rows] == wanted if len(seqs) else np.zeros(len(wanted), bool)
        out[rows[found]] = values[found]
        return out

    def records_table(self) -> np.ndarray:
        """The /records array: the prebuilt `table`, or the rows in seq order."""
        if self.table is not None:
            return self.table
        table = table_array(self.rows, RECORD_COLUMNS)
        if len(table) > 1:
            seqs = table["seq"]
            if (seqs[1:] < seqs[:-1]).any():  # rows made in two threads (async writer)
                table = table[np.argsort(seqs, kind="stable")]
        return table

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
