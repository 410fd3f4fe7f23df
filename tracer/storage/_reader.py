"""Read dumps back: `open_dump(path) -> Dump`, statistics as DataFrames, tensors lazily.

This module must not import torch at module level: `sleuth diff` and the dashboard read dumps
without it. Only `Dump.tensor_torch` imports torch. Dtypes numpy lacks (bfloat16, float8) are
stored as raw bits and decoded here from the `dtype` column (docs/dump-format.md).
"""
from __future__ import annotations

import difflib
import json
import math
import os
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any, NamedTuple

import h5py
import numpy as np

from tracer._errors import DumpFormatError, RecordNotFoundError, warn
from tracer.storage._bounded_json import JsonLimitError, loads_bounded
from tracer.storage._h5open import open_h5, path_problem
from tracer.storage._format import (CALL_FIELDS, FORMAT_MAJOR, HIT_FIELDS, RECORD_FIELDS,
                                    RecordRow, records_crc32)
from tracer.storage._sketch import SKETCH_SIZE, row_of
from tracer.storage._layout import stored_extent
from tracer.storage._lock import DUMP_JSON, one_run

_STEP_RE = re.compile(r"^step(\d+)\.h5$")
_PARTIAL_RE = re.compile(r"^step(\d+)\.h5(?:\.data)?\.partial$")
_TRUNCATED_RE = re.compile(r"truncated file: eof = (\d+).*stored_eof = (\d+)")
_RANK_RE = re.compile(r"^rank(\d+)$")
_STR_FIELDS_REC = ("name", "module", "op", "phase", "direction", "dtype", "shape", "source",
                   "strides", "caller")
_STR_FIELDS_HIT = ("name", "condition", "source")
_OPEN_FILES = 8  # h5py handles kept open per Dump
_CACHED_TABLES = 4  # /records tables kept decoded per Dump


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


def _table_to_frame(arr: np.ndarray, fields: tuple[str, ...], str_fields: tuple[str, ...]):
    import pandas as pd

    cols: dict[str, Any] = {}
    names = arr.dtype.names or ()
    for f in fields:
        if f not in names:  # a column newer than the file (1.x files have no `strides`)
            cols[f] = [""] * len(arr) if f in str_fields else np.zeros(len(arr), np.int64)
            continue
        col = arr[f]
        if f in str_fields:
            col = [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in col]
        cols[f] = col
    return pd.DataFrame(cols, columns=list(fields))


def _check_version(f: h5py.File, path: Path, attrs: Any = None) -> None:
    """`attrs`: `f.attrs`, when the caller has it (each `f.attrs` costs ~0.15 ms)."""
    version = (f.attrs if attrs is None else attrs).get("format_version")
    if isinstance(version, bytes):
        version = version.decode()
    if not isinstance(version, str):
        raise DumpFormatError(f"{path} has no format_version attribute: not a sleuth dump file")
    try:
        major = int(version.split(".")[0])
    except ValueError as e:
        raise DumpFormatError(f"{path}: bad format_version {version!r}") from e
    if major > FORMAT_MAJOR:
        raise _NewerFormat(
            f"{path} has dump format_version {version}; this sleuth reads formats 1.x to "
            f"{FORMAT_MAJOR}.x: upgrade sleuth to a release that reads format {major}.x")


class FileState(NamedTuple):
    """What `open_dump` found about one step file (or one rank folder).

    `state` is one of:
    - "complete": read and ended normally;
    - "interrupted": readable, but the step was ended by an exception, a signal or the process
      exiting (root attribute `status` "interrupted", or `complete` 0 in older files); its
      records are the ones made so far, and `reason` says why it ended;
    - "partial_only": only a `*.partial` file exists for the step (being written, or left by
      a crash before it was complete): nothing of the step can be read;
    - "partial": a `*.partial` file left beside the complete file of the same step (ignored);
    - "truncated": the file is shorter than its HDF5 superblock says (a copy cut short, a
      disk that filled);
    - "unreadable": the file does not open as a dump file (damaged, or not written by sleuth);
    - "empty": a rank folder with no step file at all (`step` is None);
    - "other_run": a readable file written by another run than the dump's (its `run_id`), left
      out so that two runs' files are never combined (`open_dump`).
    """

    path: str
    rank: int
    step: int | None
    state: str
    reason: str = ""
    run_id: str = ""
    """The run that wrote the file ("" before run ids, or when it could not be read)."""


