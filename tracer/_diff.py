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
from tracer._compare import (TensorMetrics, Tolerance, compare_stats, itemsize, judge_tensor)
from tracer._errors import DumpFormatError, TracerError
from tracer._layout import dense_strides, stored_extent
from tracer._reader import c_order_bytes, op_capture_of, parse_shape

CHUNK_ELEMENTS = 1 << 22  # 16 MiB of float32 per side per read
_METRICS = ("cosine", "max_abs_err", "max_rel_err", "mean_abs_err", "rmse", "within",
            "nan_diff", "inf_diff", "min_rdiff", "max_rdiff", "mean_rdiff", "norm_rdiff",
            "checksum_equal")
COLUMNS = ("order", "step", "rank", "b_step", "b_rank", "seq", "b_seq", "name", "b_name",
           "module", "op", "phase", "direction", "index", "source", "dtype", "b_dtype", "shape",
           "b_shape", "compared", "verdict") + _METRICS + ("reason",)
Progress = Callable[[int, int], None]


class DiffError(TracerError):
    """The two dumps cannot be compared as asked: the message says what differs."""


@dataclass
class DiffResult:
    """What `tracer.diff` found."""

    status: Literal["same", "diverged"]
    """"same" when every matched record is within tolerance, else "diverged"."""
    first_divergence: dict[str, Any] | None
    """The first divergent record in execution order (name, module, op, phase, step, rank,
    source, kind, reason, metrics), or None."""
    records: Any
    """pandas DataFrame, one row per record pair (or unmatched record), in execution order."""
    compared: Literal["tensor", "statistics", "mixed", "none"] = "none"
    """Whether tensors, statistics only, or some of each were compared."""
    notes: list[str] = field(default_factory=list)
    """Things worth knowing that are not divergences (e.g. levels differ, records unmatched)."""

    def counts(self) -> dict[str, int]:
        """Number of records per verdict (same, diverged, only_a, only_b)."""
        v = self.records["verdict"].value_counts()
        return {k: int(v.get(k, 0)) for k in ("same", "diverged", "only_a", "only_b")}

    def to_dict(self, records: bool = True) -> dict[str, Any]:
        """A JSON-ready dict: status, first_divergence, compared, counts, notes, records."""
        out: dict[str, Any] = {"status": self.status, "first_divergence": self.first_divergence,
                               "compared": self.compared, "counts": self.counts(),
                               "notes": self.notes}
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


# -- locating the two sides ------------------------------------------------------------------------
@dataclass
class _Side:
    label: str
    dump: Any
    dump_dir: Path | None  # the folder holding rank{R}/ (None for a single step file)
    file: Path | None  # set when the side is one step file

    def step_file(self, rank: int, step: int) -> Path:
        return Path(self.dump.path(rank, step))

    def only(self) -> tuple[int, int] | None:
        ranks = list(self.dump.ranks)
        if len(ranks) == 1 and len(list(self.dump.steps(ranks[0]))) == 1:
            return ranks[0], list(self.dump.steps(ranks[0]))[0]
        return None


def _open_side(path: str | os.PathLike, label: str) -> _Side:
    from tracer._reader import open_dump

    p = Path(path)
    if not p.exists():
        raise DiffError(f"{label}: {p} does not exist; give a run directory, its dump/ folder or "
                        "a step file (RUN/dump/rank0/step0.h5)")
    try:
        dump = open_dump(p)
    except DumpFormatError as e:
        raise DiffError(f"{label}: {e}") from e
    if p.is_file():
        return _Side(label, dump, None, p)
    dump_dir = p / "dump" if (p / "dump").is_dir() else p
    return _Side(label, dump, dump_dir, None)


