"""The HDF5 step file's contract (docs/dump-format.md): its format version, the columns of
/records, /hits and /calls, the row types both writers fill and the reader gives back
(`RecordMeta`, `RecordRow`), where a step file lies (`step_path`), its root attributes and
status, and the CRC-32 that seals its tables.

The file is built as `step{S}.h5.partial`, fsynced and renamed (tracer.storage._step_file): a
file without the suffix is always complete. The root attribute `records_crc32` holds the CRC-32
of /records' bytes, so a reader tells a table changed on disk from one written so (HDF5
checksums its metadata blocks, never a dataset's data).
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import zlib
from functools import lru_cache
from pathlib import Path
from typing import Any, NamedTuple

import h5py
import numpy as np


FORMAT_VERSION = "3.5"
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

    Every write path (StepFile's, in this process or in the file-writer process) calls
    this before it uses the attributes, so `status` always agrees with `complete`: an interrupted
    step keeps the reason its writer set (`Writer.end_step(status_reason=...)`), or UNENDED."""
    if complete:
        attrs["status"], attrs["status_reason"] = "complete", ""
    else:
        attrs["status"] = "interrupted"
        attrs["status_reason"] = str(attrs.get("status_reason") or UNENDED)


def records_crc32(table: np.ndarray) -> int:
    """CRC-32 of a table's bytes (/records, /sketches): what `write_objects` stores and the
    reader checks (the array h5py reads back has the bytes it was written from)."""
    return zlib.crc32(np.ascontiguousarray(table).tobytes())