PROBLEM_STATES = ("interrupted", "partial_only", "truncated", "unreadable", "empty",
                  "other_run")
"""FileState.state values that mean a step was not fully read ("partial" is a stale leftover
beside a complete file, worth a note only; "other_run" a file of another run where this run's
step would be, which is not this run's step)."""


class _NewerFormat(DumpFormatError):
    """A file of a newer major format: refused outright, never skipped as damaged."""


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
                             status=_status(f.attrs)[0], path=str(path)))
        return pd.DataFrame(rows, columns=["rank", "step", "records", "tensor_bytes",
                                           "file_bytes", "complete", "status", "path"])

    def status(self, rank: int = 0, step: int | None = None) -> tuple[str, str]:
        """(status, reason) of a step: ("complete", "") for a step that ended at its optimizer
        step (or `Dumper.step()`), ("interrupted", why) for one cut short by an exception, a
        signal or the process exiting, whose file holds the records made until then. Files
        older than format 3.1 carry no status: their `complete` attribute decides."""
        return _status(self._open(rank, self._default_step(rank, step)).attrs)

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
            return _table_to_frame(arr, RECORD_FIELDS, _STR_FIELDS_REC)
        except (ValueError, TypeError) as e:  # text columns that are not UTF-8
            raise _damaged(self.path(rank, step), e) from e

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
            raise _damaged(self.path(rank, step), e) from e

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
        return _table_to_frame(f["calls"][()], CALL_FIELDS, ("name", "spec"))

    def hits(self, rank: int = 0, step: int | None = None):
        """The /hits table (watchpoint hits) of a step as a DataFrame; empty when none."""
        import pandas as pd

        f = self._open(rank, self._default_step(rank, step))
        if "hits" not in f:
            return pd.DataFrame(columns=list(HIT_FIELDS))
        return _table_to_frame(f["hits"][()], HIT_FIELDS, _STR_FIELDS_HIT)

    # -- tensors -----------------------------------------------------------------------------
    def tensor(self, rank: int, step: int, name: str, raw: bool = False):
        """The tensor of record `name` as numpy, read now.

        bfloat16 and float8 come upcast to float32 (exactly). `raw=True` returns a RawTensor
        (bits as unsigned integers of the element width, dtype name) instead. Raises
        DumpFormatError when the dump holds no bytes for it (mode 'statistics').
        """
        data, dtype, shape = self._bytes(rank, step, name)
        if raw:
            size = element_size(dtype)
            uint = _UINT_OF_SIZE.get(size)
            bits = data.view(uint) if uint is not None else data.view(np.uint64)
            return RawTensor(bits.reshape(shape) if uint is not None else bits, dtype)
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
        _check_version(f, path)
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
        f = self._open(rank, step)
        path = self.path(rank, step)
        if "records" not in f:
            raise DumpFormatError(f"{path} has no /records table")
        try:
            arr = f["records"][()]
            names = arr["name"] if arr.ndim == 1 and "name" in (arr.dtype.names or ()) else None
            if names is None:
                raise ValueError(f"it is not a list of records (dtype {arr.dtype}, shape "
                                 f"{arr.shape})")
            want = f.attrs.get("records_crc32")  # files before format 3.1 have none
            if want is not None and records_crc32(arr) != int(want):
                raise ValueError("its bytes do not match the CRC-32 stored with them: they "
                                 "changed on disk")
            index = {n.decode() if isinstance(n, bytes) else n: i for i, n in enumerate(names)}
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
            raise _damaged(path, e) from e
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