def _plan(sa: _Side, sb: _Side, step: int | None, rank: int | None, b_step: int | None,
          b_rank: int | None) -> list[tuple[int, int, int, int]]:
    """The (rank, step, b_rank, b_step) pairs to compare."""
    oa, ob = sa.only(), sb.only()
    if sa.file is not None and oa is not None:
        rank, step = (oa[0], oa[1])
    if sb.file is not None and ob is not None:
        b_rank, b_step = (ob[0], ob[1])
    ranks_a = list(sa.dump.ranks)
    if not ranks_a:
        raise DiffError(f"A: no complete step file in {sa.dump_dir or sa.file}")
    if rank is None or (rank not in ranks_a and len(ranks_a) == 1 and rank == 0):
        rank = ranks_a[0]
    b_rank = rank if b_rank is None else b_rank
    ranks_b = list(sb.dump.ranks)
    if not ranks_b:
        raise DiffError(f"B: no complete step file in {sb.dump_dir or sb.file}")
    if b_rank not in ranks_b and len(ranks_b) == 1 and b_rank == rank:
        b_rank = ranks_b[0]
    for lbl, r, rs in (("A", rank, ranks_a), ("B", b_rank, ranks_b)):
        if r not in rs:
            raise DiffError(f"{lbl} has no rank {r} (ranks: {', '.join(map(str, rs))}); "
                            f"pick one with --{'b-' if lbl == 'B' else ''}rank")
    steps_a, steps_b = list(sa.dump.steps(rank)), list(sb.dump.steps(b_rank))
    if step is None and b_step is not None:
        raise DiffError("--b-step needs --step (the step of A to compare it with)")
    if step is None:
        if sa.file is None and sb.file is None or len(steps_a) > 1 or len(steps_b) > 1:
            common = sorted(set(steps_a) & set(steps_b))
            if not common:
                raise DiffError(f"no step in common: A rank {rank} has steps {steps_a}, B rank "
                                f"{b_rank} has {steps_b}; pick them with --step and --b-step")
            return [(rank, s, b_rank, s) for s in common]
        step = steps_a[0]
    b_step = step if b_step is None else b_step
    if b_step not in steps_b and len(steps_b) == 1 and sb.file is not None:
        b_step = steps_b[0]
    for lbl, s, ss, r in (("A", step, steps_a, rank), ("B", b_step, steps_b, b_rank)):
        if s not in ss:
            raise DiffError(f"{lbl} rank {r} has no step {s} (steps: {ss}); pick one with "
                            f"--{'b-' if lbl == 'B' else ''}step")
    return [(rank, step, b_rank, b_step)]


# -- comparing -------------------------------------------------------------------------------------
def _rows(df: Any) -> list[dict[str, Any]]:
    """The rows of a table as dicts (DataFrame.to_dict("records") is ~10x slower)."""
    cols = list(df.columns)
    return [dict(zip(cols, vals)) for vals in zip(*(df[c].tolist() for c in cols))]


def _has_data(row: dict[str, Any]) -> bool:
    return int(row.get("data_offset", -1)) >= 0 and int(row.get("data_nbytes", 0)) > 0


class _TensorReader:
    """Reads byte ranges of one step file's packed tensor dataset, in bounded chunks.

    The writer lays `/tensors` out contiguously, so its bytes are read with `os.preadv` at the
    dataset's file offset: no h5py call per chunk, no copy, and the GIL is released while the
    kernel reads. A chunked or compressed dataset falls back to h5py slicing.
    """

    def __init__(self, path: Path) -> None:
        import h5py

        self.path = path
        self.file = h5py.File(path, "r")
        self.data = self.file["tensors"] if "tensors" in self.file else None
        self.attrs = {k: self.file.attrs[k] for k in ("level", "mode", "config")
                      if k in self.file.attrs}
        self.base: int | None = None
        self.fd: int | None = None
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
            raise DumpFormatError(f"{self.path}: records point at tensor bytes but the file has "
                                  "no /tensors dataset")
        if self.fd is None:
            return self.data[offset:offset + nbytes]
        buf = self._bufs.get(slot)
        if buf is None or buf.nbytes < nbytes:
            buf = self._bufs[slot] = np.empty(max(nbytes, 4096), np.uint8)
        view = buf[:nbytes]
        got = 0
        while got < nbytes:
            n = os.preadv(self.fd, [memoryview(view[got:])], self.base + offset + got)
            if n <= 0:
                raise DumpFormatError(f"{self.path}: file ends inside a tensor (truncated?)")
            got += n
        return view

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self.file.close()


def _compare_tensor(ra: dict, rb: dict, fa: _TensorReader, fb: _TensorReader,
                    tol: Tolerance, progress: Callable[[int], None]) -> dict[str, Any]:
    da, db = str(ra["dtype"]), str(rb["dtype"])
    rtol, atol, cos_min = tol.resolve(da, db)
    acc = TensorMetrics(rtol, atol)
    ia, ib = itemsize(da), itemsize(db)
    n = int(ra["numel"])
    oa, ob = int(ra["data_offset"]), int(rb["data_offset"])
    sa, sb = str(ra.get("strides") or ""), str(rb.get("strides") or "")
    _check_stored(ra, n, ia, sa, "A")
    _check_stored(rb, n, ib, sb, "B")
    if sa == sb and (not sa or dense_strides(parse_shape(str(ra["shape"])), parse_shape(sa))):
        # the same dense layout on both sides: element i of A's bytes is element i of B's
        read_a = lambda start, count: fa.read(oa + start * ia, count * ia)  # noqa: E731
        read_b = lambda start, count: fb.read(ob + start * ib, count * ib)  # noqa: E731
    else:  # a permutation, or a slice of another record's bytes: both in C order
        read_a = _c_order_reader(fa, oa, ia, n, str(ra["shape"]), sa)
        read_b = _c_order_reader(fb, ob, ib, n, str(rb["shape"]), sb)
    for start in range(0, n, CHUNK_ELEMENTS):
        count = min(CHUNK_ELEMENTS, n - start)
        acc.add_raw(read_a(start, count), read_b(start, count), da, db,
                    norms=n > CHUNK_ELEMENTS)
        progress(count * (ia + ib))
    m = acc.result()
    m.pop("identical")
    m.update(judge_tensor(m, cos_min, atol))
    m.pop("rms")
    return m


