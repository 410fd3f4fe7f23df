"""`tracer.diff`: match the records of two dumps, compare each pair and name the first one that
diverges, in execution order.

The diff streams: statistics tables are read whole (no tensor bytes), tensors are read in
bounded chunks straight from the packed `/tensors` dataset, so a dump larger than RAM costs one
chunk of memory per side. Only numpy, h5py and pandas are used here, never torch.
"""
from __future__ import annotations

import math
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

import numpy as np

from tracer._align import align
from tracer._compare import (TensorMetrics, Tolerance, compare_stats, itemsize, judge_tensor,
                             nonfinite_differ)
from tracer._diff_plan import EXIT_OF_STATE, DiffError, Plan, Problem, Side, open_side, plan
from tracer._errors import DumpFormatError
from tracer._layout import dense_strides, stored_extent
from tracer._reader import c_order_bytes, op_capture_of, parse_shape

CHUNK_ELEMENTS = 1 << 22  # 16 MiB of float32 per side per read
_METRICS = ("cosine", "max_abs_err", "max_rel_err", "mean_abs_err", "rmse", "within",
            "nan_diff", "inf_diff", "min_rdiff", "max_rdiff", "mean_rdiff", "norm_rdiff",
            "checksum_equal")
_COUNTS = ("nan", "posinf", "neginf")  # per side, from the statistics rows
COLUMNS = ("order", "step", "rank", "b_step", "b_rank", "seq", "b_seq", "name", "b_name",
           "module", "op", "phase", "direction", "index", "source", "dtype", "b_dtype", "shape",
           "b_shape") + _COUNTS + tuple(f"b_{c}" for c in _COUNTS) + (
           "compared", "verdict") + _METRICS + ("reason",)
Progress = Callable[[int, int], None]
# errors h5py and numpy raise on a damaged file, besides OSError
_READ_ERRORS = (DumpFormatError, OSError, RuntimeError, ValueError, KeyError, TypeError,
                IndexError, UnicodeDecodeError)


@dataclass
class DiffResult:
    """What `tracer.diff` found."""

    status: Literal["same", "diverged", "incomplete"]
    """"same" only when every selected step of both sides was read completely and every
    matched record is within tolerance; "incomplete" when a step or record could not be read
    (or was interrupted: see `problems`), whatever the records read say; else "diverged"
    (records out of tolerance, or a step one side lacks)."""
    first_divergence: dict[str, Any] | None
    """The first divergent record in execution order (name, module, op, phase, step, rank,
    source, kind, reason, metrics), or None."""
    records: Any
    """pandas DataFrame, one row per record pair (or unmatched record), in execution order."""
    compared: Literal["tensor", "statistics", "mixed", "none"] = "none"
    """Whether tensors, statistics only, or some of each were compared."""
    notes: list[str] = field(default_factory=list)
    """Things worth knowing that are not divergences (e.g. levels differ, records unmatched)."""
    problems: list[Problem] = field(default_factory=list)
    """Each step (or record) of a side that was not fully read: missing, truncated,
    unreadable, partial-only, interrupted, damaged bytes, a read error while comparing."""
    left_out: list[Problem] = field(default_factory=list)
    """Steps `allow_missing` left out of the comparison, with what was wrong with them."""
    steps: list[dict[str, Any]] = field(default_factory=list)
    """One dict per compared step pair: rank, step, b_rank, b_step, status ("complete" or
    "interrupted", the worse of the two sides), reason, and its records' same/diverged counts."""

    @property
    def exit_code(self) -> int:
        """0 same; 1 diverged or the step sets differ; 2 something could not be read."""
        code = max((EXIT_OF_STATE.get(p.state, 2) for p in self.problems), default=0)
        return max(code, 1 if self.first_divergence else 0)

    def problem_counts(self) -> dict[str, int]:
        """Number of problems per state (missing, truncated, ...)."""
        out: dict[str, int] = {}
        for p in self.problems:
            out[p.state] = out.get(p.state, 0) + 1
        return out

    def counts(self) -> dict[str, int]:
        """Number of records per verdict (same, diverged, only_a, only_b)."""
        v = self.records["verdict"].value_counts()
        return {k: int(v.get(k, 0)) for k in ("same", "diverged", "only_a", "only_b")}

    def to_dict(self, records: bool = True) -> dict[str, Any]:
        """A JSON-ready dict: status, exit_code, first_divergence, compared, counts, problems,
        problem_counts, left_out, steps, notes, records."""
        out: dict[str, Any] = {"status": self.status, "exit_code": self.exit_code,
                               "first_divergence": self.first_divergence,
                               "compared": self.compared, "counts": self.counts(),
                               "problems": [p.to_dict() for p in self.problems],
                               "problem_counts": self.problem_counts(),
                               "left_out": [p.to_dict() for p in self.left_out],
                               "steps": self.steps, "notes": self.notes}
        if records:
            out["records"] = [_jsonable(r) for r in self.records.to_dict("records")]
        return out


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, np.generic):
            v = v.item()
        if isinstance(v, float) and not math.isfinite(v):
            v = None if math.isnan(v) else ("inf" if v > 0 else "-inf")
        out[k] = v
    return out


