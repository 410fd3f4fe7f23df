"""Read dumps back: `open_dump(path) -> Dump`, statistics as DataFrames, tensors lazily.

This module must not import torch at module level: `sleuth diff` and the dashboard read dumps
without it. Only `Dump.tensor_torch` imports torch. Dtypes numpy lacks (bfloat16, float8) are
stored as raw bits and decoded here from the `dtype` column (docs/dump-format.md).
"""
from __future__ import annotations

import json
import difflib
import math
import re
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any, NamedTuple

import h5py
import numpy as np

from tracer._errors import DumpFormatError, RecordNotFoundError
from tracer._format import FORMAT_MAJOR, HIT_FIELDS, RECORD_FIELDS
from tracer._lock import RUN_FILE, one_run

_STEP_RE = re.compile(r"^step(\d+)\.h5$")
_RANK_RE = re.compile(r"^rank(\d+)$")
_STR_FIELDS_REC = ("name", "module", "op", "phase", "direction", "dtype", "shape", "source",
                   "strides")
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


def _cell(row: np.void, field: str) -> Any:
    """One column of a /records row as a Python value: strings decoded, "" for a column the
    file does not have (1.x files have no `strides`)."""
    names = row.dtype.names or ()
    if field not in names:
        return ""
    value = row[field]
    if isinstance(value, bytes):
        return value.decode("utf-8")
    return value if isinstance(value, str) else value.item()


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
        raise DumpFormatError(
            f"{path} has dump format_version {version}; this sleuth reads formats 1.x to "
            f"{FORMAT_MAJOR}.x: upgrade sleuth to a release that reads format {major}.x")


class Dump:
    """A dump on disk: ranks, steps, per-step statistics and tensors (see open_dump)."""

    def __init__(self, files: dict[tuple[int, int], Path], skipped: list[tuple[str, str]],
                 root: Path) -> None:
        self.root = root
        self._files = dict(sorted(files.items()))
        self.skipped = skipped
        """(path, reason) of each file that was ignored: partial, unreadable, or written by
        another run than the dump's (see `open_dump`)."""
        self._handles: OrderedDict[Path, h5py.File] = OrderedDict()
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
        path (reads only file metadata)."""
        import pandas as pd

        rows = []
        for (rank, step), path in self._files.items():
            f = self._open(rank, step)
            rows.append(dict(rank=rank, step=step, records=int(f["records"].shape[0]),
                             tensor_bytes=int(f["tensors"].shape[0]) if "tensors" in f else 0,
                             file_bytes=path.stat().st_size,
                             complete=bool(f.attrs.get("complete", 1)), path=str(path)))
        return pd.DataFrame(rows, columns=["rank", "step", "records", "tensor_bytes",
                                           "file_bytes", "complete", "path"])

    def path(self, rank: int, step: int) -> Path:
        """The file of (rank, step); DumpFormatError naming what exists when there is none."""
        try:
            return self._files[(rank, step)]
        except KeyError:
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
        import pandas as pd

        if step is None:
            frames = []
            for s in self.steps(rank):
                df = self.stats(rank, s)
                df.insert(0, "step", s)
                frames.append(df)
            if not frames:
                return pd.DataFrame(columns=["step", *RECORD_FIELDS])
            return pd.concat(frames, ignore_index=True)
        arr, _ = self._table(rank, step)
        return _table_to_frame(arr, RECORD_FIELDS, _STR_FIELDS_REC)

    records = stats

    def record(self, rank: int, step: int, name: str) -> dict[str, Any]:
        """One record's row as a dict."""
        arr, index = self._table(rank, step)
        row = arr[self._row_index(rank, step, index, name)]
        return {f: _cell(row, f) for f in RECORD_FIELDS}

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
        strides = self.record(rank, step, name).get("strides") or ""
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
            f = h5py.File(path, "r")
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
        if "records" not in f:
            raise DumpFormatError(f"{self.path(rank, step)} has no /records table")
        arr = f["records"][()]
        index = {n.decode() if isinstance(n, bytes) else n: i for i, n in enumerate(arr["name"])}
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
        arr, index = self._table(rank, step)
        row = arr[self._row_index(rank, step, index, name)]
        offset, nbytes = int(row["data_offset"]), int(row["data_nbytes"])
        dtype, shape = _cell(row, "dtype"), parse_shape(_cell(row, "shape"))
        if offset < 0:
            mode = self.attrs(rank, step).get("mode")
            raise DumpFormatError(f"record {name!r} (rank {rank} step {step}) has no tensor "
                                  f"data: the dump was made with mode {mode!r}; dump with mode "
                                  f"'tensor' or 'full' to keep tensors")
        data = self._open(rank, step)["tensors"][offset:offset + nbytes]
        data = np.ascontiguousarray(data, dtype=np.uint8)
        strides = _cell(row, "strides")
        if strides:
            # the bytes run from the first element to the last, with gaps for a slice of
            # another record's bytes (3.0): the element size comes from the dtype
            itemsize = element_size(dtype) or nbytes // max(1, math.prod(shape))
            data = c_order_bytes(data, itemsize, shape, parse_shape(strides))
        return data, dtype, shape