def _check_stored(row: dict, n: int, size: int, strides: str, side: str) -> None:
    """Raise DumpFormatError unless the record's `data_nbytes` is the range its dtype, shape
    and strides read (a damaged step file, or one not written by sleuth)."""
    want = _stored_nbytes(n, size, str(row["shape"]), strides)
    got = int(row["data_nbytes"])
    if got != want:
        raise DumpFormatError(
            f"record {row['name']} in dump {side}: data_nbytes is {got}, but dtype "
            f"{row['dtype']}, shape [{row['shape']}] and strides [{strides}] read {want} bytes; "
            f"the step file is damaged or was not written by sleuth: dump that step again")


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


def _row_base(ra: dict | None, rb: dict | None, plan: tuple[int, int, int, int]) -> dict:
    ref = ra if ra is not None else rb
    assert ref is not None
    row = {k: math.nan for k in COLUMNS}
    row.update(step=plan[1], rank=plan[0], b_step=plan[3], b_rank=plan[2],
               seq=int(ra["seq"]) if ra else -1, b_seq=int(rb["seq"]) if rb else -1,
               name=ra["name"] if ra else "", b_name=rb["name"] if rb else "",
               module=ref["module"], op=ref["op"], phase=ref["phase"],
               direction=ref["direction"], index=int(ref["index"]), source=ref["source"],
               dtype=ra["dtype"] if ra else "", b_dtype=rb["dtype"] if rb else "",
               shape=ra["shape"] if ra else "", b_shape=rb["shape"] if rb else "",
               compared="", reason="", checksum_equal=None)
    return row


def _compare_pair(ra: dict | None, rb: dict | None, fa: _TensorReader | None,
                  fb: _TensorReader | None, tol: Tolerance, plan: tuple[int, int, int, int],
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
         tolerance: Tolerance | None = None, progress: bool = False) -> DiffResult:
    """Compare dump A with dump B record by record and name the first divergent record.

    Args:
        a, b: run directories, dump directories (holding rank{R}/) or step files.
        step, rank: the step and rank of A; step None compares every step both hold.
        b_step, b_rank: the step and rank of B when they differ from A's (cross-step or
            cross-rank comparison); default: the same as A.
        tolerance: rtol/atol/cosine_min; unset fields use per-dtype defaults.
        progress: print progress on stderr (for long diffs).

    Returns:
        DiffResult with `.status`, `.first_divergence` and `.records` (a DataFrame).

    Raises:
        DiffError (a TracerError) when a path is missing, a rank or step is absent, or the dumps
        share no record.
    """
    import pandas as pd

    tol = tolerance or Tolerance()
    sa, sb = _open_side(a, "A"), _open_side(b, "B")
    plans = _plan(sa, sb, step, rank, b_step, b_rank)
    notes: list[str] = []
    tables = []
    total = 0
    for plan in plans:
        ta = sa.dump.stats(plan[0], plan[1])
        tb = sb.dump.stats(plan[2], plan[3])
        pairs = align(ta, tb)
        tables.append((plan, ta, tb, pairs))
        na, nb = ta["data_nbytes"].to_numpy(), tb["data_nbytes"].to_numpy()
        total += sum(int(na[ia]) + int(nb[ib]) for ia, ib in pairs
                     if ia is not None and ib is not None)
    bar = _StderrProgress(total, sum(len(t[3]) for t in tables), progress)
    rows: list[dict] = []
    kinds: set[str] = set()
    try:
        for plan, ta, tb, pairs in tables:
            fa = _TensorReader(sa.step_file(plan[0], plan[1]))
            fb = _TensorReader(sb.step_file(plan[2], plan[3]))
            try:
                la, lb = fa.attrs.get("level"), fb.attrs.get("level")
                if la != lb:
                    notes.append(f"levels differ: A is {la}, B is {lb}; only shared records "
                                 "are compared")
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
                    row = _compare_pair(ra, rb, fa, fb, tol, plan, bar)
                    bar.record()
                    if row["compared"] in ("tensor", "statistics"):
                        kinds.add(row["compared"])
                    rows.append(row)
                if matched == 0 and (len(ta) or len(tb)):
                    raise DiffError(f"no record of A (rank {plan[0]} step {plan[1]}, level {la}) "
                                    f"matches a record of B (rank {plan[2]} step {plan[3]}, "
                                    f"level {lb}): are these dumps of the same model?")
            finally:
                fa.close()
                fb.close()
    finally:
        bar.close()
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
    first = _first_divergence(rows)
    compared = ("mixed" if len(kinds) == 2 else next(iter(kinds))) if kinds else "none"
    return DiffResult(status="diverged" if first else "same", first_divergence=first,
                      records=df, compared=compared, notes=notes)