# -- comparing -------------------------------------------------------------------------------------
def _rows(df: Any) -> list[dict[str, Any]]:
    """The rows of a table as dicts (DataFrame.to_dict("records") is ~10x slower)."""
    cols = list(df.columns)
    return [dict(zip(cols, vals)) for vals in zip(*(df[c].tolist() for c in cols))]


def _has_data(row: dict[str, Any]) -> bool:
    return int(row.get("data_offset", -1)) >= 0 and int(row.get("data_nbytes", 0)) > 0


class _ReadError(DumpFormatError):
    """A side's step file failed while it was being compared: which side, file and state
    ("damaged" for bytes that do not match their checksum, else "read_error")."""

    def __init__(self, side: str, path: Path, message: str, state: str = "read_error") -> None:
        super().__init__(message)
        self.side, self.path, self.state = side, path, state


class _TensorReader:
    """Reads byte ranges of one step file's packed tensor dataset, in bounded chunks.

    The writer lays `/tensors` out contiguously, so its bytes are read with `os.preadv` at the
    dataset's file offset: no h5py call per chunk, no copy, and the GIL is released while the
    kernel reads. A chunked or compressed dataset falls back to h5py slicing.
    """

    def __init__(self, path: Path, side: str = "A") -> None:
        import h5py

        self.path, self.side = path, side
        self.fd: int | None = None
        try:
            self.file = h5py.File(path, "r")
            self.data = self.file["tensors"] if "tensors" in self.file else None
            self.attrs = {k: self.file.attrs[k] for k in ("level", "mode", "config")
                          if k in self.file.attrs}
            # files without the column cannot be checked (every format so far has it)
            self.checksums = "checksum" in (self.file["records"].dtype.names or ())
        except _READ_ERRORS as e:
            raise _ReadError(side, path, f"unreadable: {e}") from e
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

    def read(self, offset: int, nbytes: int, slot: int = 0) -> np.ndarray:
        """`nbytes` bytes at `offset` of /tensors as uint8; the array is reused by the next call
        with the same `slot`."""
        if self.data is None:
            raise _ReadError(self.side, self.path, "damaged: records point at tensor bytes but "
                             "the file has no /tensors dataset", "damaged")
        if offset < 0 or offset + nbytes > self.data.shape[0]:
            raise _ReadError(self.side, self.path, f"damaged: a record points at bytes "
                             f"{offset}..{offset + nbytes} of /tensors, which holds "
                             f"{self.data.shape[0]}: the /records table is damaged", "damaged")
        if self.fd is None:
            try:
                return self.data[offset:offset + nbytes]
            except _READ_ERRORS as e:
                raise _ReadError(self.side, self.path, f"read error: {e}") from e
        buf = self._bufs.get(slot)
        if buf is None or buf.nbytes < nbytes:
            buf = self._bufs[slot] = np.empty(max(nbytes, 4096), np.uint8)
        view = buf[:nbytes]
        got = 0
        while got < nbytes:
            try:
                n = os.preadv(self.fd, [memoryview(view[got:])], self.base + offset + got)
            except OSError as e:
                raise _ReadError(self.side, self.path, f"read error: {e}") from e
            if n <= 0:
                raise _ReadError(self.side, self.path, "read error: the file ends inside a "
                                 "tensor (truncated while it was read?)")
            got += n
        return view

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


