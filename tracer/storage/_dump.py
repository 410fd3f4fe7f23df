"""`Dump`: a dump on disk read back: its ranks and steps, each step's statistics as a
DataFrame, and tensors read lazily. `open_dump` (tracer.storage._reader) makes one from the
folders `scan_dump` classified.

No torch at module level: `sleuth diff` and the dashboard read dumps without it. Only
`Dump.tensor_torch` imports torch.
"""
from __future__ import annotations

import difflib
import math
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from tracer._errors import DumpFormatError, RecordNotFoundError
from tracer.storage._decode import c_order_bytes, decode_bits, element_size, parse_shape, raw_bits
from tracer.storage._format import CALL_FIELDS, HIT_FIELDS, RECORD_FIELDS, RecordRow
from tracer.storage._h5open import open_h5
from tracer.storage._layout import stored_extent
from tracer.storage._scan import PROBLEM_STATES, FileState
from tracer.storage._sketch import row_of
from tracer.storage._step_reader import (STR_FIELDS_HIT, STR_FIELDS_REC, check_version,
                                         damaged_table, read_records, read_sketches,
                                         step_status, table_to_frame)

_OPEN_FILES = 8  # h5py handles kept open per Dump
_CACHED_TABLES = 4  # /records tables kept decoded per Dump


def every_step(dump: Any, rank: int):
    """`dump.stats(rank, s)` of every step of the rank in one DataFrame, a leading `step`
    column (a `Dump`, or anything with its `steps` and `stats`)."""
    import pandas as pd

    frames = []
    for s in dump.steps(rank):
        df = dump.stats(rank, s)
        df.insert(0, "step", s)
        frames.append(df)
    if not frames:
        return pd.DataFrame(columns=["step", *RECORD_FIELDS])
    return pd.concat(frames, ignore_index=True)


