"""One step file read back: its format version, status and config (root attributes), and its
/records and /sketches tables checked against the CRC-32 stored with them. The `Dump` object,
the diff's tensor reader and the listing behind `sleuth dump ls` all read a file's metadata
here; nothing here trusts what the file claims (JSON with size and depth limits, tables whose
bytes must match their checksum). No torch.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from tracer._errors import DumpFormatError
from tracer.storage._bounded_json import JsonLimitError, loads_bounded
from tracer.storage._format import FORMAT_MAJOR, records_crc32
from tracer.storage._sketch import SKETCH_SIZE

READ_ERRORS = (DumpFormatError, OSError, KeyError, ValueError, IndexError, TypeError,
               RuntimeError)
"""What a damaged HDF5 file raises while it is read: the reader's own error for a table it
recognises as damaged, and h5py's and numpy's for metadata or data that does not read."""
STR_FIELDS_REC = ("name", "module", "op", "phase", "direction", "dtype", "shape", "source",
                  "strides", "caller")
"""The text columns of /records (bytes in the file, str in a DataFrame)."""
STR_FIELDS_HIT = ("name", "condition", "source")
"""The text columns of /hits."""


class NewerFormat(DumpFormatError):
    """A file of a newer major format: refused outright, never skipped as damaged."""


def check_version(f: h5py.File, path: Path, attrs: Any = None) -> None:
    """DumpFormatError unless `f` is a sleuth step file of a major format this release reads
    (NewerFormat for a newer one). `attrs`: `f.attrs`, when the caller has it (each `f.attrs`
    costs ~0.15 ms)."""
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
        raise NewerFormat(
            f"{path} has dump format_version {version}; this sleuth reads formats 1.x to "
            f"{FORMAT_MAJOR}.x: upgrade sleuth to a release that reads format {major}.x")


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def step_status(attrs: Any) -> tuple[str, str]:
    """(status, reason) from a step file's root attributes: ("complete", "") for a step that
    ended at its optimizer step, ("interrupted", why) for one cut short (why: "" where the
    file names none). Files before format 3.1 carry no `status`: their `complete` attribute
    decides. The one rule: the scan, the reader and check all say a step's status by it."""
    status = _text(attrs.get("status", ""))
    if status == "interrupted":
        return "interrupted", _text(attrs.get("status_reason", ""))
    if not status and not int(attrs.get("complete", 1)):  # before format 3.1
        return "interrupted", ("the step was never ended (complete=0, no reason recorded: the "
                               "process exited or failed mid-step)")
    return "complete", ""


def table_to_frame(arr: np.ndarray, fields: tuple[str, ...], str_fields: tuple[str, ...]):
    """A stored table (numpy structured array) as a DataFrame of `fields`, text decoded; a
    column newer than the file (1.x files have no `strides`) comes empty."""
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


def read_records(f: h5py.File, path: Path) -> tuple[np.ndarray, dict[str, int]]:
    """(/records of the open step file `f`, record name -> row); DumpFormatError (see
    `damaged_table`) when it is not a table of records or its bytes changed on disk."""
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
        raise damaged_table(path, e) from e
    return arr, index


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


def damaged_table(path: Path, cause: BaseException) -> DumpFormatError:
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