def config_of(attrs: dict[str, Any]) -> dict[str, Any]:
    """The dump config a step file was written with (its root attributes' `config` JSON),
    or {} when it has none that reads."""
    try:
        config = json.loads(attrs.get("config", "{}"))
    except (TypeError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def op_capture_of(attrs: dict[str, Any]) -> str:
    """How a step file's ops were seen: "dispatch" or "observer" ("dispatch" for files
    written before the key; "auto" only where a writer was used without a Dumper)."""
    return str(config_of(attrs).get("op_capture", "dispatch"))


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


def open_dump(path: str | Path) -> Dump:
    """Open a dump: a run directory, its dump/ folder, one rank folder, or one step file.

    Partial files (`*.partial`, being written or left by a crash) and unreadable files are
    listed in `Dump.skipped` with a warning. Files of different runs are never combined: the
    files of the run `dump/dump.json` names (without it, of the run that wrote the newest file)
    are kept and the others listed in `Dump.skipped` (docs/dump-format.md, "Run id").
    Raises DumpFormatError when there is no dump at `path` or a file has a newer major format
    version than this release reads.
    """
    p = Path(path)
    if not p.exists():
        raise DumpFormatError(f"no dump at {p}: the path does not exist")
    files: dict[tuple[int, int], Path] = {}
    run_ids: dict[tuple[int, int], str] = {}
    skipped: list[tuple[str, str]] = []
    if p.is_file():
        if p.name.endswith(".partial"):
            raise DumpFormatError(f"{p} is a partial file (being written, or left by a crash); "
                                  f"open the complete step{{S}}.h5 files instead")
        try:
            rank, step = _identify(p)
        except _Unreadable as e:
            raise DumpFormatError(f"cannot read dump file {p}: {e}") from e
        files[(rank, step)] = p
        root = p
    else:
        if (p / "dump").is_dir():
            p = p / "dump"
        rank_dirs = [(int(m.group(1)), d) for d in p.iterdir()
                     if d.is_dir() and (m := _RANK_RE.match(d.name))]
        if not rank_dirs and any(_STEP_RE.match(c.name) or c.name.endswith(".partial")
                                 for c in p.iterdir()):
            m = _RANK_RE.match(p.name)
            rank_dirs = [(int(m.group(1)) if m else -1, p)]
        if not rank_dirs:
            raise DumpFormatError(f"no dump at {path}: expected RUN/dump/rank{{R}}/step{{S}}.h5 "
                                  f"(give a run directory, its dump/ folder, a rank folder or a "
                                  f"step file)")
        root = p
        for rank, d in sorted(rank_dirs):
            for child in sorted(d.iterdir()):
                m = _STEP_RE.match(child.name)
                if child.name.endswith(".partial"):
                    skipped.append((str(child), "partial file: being written, or left by a "
                                                "crash before it was complete"))
                elif m:
                    try:
                        if rank < 0:
                            r, s = _identify(child)
                            run_id = _probe(child)
                        else:
                            r, s, run_id = rank, int(m.group(1)), _probe(child)
                    except _Unreadable as e:
                        skipped.append((str(child), str(e)))
                        continue
                    files[(r, s)] = child
                    run_ids[(r, s)] = run_id
        files, other_runs = one_run(files, run_ids, _dump_dir(p))
        skipped.extend(other_runs)
    if skipped:
        warnings.warn(f"sleuth dump: skipped {len(skipped)} partial, unreadable or other-run "
                      f"file(s) under {root}, e.g. {skipped[0][0]} ({skipped[0][1]})",
                      RuntimeWarning, stacklevel=2)
    return Dump(files, skipped, root)


class _Unreadable(Exception):
    pass


def _probe(path: Path) -> str:
    """Check that `path` opens and has a version this release reads; returns its run id
    ("" for a file written before run ids)."""
    try:
        with h5py.File(path, "r") as f:
            attrs = f.attrs
            _check_version(f, path, attrs)
            run_id = attrs.get("run_id", "")  # "" in files written before run ids
    except OSError as e:
        raise _Unreadable(f"unreadable: {e}") from e
    return run_id.decode() if isinstance(run_id, bytes) else str(run_id)


def _dump_dir(p: Path) -> Path | None:
    """The dump folder (holding rank{R}/ and dump.json) of a dump or rank folder."""
    if (p / RUN_FILE).is_file() or any(_RANK_RE.match(c.name) for c in p.iterdir()):
        return p
    return p.parent if _RANK_RE.match(p.name) else None


def _identify(path: Path) -> tuple[int, int]:
    """(rank, step) of one step file, from its attributes."""
    try:
        with h5py.File(path, "r") as f:
            _check_version(f, path)
            return int(f.attrs["rank"]), int(f.attrs["step"])
    except OSError as e:
        raise _Unreadable(f"unreadable: {e}") from e
    except KeyError as e:
        raise DumpFormatError(f"{path} lacks the rank/step attributes of a dump file") from e
