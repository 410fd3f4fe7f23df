"""`tracer.diff`: match the records of two dumps, compare each pair and name the first one that
diverges, in execution order.

The diff streams: statistics tables are read whole (no tensor bytes), tensors are read in
bounded chunks straight from the packed `/tensors` dataset, so a dump larger than RAM costs one
chunk of memory per side. Only numpy, h5py and pandas are used here, never torch. Which steps
are compared, and what could not be, is decided in tracer.analysis._diff_plan; tensor bytes are read
and checked in tracer.analysis._diff_bytes.
"""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import numpy as np

from tracer.analysis._align import align
from tracer.analysis._changed import changes, kind, mark_fed
from tracer.analysis._compare import Tolerance, compare_sketch, compare_stats, nonfinite_differ
from tracer.analysis._diff_plan import (EXIT_OF_STATE, DiffError, Plan, Problem, Side, open_side,
                                        plan)
from tracer.analysis._diff_bytes import compare_tensor
from tracer.analysis._fused import combine, compare_fused, is_combined
from tracer.analysis._map_file import (UNVOUCHED_NOTE, ModuleMap, same_op_modules,
                                       set_aside, unmatched_pair, vouched)
from tracer.analysis._origin import param_name
from tracer.storage import READ_ERRORS, ReadError, TensorReader, op_capture_of

CHUNK_ELEMENTS = 1 << 22  # 16 MiB of float32 per side per read
_METRICS = ("error", "cosine", "max_abs_err", "max_rel_err", "mean_abs_err", "rmse", "within",
            "nan_diff", "inf_diff", "min_rdiff", "max_rdiff", "mean_rdiff", "norm_rdiff",
            "checksum_equal")
_COUNTS = ("nan", "posinf", "neginf")  # per side, from the statistics rows
COLUMNS = ("order", "step", "rank", "b_step", "b_rank", "seq", "b_seq", "name", "b_name",
           "module", "op", "phase", "direction", "index", "source", "caller", "dtype", "b_dtype",
           "shape", "b_shape") + _COUNTS + tuple(f"b_{c}" for c in _COUNTS) + (
           "compared", "verdict") + _METRICS + ("reason",)