def read_sketches(f: Any, path: Path) -> tuple[np.ndarray | None, str]:
    """(/sketches of the open step file `f`, its scheme), or (None, "") when it has none;
    DumpFormatError when the array is not one row of SKETCH_SIZE values per record or its
    bytes changed on disk (its CRC-32)."""
    if "sketches" not in f:
        return None, ""
    try:
        arr = f["sketches"][()]
        rows = f["records"].shape[0] if "records" in f else -1
        if arr.ndim != 2 or arr.shape != (rows, SKETCH_SIZE) or arr.dtype.kind != "f":
            raise ValueError(f"it is not {SKETCH_SIZE} values per record (shape {arr.shape}, "
                             f"{rows} records)")
        want = f.attrs.get("sketches_crc32")
        if want is None or records_crc32(arr) != int(want):
            raise ValueError("its bytes do not match the CRC-32 stored with them")
        scheme = f.attrs.get("sketch_scheme", "")
        scheme = scheme.decode() if isinstance(scheme, bytes) else str(scheme)
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise DumpFormatError(f"{path}: the /sketches array is damaged ({e}); read this "
                              f"step's statistics without it by comparing with tensors, or "
                              f"dump the step again") from e
    return arr, scheme


def _memory_bytes() -> int:
    """This machine's physical memory: no record is read whole into more (an expansion, stride
    0, may claim more elements than it stores bytes for, but never more than memory held)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # no sysconf: no bound beyond the others
        return 1 << 62


def _damaged(path: Path, cause: BaseException) -> DumpFormatError:
    """The error for a step file whose /records table cannot be read as records."""
    return DumpFormatError(f"{path}: the /records table is damaged ({type(cause).__name__}: "
                           f"{cause}); this step cannot be read: re-run it, or move the file "
                           f"away to read the other steps")


def config_of(attrs: dict[str, Any], source: str = "a step file") -> dict[str, Any]:
    """The dump config a step file was written with (its root attributes' `config` JSON),
    or {} when it has none that reads. JsonLimitError (naming `source`) when the text is
    larger or nested deeper than any config sleuth writes: read within those limits, since
    the text is the file's."""
    try:
        config = loads_bounded(attrs.get("config", "{}"), f"{source}: config attribute")
    except JsonLimitError as e:
        if isinstance(e.__cause__, json.JSONDecodeError):
            return {}  # a config that does not parse is left out, as before size limits
        raise
    except TypeError:
        return {}
    return config if isinstance(config, dict) else {}


def op_capture_of(attrs: dict[str, Any], source: str = "a step file") -> str:
    """How a step file's ops were seen: "observer" for a file written through the compiled op
    observer (its config says so; it records a few ops differently, docs/tracer.md, "Dumps
    made with the op observer"), else "dispatch" (the one capture)."""
    return "observer" if config_of(attrs, source).get("op_capture") == "observer" else \
        "dispatch"


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


def _short_list(values: list[int], limit: int = 12) -> str:
    if len(values) <= limit:
        return ", ".join(map(str, values)) or "none"
    return ", ".join(map(str, values[:limit])) + f", ... ({len(values)} in all)"


def _status(attrs: Any) -> tuple[str, str]:
    """(status, reason) from a step file's root attributes (`Dump.status`)."""
    status = attrs.get("status")
    if status is None:  # before format 3.1
        return (("complete", "") if int(attrs.get("complete", 1)) else
                ("interrupted", "the writer closed with the step open (no reason recorded "
                                "before format 3.1)"))
    reason = attrs.get("status_reason", "")
    decode = (lambda v: v.decode() if isinstance(v, bytes) else str(v))
    return decode(status), decode(reason)


def open_dump(path: str | Path) -> Dump:
    """Open a dump: a run directory, its dump/ folder, one rank folder, or one step file.

    Every step file is classified (`Dump.file_states`, see FileState): partial files
    (`*.partial`, being written or left by a crash), truncated and unreadable files are left
    out of the readable steps and listed in `Dump.skipped` with a warning; interrupted steps
    stay readable and are listed in `Dump.problems` with the reason. Files of different runs are
    never combined: the files of the run `dump/dump.json` names (without it, of the run that
    wrote the newest file) are kept, the others are "other_run" and skipped (docs/dump-format.md,
    "Run id"). Raises DumpFormatError when
    there is no dump at `path`, a single step file given as `path` cannot be read, or a file
    has a newer major format version than this release reads.
    """
    p = Path(path)
    if not p.exists():
        problem = path_problem(p)
        raise DumpFormatError(f"{p}: {problem}" if problem else
                              f"no dump at {p}: the path does not exist")
    files: dict[tuple[int, int], Path] = {}
    states: list[FileState] = []
    if p.is_file():
        if p.name.endswith(".partial"):
            raise DumpFormatError(f"{p} is a partial file (being written, or left by a crash); "
                                  f"open the complete step{{S}}.h5 files instead")
        try:
            rank, step, state = _identify(p)
        except _Unreadable as e:
            raise DumpFormatError(f"cannot read dump file {p}: {e}") from e
        files[(rank, step)] = p
        states.append(state)
        root = p
    else:
        if (p / "dump").is_dir():
            p = p / "dump"
        rank_dirs = [(int(m.group(1)), d) for d in p.iterdir()
                     if d.is_dir() and (m := _RANK_RE.match(d.name))]
        if not rank_dirs and any(_STEP_RE.match(c.name) or _PARTIAL_RE.match(c.name)
                                 for c in p.iterdir()):
            m = _RANK_RE.match(p.name)
            rank_dirs = [(int(m.group(1)) if m else -1, p)]
        if not rank_dirs:
            raise DumpFormatError(f"no dump at {path}: expected RUN/dump/rank{{R}}/step{{S}}.h5 "
                                  f"(give a run directory, its dump/ folder, a rank folder or a "
                                  f"step file)")
        root = p
        for rank, d in sorted(rank_dirs):
            _scan_rank(rank, d, files, states)
        files, states = _one_run(files, states, _dump_dir(p))
    skipped = [(s.path, s.reason) for s in states
               if s.state in ("partial", "partial_only", "truncated", "unreadable", "other_run")]
    if skipped:
        warn(f"skipped {len(skipped)} partial, unreadable or other-run file(s) under {root}, "
             f"e.g. {skipped[0][0]} ({skipped[0][1]})", stacklevel=2)
    return Dump(files, skipped, root, states)


def _one_run(files: dict[tuple[int, int], Path], states: list[FileState],
             dump_dir: Path | None) -> tuple[dict[tuple[int, int], Path], list[FileState]]:
    """The files of one run only (`tracer.storage._lock.one_run`); the others' states become
    "other_run" with the reason."""
    by_path = {s.path: s for s in states}
    run_ids = {key: by_path[str(path)].run_id for key, path in files.items()}
    kept, others = one_run(files, run_ids, dump_dir)
    if not others:
        return files, states
    reasons = dict(others)
    return kept, [s._replace(state="other_run", reason=reasons[s.path]) if s.path in reasons
                  else s for s in states]


_PARTIAL_REASON = "partial file: being written, or left by a crash before it was complete"


def _scan_rank(rank: int, d: Path, files: dict[tuple[int, int], Path],
               states: list[FileState]) -> None:
    """Classify the files of one rank folder (rank -1: a folder of step files whose rank is
    read from each file) into `files` (readable steps) and `states`."""
    partials: list[tuple[Path, int | None]] = []
    found = False
    for child in sorted(d.iterdir()):
        m = _STEP_RE.match(child.name)
        pm = _PARTIAL_RE.match(child.name)
        if pm:
            partials.append((child, int(pm.group(1))))
            found = True
        elif m:
            found = True
            try:
                if rank < 0:
                    r, s, state = _identify(child)
                else:
                    r, s = rank, int(m.group(1))
                    state = _probe(child, r, s)
            except _Unreadable as e:
                states.append(FileState(str(child), rank, int(m.group(1)), e.state, str(e)))
                continue
            files[(r, s)] = child
            states.append(state)
    used: set[int | None] = {s for _, s in files} if rank < 0 else \
        {s for r, s in files if r == rank}
    for child, step in partials:
        if step in used:  # a leftover beside the step's complete file, or a second partial
            states.append(FileState(str(child), rank, step, "partial", _PARTIAL_REASON
                                    + "; the step's complete file (or first partial) is used"))
            continue
        used.add(step)
        states.append(FileState(str(child), rank, step, "partial_only", _PARTIAL_REASON))
    if not found:
        states.append(FileState(str(d), rank, None, "empty",
                                "empty rank folder: no step file (the run dumped nothing here, "
                                "or its files were removed)"))


class _Unreadable(Exception):
    def __init__(self, message: str, state: str = "unreadable") -> None:
        super().__init__(message)
        self.state = state


def _open_error(path: Path, e: OSError) -> _Unreadable:
    """An h5py open error in words: "truncated" when the file is shorter than HDF5 expects;
    a soft link that loops or leads nowhere named as such, not by HDF5's text."""
    problem = path_problem(path)
    if problem:
        return _Unreadable(f"unreadable: {problem}")
    m = _TRUNCATED_RE.search(str(e))
    if m:
        return _Unreadable(f"truncated: the file has {m.group(1)} bytes but its HDF5 superblock "
                           f"says {m.group(2)} (a copy cut short, a disk that filled, or a "
                           f"writer killed mid-write); dump that step again", "truncated")
    return _Unreadable(f"unreadable: {e}; the file is damaged or not an HDF5 dump file")


def _state_of(f: h5py.File, path: Path, rank: int, step: int) -> FileState:
    """"complete" or "interrupted" (with its reason) from a step file's root attributes.
    Files without `status` predate it: `complete` 0 then means the same as "interrupted"."""
    status = f.attrs.get("status", "")
    status = status.decode() if isinstance(status, bytes) else str(status)
    reason = f.attrs.get("status_reason", "")
    reason = reason.decode() if isinstance(reason, bytes) else str(reason)
    run_id = f.attrs.get("run_id", "")  # "" in files written before run ids
    run_id = run_id.decode() if isinstance(run_id, bytes) else str(run_id)
    if status == "interrupted":
        return FileState(str(path), rank, step, "interrupted",
                         f"interrupted: {reason or 'no reason recorded'}", run_id)
    if not status and not int(f.attrs.get("complete", 1)):
        return FileState(str(path), rank, step, "interrupted",
                         "interrupted: the step was never ended (complete=0: the process "
                         "exited or failed mid-step)", run_id)
    return FileState(str(path), rank, step, "complete", run_id=run_id)


def _probe(path: Path, rank: int, step: int) -> FileState:
    """Check that `path` opens and has a version this release reads; its FileState."""
    try:
        with h5py.File(path, "r") as f:
            _check_version(f, path)
            return _state_of(f, path, rank, step)
    except OSError as e:
        raise _open_error(path, e) from e
    except _NewerFormat:
        raise
    except (DumpFormatError, RuntimeError, ValueError, TypeError, KeyError) as e:
        # damaged metadata: attributes that do not decode, a missing format_version
        raise _Unreadable(f"unreadable: {e}; the file is damaged or not a sleuth dump file") \
            from e


def _dump_dir(p: Path) -> Path | None:
    """The dump folder (holding rank{R}/ and dump.json) of a dump or rank folder."""
    if (p / DUMP_JSON).is_file() or any(_RANK_RE.match(c.name) for c in p.iterdir()):
        return p
    return p.parent if _RANK_RE.match(p.name) else None


def _identify(path: Path) -> tuple[int, int, FileState]:
    """(rank, step, FileState) of one step file, from its attributes."""
    try:
        with h5py.File(path, "r") as f:
            _check_version(f, path)
            rank, step = int(f.attrs["rank"]), int(f.attrs["step"])
            return rank, step, _state_of(f, path, rank, step)
    except OSError as e:
        raise _open_error(path, e) from e
    except KeyError as e:
        raise _Unreadable(f"unreadable: it lacks the rank/step attributes of a dump file "
                          f"({e})") from e
    except _NewerFormat:
        raise
    except (DumpFormatError, RuntimeError, ValueError, TypeError) as e:
        raise _Unreadable(f"unreadable: {e}; the file is damaged or not a sleuth dump file") \
            from e