def _verify(total: int, size: int, row: dict, f: _TensorReader) -> None:
    """Raise _ReadError ("damaged") unless the bytes read add up to the record's checksum."""
    bits = size * 8 if size in _SIGNED else 64
    total &= (1 << bits) - 1
    total = total - (1 << bits) if total >> (bits - 1) else total
    if total != int(row["checksum"]):
        raise _ReadError(f.side, f.path, f"damaged: the tensor bytes of record {row['name']} do "
                         f"not match the checksum stored with them ({total} vs "
                         f"{int(row['checksum'])}): the file was damaged after it was written; "
                         f"dump that step again", "damaged")


def _compare_tensor(ra: dict, rb: dict, fa: _TensorReader, fb: _TensorReader,
                    tol: Tolerance, progress: Callable[[int], None]) -> dict[str, Any]:
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
    for start in range(0, n, CHUNK_ELEMENTS):
        count = min(CHUNK_ELEMENTS, n - start)
        xa, xb = read_a(start, count), read_b(start, count)
        equal = acc.add_raw(xa, xb, da, db, norms=n > CHUNK_ELEMENTS)
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


def _check_stored(row: dict, n: int, size: int, strides: str, f: _TensorReader) -> None:
    """Raise _ReadError unless the record's `data_nbytes` is the range its dtype, shape and
    strides read (a damaged step file, or one not written by sleuth)."""
    want = _stored_nbytes(n, size, str(row["shape"]), strides)
    got = int(row["data_nbytes"])
    if got != want:
        raise _ReadError(
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


def _c_order_reader(f: _TensorReader, offset: int, size: int, n: int, shape: str,
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


def _whole_in_c_order(f: _TensorReader, offset: int, size: int, dims: tuple[int, ...],
                      steps: tuple[int, ...]) -> Callable[[int, int], np.ndarray]:
    """Read one record stored with element strides `steps` whole, from its first element to
    its last (`stored_extent`), into C order (a copy: the next read reuses the reader's
    buffer); returns a reader of element ranges of it."""
    raw = c_order_bytes(f.read(offset, stored_extent(dims, steps) * size), size, dims, steps)
    return lambda start, count: raw[start * size:(start + count) * size]


def _row_base(ra: dict | None, rb: dict | None, plan: Plan) -> dict:
    ref = ra if ra is not None else rb
    assert ref is not None
    row = {k: math.nan for k in COLUMNS}
    for prefix, r in (("", ra), ("b_", rb)):
        for c in _COUNTS:
            row[prefix + c] = int(r[c]) if r is not None else -1
    # `name` is the record's name on whichever side has it, so a row without a partner is
    # named in every table; `b_name` stays B's name ("" when B lacks the record)
    row.update(step=plan[1], rank=plan[0], b_step=plan[3], b_rank=plan[2],
               seq=int(ra["seq"]) if ra else -1, b_seq=int(rb["seq"]) if rb else -1,
               name=ref["name"], b_name=rb["name"] if rb else "",
               module=ref["module"], op=ref["op"], phase=ref["phase"],
               direction=ref["direction"], index=int(ref["index"]), source=ref["source"],
               dtype=ra["dtype"] if ra else "", b_dtype=rb["dtype"] if rb else "",
               shape=ra["shape"] if ra else "", b_shape=rb["shape"] if rb else "",
               compared="", reason="", checksum_equal=None)
    return row


def _compare_pair(ra: dict | None, rb: dict | None, fa: _TensorReader | None,
                  fb: _TensorReader | None, tol: Tolerance, plan: Plan,
                  progress: Callable[[int], None]) -> dict:
    row = _row_base(ra, rb, plan)
    if ra is None or rb is None:
        row["verdict"] = "only_b" if ra is None else "only_a"
        row["reason"] = f"no matching record in {'A' if ra is None else 'B'}"
        return row
    if ra["shape"] != rb["shape"]:
        row.update(verdict="diverged", compared="shape",
                   reason=f"shape [{ra['shape']}] vs [{rb['shape']}]")
        return row
    if _has_data(ra) and _has_data(rb) and fa is not None and fb is not None:
        row["compared"] = "tensor"
        row.update(_compare_tensor(ra, rb, fa, fb, tol, progress))
        if row["nan_diff"] or row["inf_diff"]:  # the NaN/Inf counts come first
            where = f"at {int(row['nan_diff']) + int(row['inf_diff'])} positions"
            rest = row["reason"].split("; ", 1)[1:]
            row["reason"] = "; ".join([f"{nonfinite_differ(ra, rb)} ({where})", *rest])
    else:
        row["compared"] = "statistics"
        row.update(compare_stats(ra, rb, tol))
    return row


_DATA_INPUT = re.compile(r"^<root>\.forward\.0\.input\.")


def _kind(row: dict[str, Any]) -> str:
    if _DATA_INPUT.match(str(row["name"])):
        return "data"
    if row["phase"] == "optimizer" and row["direction"] == "param":
        return "parameter"
    return "compute"


def _priority(phase: str, direction: str) -> int:
    # a parameter's value before the optimizer step was in force during forward and backward:
    # if weights differ, that is where the divergence starts, not at the first op that used them
    return 0 if (phase == "optimizer" and direction == "param") else 1


def _ordered(rows: list[dict]) -> list[dict]:
    """Execution order: by seq of A; records only B has are placed after the matched record that
    precedes them in B."""
    by_b = sorted((r for r in rows if r["b_seq"] >= 0), key=lambda r: r["b_seq"])
    last = -1.0
    for r in by_b:
        if r["seq"] >= 0:
            last = float(r["seq"])
            r["_pos"] = last
        else:
            last += 1e-6
            r["_pos"] = last
    for r in rows:
        if r["seq"] >= 0:
            r["_pos"] = float(r["seq"])
    rows.sort(key=lambda r: (r["step"], _priority(r["phase"], r["direction"]), r["_pos"]))
    for i, r in enumerate(rows):
        r["order"] = i
        del r["_pos"]
    return rows


def _first_divergence(rows: list[dict]) -> dict[str, Any] | None:
    for r in rows:
        if r["verdict"] == "diverged":
            keys = ("name", "module", "op", "phase", "step", "rank", "source", "b_name",
                    "b_step", "b_rank", "seq", "direction", "index", "dtype", "b_dtype",
                    "compared", "reason") + _METRICS
            fd = _jsonable({k: r[k] for k in keys})
            fd["kind"] = _kind(r)
            return fd
    return None


class _StderrProgress:
    """Progress on stderr: by bytes compared when there are tensors, else by records."""

    def __init__(self, total_bytes: int, total_records: int, enabled: bool) -> None:
        self.total_bytes, self.total_records = total_bytes, max(total_records, 1)
        self.bytes = self.records = 0
        self.enabled = enabled
        self.last = 0.0
        self.t0 = time.monotonic()

    def __call__(self, nbytes: int) -> None:
        self.bytes += nbytes
        self._show()

    def record(self) -> None:
        self.records += 1
        if self.records % 256 == 0:
            self._show()

    def _show(self) -> None:
        now = time.monotonic()
        if not self.enabled or now - self.last < 0.5:
            return
        self.last = now
        if self.total_bytes:
            rate = self.bytes / max(now - self.t0, 1e-9) / 2**20
            share = 100 * self.bytes / self.total_bytes
            done = f"{share:5.1f}% of {self.total_bytes / 2**20:.0f} MiB ({rate:.0f} MiB/s)"
        else:
            share = 100 * self.records / self.total_records
            done = f"{share:5.1f}% of {self.total_records} records"
        print(f"\rdiff: {done}", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled and self.last:
            print(file=sys.stderr, flush=True)


def diff(a: str | os.PathLike, b: str | os.PathLike, *, step: int | None = None,
         rank: int | None = 0, b_step: int | None = None, b_rank: int | None = None,
         tolerance: Tolerance | None = None, progress: bool = False,
         allow_missing: bool = False) -> DiffResult:
    """Compare dump A with dump B record by record and name the first divergent record.

    Args:
        a, b: run directories, dump directories (holding rank{R}/) or step files.
        step, rank: the step and rank of A; step None compares every step either dump holds.
        b_step, b_rank: the step and rank of B when they differ from A's (cross-step or
            cross-rank comparison); default: the same as A.
        tolerance: rtol/atol/cosine_min; unset fields use per-dtype defaults.
        progress: print progress on stderr (for long diffs).
        allow_missing: compare only the steps both sides hold complete and readable; the
            others go to `left_out` instead of `problems`.

    Returns:
        DiffResult with `.status`, `.exit_code`, `.first_divergence`, `.problems` and
        `.records` (a DataFrame). A step one side lacks, or that is truncated, unreadable,
        partial-only or interrupted, and a read error while comparing, are problems: the
        status is then never "same".

    Raises:
        DiffError (a TracerError) when a path is missing, a rank or an explicitly chosen step
        is absent or unreadable, no step can be compared, or the dumps share no record.
    """
    import pandas as pd

    tol = tolerance or Tolerance()
    sa, sb = open_side(a, "A"), open_side(b, "B")
    sel = plan(sa, sb, step, rank, b_step, b_rank, allow_missing)
    problems, notes = list(sel.problems), list(sel.notes)
    tables = []
    total = 0
    for pl in sel.plans:
        try:
            ta = _stats(sa, pl[0], pl[1])
            tb = _stats(sb, pl[2], pl[3])
        except _ReadError as e:
            problems.append(Problem(e.side, *_rank_step(e.side, pl), str(e.path), "unreadable",
                                    str(e)))
            continue
        pairs = align(ta, tb)
        tables.append((pl, ta, tb, pairs))
        na, nb = ta["data_nbytes"].to_numpy(), tb["data_nbytes"].to_numpy()
        total += sum(int(na[ia]) + int(nb[ib]) for ia, ib in pairs
                     if ia is not None and ib is not None)
    bar = _StderrProgress(total, sum(len(t[3]) for t in tables), progress)
    rows: list[dict] = []
    kinds: set[str] = set()
    steps: list[dict[str, Any]] = []
    try:
        for pl, ta, tb, pairs in tables:
            done = len(rows)
            try:
                _compare_step(sa, sb, pl, ta, tb, pairs, tol, bar, rows, kinds, notes)
            except _ReadError as e:
                problems.append(Problem(e.side, *_rank_step(e.side, pl), str(e.path), e.state,
                                        str(e)))
                del rows[done:]  # a step is compared whole or not at all
                continue
            steps.append(_step_summary(pl, rows[done:], problems))
    finally:
        bar.close()
    return _result(rows, kinds, notes, problems, sel.left_out, steps, pd)


def _stats(side: Side, rank: int, step: int) -> Any:
    """The statistics table of one step of one side; _ReadError naming the file when it
    does not read (damaged metadata)."""
    try:
        return side.dump.stats(rank, step)
    except _READ_ERRORS as e:
        path = side.step_file(rank, step)
        raise _ReadError(side.label, path, f"unreadable: its /records table does not read "
                         f"({e}); the file is damaged: dump that step again") from e


def _rank_step(side: str, pl: Plan) -> tuple[int, int]:
    return (pl[0], pl[1]) if side == "A" else (pl[2], pl[3])


def _compare_step(sa: Side, sb: Side, pl: Plan, ta: Any, tb: Any, pairs: list, tol: Tolerance,
                  bar: _StderrProgress, rows: list[dict], kinds: set[str],
                  notes: list[str]) -> None:
    """Compare the records of one step pair into `rows`."""
    fa = _TensorReader(sa.step_file(pl[0], pl[1]), "A")
    try:
        fb = _TensorReader(sb.step_file(pl[2], pl[3]), "B")
    except _ReadError:
        fa.close()
        raise
    try:
        la, lb = fa.attrs.get("level"), fb.attrs.get("level")
        if la != lb:
            note = f"levels differ: A is {la}, B is {lb}; only shared records are compared"
            if note not in notes:
                notes.append(note)
        ca, cb = op_capture_of(fa.attrs), op_capture_of(fb.attrs)
        note = (f"op captures differ: A used {ca}, B {cb}; the two record a few ops "
                f"differently by design (docs/tracer.md, \"Where the two differ\"), "
                f"so compare runs captured the same way")
        if ca != cb and {la, lb} & {"op", "mix"} and note not in notes:
            notes.append(note)
        recs_a, recs_b = _rows(ta), _rows(tb)
        pairs.sort(key=lambda p: (p[0] is None, p[0] if p[0] is not None else p[1]))
        matched = 0
        for ia, ib in pairs:
            ra = recs_a[ia] if ia is not None else None
            rb = recs_b[ib] if ib is not None else None
            matched += ra is not None and rb is not None
            row = _compare_pair(ra, rb, fa, fb, tol, pl, bar)
            bar.record()
            if row["compared"] in ("tensor", "statistics"):
                kinds.add(row["compared"])
            rows.append(row)
        if matched == 0 and (len(ta) or len(tb)):
            raise DiffError(f"no record of A (rank {pl[0]} step {pl[1]}, level {la}) "
                            f"matches a record of B (rank {pl[2]} step {pl[3]}, "
                            f"level {lb}): are these dumps of the same model?")
    finally:
        fa.close()
        fb.close()


def _step_summary(pl: Plan, rows: list[dict], problems: list[Problem]) -> dict[str, Any]:
    """One compared step pair: its status (interrupted on either side wins) and its counts."""
    mine = [p for p in problems if p.state == "interrupted"
            and (p.side, p.rank, p.step) in (("A", pl[0], pl[1]), ("B", pl[2], pl[3]))]
    verdicts = [r["verdict"] for r in rows]
    return {"rank": pl[0], "step": pl[1], "b_rank": pl[2], "b_step": pl[3],
            "status": "interrupted" if mine else "complete",
            "reason": "; ".join(f"{p.side} {p.reason}" for p in mine),
            **{v: verdicts.count(v) for v in ("same", "diverged", "only_a", "only_b")}}


def _result(rows: list[dict], kinds: set[str], notes: list[str], problems: list[Problem],
            left_out: list[Problem], steps: list[dict[str, Any]], pd: Any) -> DiffResult:
    rows = _ordered(rows)
    df = pd.DataFrame(rows, columns=list(COLUMNS))
    only = df["verdict"].isin(["only_a", "only_b"]).sum() if len(df) else 0
    if only:
        notes.append(f"{int(only)} records have no partner on the other side (see verdict "
                     "only_a/only_b); they do not count as divergence")
    if "statistics" in kinds:
        notes.append("statistics compared (no tensor bytes on at least one side): min, max, "
                     "mean, norm, NaN/Inf counts and checksum")
    mixed = [r for r in rows if r["dtype"] and r["b_dtype"] and r["dtype"] != r["b_dtype"]]
    if mixed:
        r = mixed[0]
        notes.append(f"{len(mixed)} matched records differ in dtype, the first at {r['name']} "
                     f"({r['dtype']} vs {r['b_dtype']}, {r['source'] or 'unknown source'}); "
                     "they are judged with the looser dtype's tolerance")
    if left_out:
        notes.append(f"--allow-missing: {len({(p.rank, p.step) for p in left_out})} step(s) "
                     f"left out of the comparison, only steps both sides hold complete were "
                     f"compared")
    first = _first_divergence(rows)
    compared = ("mixed" if len(kinds) == 2 else next(iter(kinds))) if kinds else "none"
    worst = max((EXIT_OF_STATE.get(p.state, 2) for p in problems), default=0)
    status = "incomplete" if worst == 2 else ("diverged" if first or worst == 1 else "same")
    if worst == 1 and status == "diverged":
        notes.append("the runs' step sets differ: a step one side has is missing on the other")
    return DiffResult(status=status, first_divergence=first, records=df, compared=compared,
                      notes=notes, problems=problems, left_out=left_out, steps=steps)