Progress = Callable[[int, int], None]


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
    source, caller, kind, reason, metrics, and `unpaired_before`: the records without a partner
    right before it, each {side, name, op, source}), or None."""
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
    record_counts: dict[str, int] | None = None
    """Records per verdict, kept when `records` is not (`diff(keep_records=False)`)."""
    shown: Any = None
    """pandas DataFrame of the rows a report lists, in both modes: the first divergent record,
    the `keep_worst` worst other divergent records (`severity`), then the first `keep_worst`
    records without a partner."""
    changes: list[dict[str, Any]] = field(default_factory=list)
    """What changed between the runs, where the diff can tell, for a report's first lines:
    {"kind": "dtype", "a", "b" (the dtypes most matched records changed between), "records"
    (how many did), "paired" (matched records in all), "others" ({"a->b": count} of the other
    changes), "name", "source", "step" (the first such record)} when matched records differ in
    dtype; {"kind": "data" or "parameter", "name", "dtype", "shape", "source", "step"} when
    the first divergence is the model's input (or an integer input no recorded op made: token
    ids, labels) or a weight before the step."""

    @property
    def exit_code(self) -> int:
        """0 same; 1 diverged or the step sets differ; 2 something could not be read."""
        code = max((EXIT_OF_STATE.get(p.state, 2) for p in self.problems), default=0)
        return max(code, 1 if self.first_divergence or self.status == "diverged" else 0)

    def problem_counts(self) -> dict[str, int]:
        """Number of problems per state (missing, truncated, ...)."""
        out: dict[str, int] = {}
        for p in self.problems:
            out[p.state] = out.get(p.state, 0) + 1
        return out

    def counts(self) -> dict[str, int]:
        """Number of records per verdict (same, diverged, only_a, only_b)."""
        if self.record_counts is not None:
            return dict(self.record_counts)
        v = self.records["verdict"].value_counts()
        return {k: int(v.get(k, 0)) for k in ("same", "diverged", "only_a", "only_b")}

    def to_dict(self, records: bool = True) -> dict[str, Any]:
        """A JSON-ready dict: status, exit_code, changes, first_divergence, compared, counts,
        problems, problem_counts, left_out, steps, notes, records."""
        out: dict[str, Any] = {"status": self.status, "exit_code": self.exit_code,
                               "changes": self.changes,
                               "first_divergence": self.first_divergence,
                               "compared": self.compared, "counts": self.counts(),
                               "problems": [p.to_dict() for p in self.problems],
                               "problem_counts": self.problem_counts(),
                               "left_out": [p.to_dict() for p in self.left_out],
                               "steps": self.steps, "notes": self.notes}
        if records:
            out["records"] = [_jsonable(r) for r in self.records.to_dict("records")]
        return out

    @staticmethod
    def frame(rows: list[dict]) -> Any:
        """Rows `on_rows` received as a DataFrame with the columns of `records`."""
        import pandas as pd

        return pd.DataFrame(rows, columns=list(COLUMNS))

    @staticmethod
    def json_rows(rows: list[dict]) -> list[dict[str, Any]]:
        """Rows `on_rows` received as JSON-ready dicts, as `to_dict` writes `records`."""
        return [_jsonable(r) for r in DiffResult.frame(rows).to_dict("records")]


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
               caller=ref.get("caller") or "",
               dtype=ra["dtype"] if ra else "", b_dtype=rb["dtype"] if rb else "",
               shape=ra["shape"] if ra else "", b_shape=rb["shape"] if rb else "",
               compared="", reason="", checksum_equal=None)
    return row


def _compare_pair(ra: dict | None, rb: dict | None, fa: TensorReader | None,
                  fb: TensorReader | None, tol: Tolerance, plan: Plan,
                  progress: Callable[[int], None], rows: tuple[int, int] = (-1, -1),
                  layouts: frozenset[str] | None = None,
                  moved: frozenset[tuple] = frozenset()) -> dict:
    """Compare one record pair (`rows`: their rows in the two /records tables).

    `layouts` (a diff through a module map, two codebases; None otherwise): A's parameters
    that B stores in another layout. Their records, any record holding exactly such a
    parameter's values (`moved`: (dtype, numel, checksum); the weight an op reads, square so
    its shape does not show the transpose), and any record whose dims come in another order,
    are compared by statistics, which do not depend on the order of the elements; shapes that
    differ only by dims of 1 compare as equal (the same elements in the same order)."""
    row = _row_base(ra, rb, plan)
    if ra is None or rb is None:
        row["verdict"] = "only_b" if ra is None else "only_a"
        row["reason"] = f"no matching record in {'A' if ra is None else 'B'}"
        return row
    if is_combined(ra) or is_combined(rb):  # a fused module against its parts combined
        row.update(compare_fused(ra, rb, tol))
        return row
    permuted = layouts is not None and (
        (ra["phase"] == "optimizer" and param_name(ra) in layouts)
        or (str(ra["dtype"]), int(ra["numel"]), int(ra["checksum"])) in moved)
    if ra["shape"] != rb["shape"] or permuted:
        layout = "permuted" if permuted else (
            _layout(str(ra["shape"]), str(rb["shape"])) if layouts is not None else None)
        if layout is None:
            row.update(verdict="diverged", compared="shape",
                       reason=f"shape [{ra['shape']}] vs [{rb['shape']}]")
            return row
        if layout == "permuted":
            row["compared"] = "statistics"
            row.update(compare_stats(ra, rb, tol))
            if row["verdict"] == "diverged":
                row["reason"] = (f"{row['reason']} (shape [{ra['shape']}] vs [{rb['shape']}], "
                                 f"compared by statistics)")
            return row
    if _has_data(ra) and _has_data(rb) and fa is not None and fb is not None:
        row["compared"] = "tensor"
        row.update(compare_tensor(ra, rb, fa, fb, tol, progress, CHUNK_ELEMENTS))
        if row["nan_diff"] or row["inf_diff"]:  # the NaN/Inf counts come first
            where = f"at {int(row['nan_diff']) + int(row['inf_diff'])} positions"
            rest = row["reason"].split("; ", 1)[1:]
            row["reason"] = "; ".join([f"{nonfinite_differ(ra, rb)} ({where})", *rest])
    else:
        row["compared"] = "statistics"
        row.update(compare_stats(ra, rb, tol))
        if fa is not None and fb is not None:
            _compare_sketches(row, ra, rb, fa.sketch(rows[0]), fb.sketch(rows[1]), tol)
    return row


def _layout(shape_a: str, shape_b: str) -> str | None:
    """How two shapes of two codebases' records relate: "squeezed" (equal but for dims of 1),
    "permuted" (the same dims in another order, a transpose), or None (different)."""
    da = [int(d) for d in shape_a.split(",")] if shape_a else []
    db = [int(d) for d in shape_b.split(",")] if shape_b else []
    if [d for d in da if d != 1] == [d for d in db if d != 1]:
        return "squeezed"
    if sorted(da) == sorted(db):
        return "permuted"
    return None


def _compare_sketches(row: dict, ra: dict, rb: dict, sketch_a: tuple, sketch_b: tuple,
                      tol: Tolerance) -> None:
    """Add what the two records' sketches say to a statistics comparison: the sampled
    elements' error metrics, and a divergence the statistics cannot see (elements that moved:
    the same values in another order keep every statistic)."""
    (sa, scheme_a), (sb, scheme_b) = sketch_a, sketch_b
    if sa is None or sb is None or scheme_a != scheme_b:
        return
    m = compare_sketch(sa, sb, int(ra["numel"]), str(ra["dtype"]), str(rb["dtype"]), tol)
    row["compared"] = "sketch"
    for key in ("cosine", "max_abs_err", "max_rel_err", "mean_abs_err", "rmse", "within"):
        row[key] = m[key]
    if not math.isinf(row["error"]):  # else NaN/Inf counts differ: no estimate says more
        row["error"] = m["error"]
    if m["verdict"] != "diverged":
        return
    if row["verdict"] == "diverged":
        row["reason"] = f"{row['reason']}; {m['reason']}"
        return
    row["verdict"] = "diverged"
    row["reason"] = (f"statistics agree, but {m['reason']}: elements moved or changed in a way "
                     f"the statistics do not show (a permutation, a transpose, swapped heads)")


def severity(row: dict) -> tuple:
    """Sort key of divergent records, worst first: by `error` (NaN/Inf patterns that differ
    are infinite, and the more positions the worse), then records without a measured error
    (shapes that differ through a module map)."""
    e = row.get("error")
    measured = e is not None and not (isinstance(e, float) and math.isnan(e))
    n, i = row.get("nan_diff"), row.get("inf_diff")
    nonfinite = 0 if n is None or (isinstance(n, float) and math.isnan(n)) else int(n) + int(i)
    return (not measured, -(float(e) if measured else 0.0), -nonfinite)


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
    for i, r in enumerate(rows):
        if r["verdict"] == "diverged":
            keys = ("name", "module", "op", "phase", "step", "rank", "source", "caller",
                    "b_name", "b_step", "b_rank", "seq", "direction", "index", "dtype", "b_dtype",
                    "shape", "b_shape", "compared", "reason") + _METRICS
            fd = _jsonable({k: r[k] for k in keys})
            fd["kind"] = kind(r)
            fd["unpaired_before"] = _unpaired_before(rows, i)
            return fd
    return None


def _unpaired_before(rows: list[dict], i: int) -> list[dict[str, str]]:
    """The records without a partner right before row `i` in execution order (same step):
    where the two runs computed something differently, which is where a divergence that
    shows first in the next paired record was made (a reshape done with other ops, say).
    Each as {side, name, op, source}, in order."""
    out = []
    j = i - 1
    while j >= 0 and rows[j]["verdict"] in ("only_a", "only_b") \
            and rows[j]["step"] == rows[i]["step"]:
        r = rows[j]
        side = "A" if r["verdict"] == "only_a" else "B"
        out.append({"side": side, "name": str(r["name"] if side == "A" else r["b_name"]),
                    "op": str(r["op"]), "source": str(r["source"])})
        j -= 1
    return out[::-1]


class _StderrProgress:
    """Progress on stderr: by bytes compared when there are tensors, else by records."""

    def __init__(self, total_bytes: int, total_records: int, enabled: bool,
                 steps: int = 0) -> None:
        self.total_bytes, self.total_records = total_bytes, max(total_records, 1)
        self.steps, self.step = steps, 0
        """With `steps` (a streamed diff, whose sizes are not known ahead): step k of n."""
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
        if self.steps:
            done = (f"step {min(self.step + 1, self.steps)}/{self.steps}, {self.records} "
                    f"records, {self.bytes / 2**20:.0f} MiB compared")
        elif self.total_bytes:
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
         allow_missing: bool = False, keep_records: bool = True,
         module_map: ModuleMap | dict[str, str] | None = None, keep_worst: int = 10,
         on_rows: Callable[[list[dict]], None] | None = None) -> DiffResult:
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
        keep_records: False reads, compares and forgets one step at a time, so memory holds
            one step's tables whatever the number of steps; `records` is then empty and
            `record_counts`, `first_divergence`, `steps` and the notes carry the answer.
        module_map: which module of B is which of A, for dumps of two codebases: a
            `ModuleMap` (`map_modules`, or a file `read_module_map` reads), or a dict of B
            module name -> A module name. B's records are aligned as records of those A
            modules (`b_name` keeps B's own name); the map's `permuted` parameters are
            compared by statistics, and shapes that differ by dims of 1 or by the order of
            their dims are not a divergence by themselves.
        keep_worst: how many of the worst divergent records, and of the records without a
            partner, `shown` keeps.
        on_rows: with keep_records False, called with each step's rows (dicts of COLUMNS, in
            execution order) before they are dropped: a CSV or JSON writer that streams.

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
    layouts = None
    fused: tuple[dict, dict] | None = None
    if isinstance(module_map, ModuleMap):
        layouts = frozenset(module_map.permuted)
        if module_map.fused:
            fused = (module_map.fused_parts("a"), module_map.fused_parts("b"))
        module_map = module_map.b_to_a()
    elif module_map is not None:
        layouts = frozenset()
    if module_map is not None:
        notes.append(f"B's modules read as A's through a module map ({len(module_map)} pairs)")
    if fused:
        notes.append(f"{len(fused[0]) + len(fused[1])} fused module(s) compared with their "
                     "parts combined (a concatenation's statistics follow from its parts'); "
                     "those statistics do not see the order of the parts, so parts swapped (a "
                     "port loading them from the wrong slices) read the same there and show "
                     "first at the records after the fused module")
    if not keep_records:
        return _streamed(sa, sb, sel, tol, problems, notes, pd, module_map, layouts, progress,
                         on_rows, keep_worst, fused)
    tables = []
    total = 0
    for pl in sel.plans:
        read = _step_tables(sa, sb, pl, problems, module_map, fused)
        if read is None:
            continue
        ta, tb = read
        pairs = align(ta, tb, layouts=layouts is not None)
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
                _compare_step(sa, sb, pl, ta, tb, pairs, tol, bar, rows, kinds, notes,
                              layouts)
            except ReadError as e:
                problems.append(Problem(e.side, *_rank_step(e.side, pl), str(e.path), e.state,
                                        str(e)))
                del rows[done:]  # a step is compared whole or not at all
                continue
            steps.append(_step_summary(pl, rows[done:], problems))
    finally:
        bar.close()
    return _result(rows, kinds, notes, problems, sel.left_out, steps, pd,
                   _Summary(keep_worst), keep_records=True)


def _step_tables(sa: Side, sb: Side, pl: Plan, problems: list[Problem],
                 module_map: dict[str, str] | None = None,
                 fused: tuple[dict, dict] | None = None) -> tuple | None:
    """The statistics tables of a step pair (the parts of fused modules combined, B's modules
    renamed by `module_map`), or None with the side that does not read added to `problems`."""
    try:
        ta, tb = _stats(sa, pl[0], pl[1]), _stats(sb, pl[2], pl[3])
        if fused:
            ta, tb = combine(ta, fused[0]), combine(tb, fused[1])
        if module_map:
            tb = tb.assign(module=[module_map.get(m, m) for m in tb["module"]])
        return ta, tb
    except ReadError as e:
        problems.append(Problem(e.side, *_rank_step(e.side, pl), str(e.path), "unreadable",
                                str(e)))
        return None


def _streamed(sa: Side, sb: Side, sel: Any, tol: Tolerance, problems: list[Problem],
              notes: list[str], pd: Any, module_map: dict[str, str] | None = None,
              layouts: frozenset[str] | None = None, progress: bool = False,
              on_rows: Callable[[list[dict]], None] | None = None,
              keep_worst: int = 10, fused: tuple[dict, dict] | None = None) -> DiffResult:
    """`diff` one step pair at a time: each step's tables are read, compared, summarised
    (verdict counts, its first divergence, dtype mismatches, the rows a report shows), handed
    to `on_rows`, and dropped."""
    summary = _Summary(keep_worst)
    steps: list[dict[str, Any]] = []
    kinds: set[str] = set()
    bar = _StderrProgress(0, 1, progress, steps=len(sel.plans))
    order = 0
    try:
        for pl in sel.plans:
            read = _step_tables(sa, sb, pl, problems, module_map, fused)
            bar.step += 1
            if read is None:
                continue
            ta, tb = read
            rows: list[dict] = []
            try:
                _compare_step(sa, sb, pl, ta, tb, align(ta, tb, layouts=layouts is not None),
                              tol, bar, rows, kinds, notes, layouts)
            except ReadError as e:
                problems.append(Problem(e.side, *_rank_step(e.side, pl), str(e.path), e.state,
                                        str(e)))
                continue
            del ta, tb
            steps.append(_step_summary(pl, rows, problems))
            rows = _ordered(rows)
            for r in rows:  # execution order across steps, as the whole diff numbers it
                r["order"] += order
            order += len(rows)
            summary.add(rows)
            if on_rows is not None:
                on_rows(rows)
    finally:
        bar.close()
    return _result([], kinds, notes, problems, sel.left_out, steps, pd, summary)


class _Summary:
    """What `_result` needs of the rows, gathered one step at a time, and the rows a report
    shows (`DiffResult.shown`): the first divergent, the `keep` worst others, the first `keep`
    without a partner."""

    def __init__(self, keep: int = 10) -> None:
        self.counts = {k: 0 for k in ("same", "diverged", "only_a", "only_b")}
        self.first: dict[str, Any] | None = None
        self.mixed = 0
        self.first_mixed: dict[str, Any] | None = None
        self.dtype_pairs: dict[tuple[str, str], int] = {}
        self.keep = keep
        self.first_row: dict | None = None
        self.worst: list[dict] = []
        self.unpaired: list[dict] = []

    def shown(self) -> list[dict]:
        return ([self.first_row] if self.first_row else []) + self.worst + self.unpaired

    def add(self, rows: list[dict]) -> None:
        divergent = []
        for r in rows:
            if r["verdict"] in self.counts:
                self.counts[r["verdict"]] += 1
            if r["verdict"] == "diverged":
                divergent.append(r)
            elif r["verdict"] in ("only_a", "only_b") and len(self.unpaired) < self.keep:
                self.unpaired.append(r)
        if divergent and self.first_row is None:
            self.first_row, divergent = divergent[0], divergent[1:]
        if divergent:
            self.worst = sorted(self.worst + divergent, key=severity)[:self.keep]
        fd = _first_divergence(rows)
        if fd is not None and (self.first is None or fd["step"] < self.first["step"]):
            self.first = fd
        mixed = [r for r in rows if r["dtype"] and r["b_dtype"] and r["dtype"] != r["b_dtype"]]
        self.mixed += len(mixed)
        for r in mixed:
            pair = (str(r["dtype"]), str(r["b_dtype"]))
            self.dtype_pairs[pair] = self.dtype_pairs.get(pair, 0) + 1
        if mixed and (self.first_mixed is None or mixed[0]["step"] < self.first_mixed["step"]):
            self.first_mixed = {k: mixed[0][k] for k in ("name", "dtype", "b_dtype", "source",
                                                         "step")}


def _stats(side: Side, rank: int, step: int) -> Any:
    """The statistics table of one step of one side; ReadError naming the file when it
    does not read (damaged metadata)."""
    try:
        return side.dump.stats(rank, step)
    except READ_ERRORS as e:
        path = side.step_file(rank, step)
        raise ReadError(side.label, path, f"unreadable: its /records table does not read "
                         f"({e}); the file is damaged: dump that step again") from e


def _rank_step(side: str, pl: Plan) -> tuple[int, int]:
    return (pl[0], pl[1]) if side == "A" else (pl[2], pl[3])


def _compare_step(sa: Side, sb: Side, pl: Plan, ta: Any, tb: Any, pairs: list, tol: Tolerance,
                  bar: _StderrProgress, rows: list[dict], kinds: set[str],
                  notes: list[str], layouts: frozenset[str] | None = None) -> None:
    """Compare the records of one step pair into `rows` (`layouts`: two codebases, see
    `_compare_pair`)."""
    fa = TensorReader(sa.step_file(pl[0], pl[1]), "A")
    try:
        fb = TensorReader(sb.step_file(pl[2], pl[3]), "B")
    except ReadError:
        fa.close()
        raise
    try:
        la, lb = fa.attrs.get("level"), fb.attrs.get("level")
        if la != lb:
            note = f"levels differ: A is {la}, B is {lb}; only shared records are compared"
            if note not in notes:
                notes.append(note)
        ca, cb = op_capture_of(fa.attrs, str(fa.path)), op_capture_of(fb.attrs, str(fb.path))
        note = (f"op captures differ: A used {ca}, B {cb}; the two record a few ops "
                f"differently by design (docs/tracer.md, \"Dumps made with the op observer\"), "
                f"so compare runs captured the same way")
        if ca != cb and {la, lb} & {"op", "mix"} and note not in notes:
            notes.append(note)
        recs_a, recs_b = _rows(ta), _rows(tb)
        moved = frozenset((str(r["dtype"]), int(r["numel"]), int(r["checksum"])) for r in recs_a
                          if r["phase"] == "optimizer" and r["direction"] == "param"
                          and param_name(r) in layouts) if layouts else frozenset()
        pairs.sort(key=lambda p: (p[0] is None, p[0] if p[0] is not None else p[1]))
        # two codebases: the modules both runs have, B's read as A's through the map
        paired = set(ta["module"]) & set(tb["module"]) if layouts is not None else set()
        same_ops = same_op_modules(ta, tb) if layouts is not None else frozenset()
        matched = 0
        for ia, ib in pairs:
            ra = recs_a[ia] if ia is not None else None
            rb = recs_b[ib] if ib is not None else None
            matched += ra is not None and rb is not None
            row = _compare_pair(ra, rb, fa, fb, tol, pl, bar,
                                (_file_row(ra, ia), _file_row(rb, ib)), layouts, moved)
            if layouts is not None and row["verdict"] == "diverged" \
                    and not vouched(ra, same_ops):
                set_aside(row)
                if UNVOUCHED_NOTE not in notes:
                    notes.append(UNVOUCHED_NOTE)
            elif layouts is not None and (ra is None) != (rb is None):
                unmatched_pair(row, ra if ra is not None else rb, paired)
            bar.record()
            if row["compared"] in ("tensor", "statistics", "sketch"):
                kinds.add(row["compared"])
            rows.append(row)
        mark_fed(rows[len(rows) - len(pairs):], recs_a)
        if matched == 0 and (len(ta) or len(tb)):
            raise DiffError(f"no record of A (rank {pl[0]} step {pl[1]}, level {la}) "
                            f"matches a record of B (rank {pl[2]} step {pl[3]}, "
                            f"level {lb}): are these dumps of the same model?")
    finally:
        fa.close()
        fb.close()


def _file_row(rec: dict | None, i: int | None) -> int:
    """A record's row in its step file's /records table (where its sketch is): its position
    in the table compared, unless combining fused parts rebuilt that table."""
    if rec is None or i is None:
        return -1
    return int(rec.get("_file_row", i))


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
            left_out: list[Problem], steps: list[dict[str, Any]], pd: Any,
            summary: _Summary, keep_records: bool = False) -> DiffResult:
    """The result from every row (`keep_records`) or from a summary gathered step by step."""
    rows = _ordered(rows)
    df = pd.DataFrame(rows, columns=list(COLUMNS))
    if keep_records:
        summary.add(rows)
        counts = None
    else:
        counts = summary.counts
    only = summary.counts["only_a"] + summary.counts["only_b"]
    if only:
        notes.append(f"{int(only)} records have no partner on the other side (see verdict "
                     "only_a/only_b); they do not count as divergence")
    if "sketch" in kinds:
        notes.append("sketches compared beside the statistics: up to 128 elements a record, at "
                     "positions both runs sample alike (compared 'sketch'; its cosine and errors "
                     "are those of the sampled elements)")
    kinds = {"statistics" if k == "sketch" else k for k in kinds}
    if "statistics" in kinds:
        notes.append("statistics compared (no tensor bytes on at least one side): min, max, "
                     "mean, norm, NaN/Inf counts and checksum")
    if summary.first_mixed is not None:
        r = summary.first_mixed
        notes.append(f"{summary.mixed} matched records differ in dtype, the first at {r['name']} "
                     f"({r['dtype']} vs {r['b_dtype']}, {r['source'] or 'unknown source'}); "
                     "they are judged with the looser dtype's tolerance")
    if left_out:
        notes.append(f"--allow-missing: {len({(p.rank, p.step) for p in left_out})} step(s) "
                     f"left out of the comparison, only steps both sides hold complete were "
                     f"compared")
    first = summary.first
    compared = ("mixed" if len(kinds) == 2 else next(iter(kinds))) if kinds else "none"
    worst = max((EXIT_OF_STATE.get(p.state, 2) for p in problems), default=0)
    status = "incomplete" if worst == 2 else ("diverged" if first or worst == 1 else "same")
    if worst == 1 and status == "diverged":
        notes.append("the runs' step sets differ: a step one side has is missing on the other")
    paired = summary.counts["same"] + summary.counts["diverged"]
    if paired < min(summary.counts["only_a"], summary.counts["only_b"]):
        # most of each side's records found no partner: the runs recorded different modules,
        # and a "same" over the few that paired would speak for what was never compared
        if status == "same":
            status = "diverged"
        notes.insert(0, f"most records of each side have no partner ({paired} paired, "
                        f"{summary.counts['only_a']} only in A, {summary.counts['only_b']} only "
                        f"in B): the two dumps record different modules. Two codebases? "
                        f"`sleuth map A B > map.yaml` pairs their modules for `--map map.yaml`; "
                        f"else compare dumps of the same level and module filter")
    return DiffResult(status=status, first_divergence=first, records=df, compared=compared,
                      notes=notes, problems=problems, left_out=left_out, steps=steps,
                      record_counts=counts,
                      shown=pd.DataFrame(summary.shown(), columns=list(COLUMNS)),
                      changes=changes(summary.dtype_pairs, summary.first_mixed, first, paired))