class Dump:
    """A dump on disk: ranks, steps, per-step statistics and tensors (see open_dump)."""

    def __init__(self, files: dict[tuple[int, int], Path], skipped: list[tuple[str, str]],
                 root: Path, states: list[FileState] | None = None) -> None:
        self.root = root
        self._files = dict(sorted(files.items()))
        self.skipped = skipped
        """(path, reason) of each file that was ignored: partial, unreadable, or written by
        another run than the dump's (see `open_dump`)."""
        self.file_states: list[FileState] = list(states or [])
        """One FileState per step file, partial file and empty rank folder found."""
        self._handles: OrderedDict[Path, h5py.File] = OrderedDict()
        self._sketches: tuple[tuple[int, int], np.ndarray | None] | None = None  # the last read
        self._tables: OrderedDict[tuple[int, int], tuple[np.ndarray, dict[str, int]]] = \
            OrderedDict()

    def __repr__(self) -> str:
        return (f"Dump({str(self.root)!r}, ranks={self.ranks}, files={len(self._files)}, "
                f"skipped={len(self.skipped)})")

    # -- listing -----------------------------------------------------------------------------
    @property
    def ranks(self) -> list[int]:
        """Ranks with at least one complete step file, ascending."""
        return sorted({r for r, _ in self._files})

    def steps(self, rank: int = 0) -> list[int]:
        """Steps dumped by `rank`, ascending."""
        return [s for r, s in self._files if r == rank]

    def summary(self):
        """One row per step file: rank, step, records, tensor_bytes, file_bytes, complete,
        status ("complete" or "interrupted", see `status`), path (reads only file metadata)."""
        import pandas as pd

        rows = []
        for (rank, step), path in self._files.items():
            f = self._open(rank, step)
            rows.append(dict(rank=rank, step=step, records=int(f["records"].shape[0]),
                             tensor_bytes=int(f["tensors"].shape[0]) if "tensors" in f else 0,
                             file_bytes=path.stat().st_size,
                             complete=bool(f.attrs.get("complete", 1)),
                             status=step_status(f.attrs)[0]))
        frame = pd.DataFrame(rows, columns=["rank", "step", "records", "tensor_bytes",
                                            "file_bytes", "complete", "status"])
        # object, not pandas' inferred (Arrow) strings: a path from a folder named with bytes
        # that are not UTF-8 holds surrogate escapes, which Arrow refuses
        frame["path"] = pd.Series([str(p) for p in self._files.values()], dtype=object,
                                  index=frame.index)
        return frame

    def status(self, rank: int = 0, step: int | None = None) -> tuple[str, str]:
        """(status, reason) of a step: ("complete", "") for a step that ended at its optimizer
        step (or `Dumper.step()`), ("interrupted", why) for one cut short by an exception, a
        signal or the process exiting, whose file holds the records made until then. Files
        older than format 3.1 carry no status: their `complete` attribute decides."""
        return step_status(self._open(rank, self._default_step(rank, step)).attrs)

    @property
    def problems(self) -> list[FileState]:
        """The FileStates whose step was not fully read or not ended normally (PROBLEM_STATES):
        a reader that says "same" or "clean" must have none among the steps it selected."""
        return [s for s in self.file_states if s.state in PROBLEM_STATES]

    def state(self, rank: int, step: int) -> FileState | None:
        """The FileState of (rank, step): the readable file's when there is one, else the
        first problem found for that step; None when nothing of it exists."""
        found = [s for s in self.file_states if s.rank == rank and s.step == step]
        for s in found:
            if s.state in ("complete", "interrupted"):
                return s
        return next((s for s in found if s.state != "partial"), found[0] if found else None)

    def path(self, rank: int, step: int) -> Path:
        """The file of (rank, step); DumpFormatError naming what exists when there is none."""
        try:
            return self._files[(rank, step)]
        except KeyError:
            unread = [st for st in self.file_states if st.rank == rank and st.step == step]
            if unread:  # the step is there, but its file could not be read
                raise DumpFormatError(f"step {step} of rank {rank} cannot be read: "
                                      f"{unread[0].path}: {unread[0].reason}") from None
            if rank not in self.ranks:
                raise DumpFormatError(f"no rank {rank} in {self.root}; ranks: {self.ranks}") \
                    from None
            raise DumpFormatError(f"no step {step} for rank {rank} in {self.root}; steps: "
                                  f"{_short_list(self.steps(rank))}") from None

    def attrs(self, rank: int = 0, step: int | None = None) -> dict[str, Any]:
        """Root attributes of a step file (format_version, level, mode, config, ...)."""
        f = self._open(rank, self._default_step(rank, step))
        return {k: (v.item() if isinstance(v, np.generic) else v) for k, v in f.attrs.items()}

    # -- statistics --------------------------------------------------------------------------
    def stats(self, rank: int = 0, step: int | None = None):
        """The /records table of one step as a pandas DataFrame in seq order (no tensor bytes
        are read). `step=None` concatenates every step of the rank, with a leading `step`
        column."""
        if step is None:
            return every_step(self, rank)
        arr, _ = self._table(rank, step)
        try:
            return table_to_frame(arr, RECORD_FIELDS, STR_FIELDS_REC)
        except (ValueError, TypeError) as e:  # text columns that are not UTF-8
            raise damaged_table(self.path(rank, step), e) from e

    records = stats

    def record(self, rank: int, step: int, name: str) -> dict[str, Any]:
        """One record's row as a dict (`row(...)` gives it as a `RecordRow`)."""
        return self.row(rank, step, name).as_dict()

    def row(self, rank: int, step: int, name: str) -> RecordRow:
        """One record's row, as the writer made it."""
        arr, index = self._table(rank, step)
        try:
            return RecordRow.from_stored(arr[self._row_index(rank, step, index, name)])
        except UnicodeDecodeError as e:  # text columns that are not UTF-8
            raise damaged_table(self.path(rank, step), e) from e

    def sketches(self, rank: int = 0, step: int | None = None) -> np.ndarray | None:
        """The /sketches array of a step (one row per /records row, in the same order: 128 of
        the record's elements at the positions `sketch_positions(numel)` names, NaN-padded;
        a row of NaN for a record without one), or None when the step kept no sketches (a
        tensor dump, `"sketch": false`, a file before format 3.3)."""
        step = self._default_step(rank, step)
        if self._sketches is None or self._sketches[0] != (rank, step):
            table = read_sketches(self._open(rank, step), self.path(rank, step))[0]
            self._sketches = ((rank, step), table)
        return self._sketches[1]

    def sketch(self, rank: int, step: int, name: str) -> np.ndarray | None:
        """One record's sketch (see `sketches`), or None when it has none."""
        arr, index = self._table(rank, step)
        i = self._row_index(rank, step, index, name)
        return row_of(self.sketches(rank, step), i)

    def calls(self, rank: int = 0, step: int | None = None):
        """The /calls table of a step (what re-running each recorded op call needs: seq, name,
        spec as JSON text) as a DataFrame; empty when the step has none (module level,
        statistics mode, or a file written before format 3.4)."""
        import pandas as pd

        f = self._open(rank, self._default_step(rank, step))
        if "calls" not in f:
            return pd.DataFrame(columns=list(CALL_FIELDS))
        return table_to_frame(f["calls"][()], CALL_FIELDS, ("name", "spec"))

    def hits(self, rank: int = 0, step: int | None = None):
        """The /hits table (watchpoint hits) of a step as a DataFrame; empty when none."""
        import pandas as pd

        f = self._open(rank, self._default_step(rank, step))
        if "hits" not in f:
            return pd.DataFrame(columns=list(HIT_FIELDS))
        return table_to_frame(f["hits"][()], HIT_FIELDS, STR_FIELDS_HIT)

    # -- tensors -----------------------------------------------------------------------------
    def tensor(self, rank: int, step: int, name: str, raw: bool = False):
        """The tensor of record `name` as numpy, read now.

        bfloat16 and float8 come upcast to float32 (exactly). `raw=True` returns a RawTensor
        (bits as unsigned integers of the element width, dtype name) instead. Raises
        DumpFormatError when the dump holds no bytes for it (mode 'statistics').
        """
        data, dtype, shape = self._bytes(rank, step, name)
        if raw:
            return raw_bits(data, dtype, shape)
        return decode_bits(data, dtype, shape)

    def tensor_strides(self, rank: int, step: int, name: str) -> tuple[int, ...] | None:
        """The element strides the record's tensor had when it was recorded, where the dump
        kept them (format 2.0: a transpose or permutation stored in memory order; 3.0: also a
        slice read from another record's bytes); None when it was C-contiguous or the file does
        not say. `tensor()` and `tensor_torch()` always
        return C-contiguous data."""
        strides = self.row(rank, step, name).strides
        return parse_shape(strides) if strides else None

    def tensor_torch(self, rank: int, step: int, name: str):
        """The tensor of record `name` as a torch.Tensor in its logical dtype, bit for bit."""
        import torch

        data, dtype, shape = self._bytes(rank, step, name)
        tdtype = getattr(torch, dtype, None)
        if not isinstance(tdtype, torch.dtype):
            raise DumpFormatError(f"this torch ({torch.__version__}) has no dtype {dtype!r}")
        if data.size == 0:
            return torch.empty(shape, dtype=tdtype)
        return torch.from_numpy(data.copy()).view(tdtype).reshape(shape)

    # -- plumbing ----------------------------------------------------------------------------
    def close(self) -> None:
        """Close the HDF5 files this Dump keeps open."""
        for f in self._handles.values():
            try:
                f.close()
            except Exception:  # noqa: BLE001 - closing is best effort
                pass
        self._handles.clear()
        self._tables.clear()
        self._sketches = None

    def __enter__(self) -> Dump:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def _default_step(self, rank: int, step: int | None) -> int:
        if step is not None:
            return step
        steps = self.steps(rank)
        if len(steps) != 1:
            raise DumpFormatError(f"rank {rank} has {len(steps)} steps "
                                  f"({_short_list(steps)}): pass step=")
        return steps[0]

    def _open(self, rank: int, step: int) -> h5py.File:
        path = self.path(rank, step)
        f = self._handles.get(path)
        if f is not None:
            self._handles.move_to_end(path)
            return f
        try:
            f = open_h5(path)  # refuses links out of the file and claims past its size
        except OSError as e:
            raise DumpFormatError(f"cannot read dump file {path}: {e}") from e
        check_version(f, path)
        self._handles[path] = f
        if len(self._handles) > _OPEN_FILES:
            _, old = self._handles.popitem(last=False)
            old.close()
        return f

    def _table(self, rank: int, step: int) -> tuple[np.ndarray, dict[str, int]]:
        key = (rank, step)
        hit = self._tables.get(key)
        if hit is not None:
            self._tables.move_to_end(key)
            return hit
        arr, index = read_records(self._open(rank, step), self.path(rank, step))
        self._tables[key] = (arr, index)
        if len(self._tables) > _CACHED_TABLES:
            self._tables.popitem(last=False)
        return arr, index

    def _row_index(self, rank: int, step: int, index: dict[str, int], name: str) -> int:
        i = index.get(name)
        if i is None:
            close = difflib.get_close_matches(name, list(index), n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise RecordNotFoundError(f"no record {name!r} in rank {rank} step {step}{hint}")
        return i

    def _bytes(self, rank: int, step: int, name: str) -> tuple[np.ndarray, str, tuple]:
        row = self.row(rank, step, name)
        offset, nbytes, dtype = row.data_offset, row.data_nbytes, row.dtype
        shape = parse_shape(row.shape)
        if offset < 0:
            mode = self.attrs(rank, step).get("mode")
            raise DumpFormatError(f"record {name!r} (rank {rank} step {step}) has no tensor "
                                  f"data: the dump was made with mode {mode!r}; dump with mode "
                                  f"'tensor' or 'full' to keep tensors")
        f = self._open(rank, step)
        stored = int(f["tensors"].shape[0]) if "tensors" in f else 0
        strides = row.strides
        itemsize = element_size(dtype) or nbytes // max(1, math.prod(shape))
        want = (stored_extent(shape, parse_shape(strides)) if strides else math.prod(shape)) \
            * itemsize
        # strided rows: c_order_bytes checks that the strides stay inside the bytes
        if (offset + nbytes > stored or row.numel != math.prod(shape)
                or (element_size(dtype) and not strides and nbytes != want)
                or row.numel * itemsize > _memory_bytes()):
            # checked before reading: the row's claims decide how much is allocated
            raise DumpFormatError(
                f"{self.path(rank, step)}: record {name!r} claims {nbytes:,} bytes at offset "
                f"{offset:,} of /tensors ({stored:,} bytes), for {row.numel:,} elements of "
                f"shape [{row.shape}] and dtype {dtype}: the /records table is damaged (or "
                f"the tensor is larger than this machine's memory); dump that step again")
        data = np.ascontiguousarray(f["tensors"][offset:offset + nbytes], dtype=np.uint8)
        if strides:
            # the bytes run from the first element to the last, with gaps for a slice of
            # another record's bytes (3.0): the element size comes from the dtype
            data = c_order_bytes(data, itemsize, shape, parse_shape(strides))
        return data, dtype, shape


def _memory_bytes() -> int:
    """This machine's physical memory: no record is read whole into more (an expansion, stride
    0, may claim more elements than it stores bytes for, but never more than memory held)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # no sysconf: no bound beyond the others
        return 1 << 62


def _short_list(values: list[int], limit: int = 12) -> str:
    if len(values) <= limit:
        return ", ".join(map(str, values)) or "none"
    return ", ".join(map(str, values[:limit])) + f", ... ({len(values)} in all)"

