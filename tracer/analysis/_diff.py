"""`tracer.diff`: match the records of two dumps, compare each pair and name the first one that
diverges, in execution order.

The diff streams: statistics tables are read whole (no tensor bytes), tensors are read in
bounded chunks straight from the packed `/tensors` dataset, so a dump larger than RAM costs one
chunk of memory per side. Only numpy, h5py and pandas are used here, never torch. Which steps
are compared, and what could not be, is decided in tracer.analysis._diff_plan; one record pair
is compared in tracer.analysis._diff_record (its tensor bytes read and checked in
tracer.analysis._diff_bytes); the rows become a `DiffResult` in tracer.analysis._diff_result.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable

from tracer.analysis._align import align
from tracer.analysis._changed import mark_fed
from tracer.analysis._compare import Tolerance
from tracer.analysis._diff_plan import DiffError, Plan, Problem, Side, open_side, plan
from tracer.analysis._diff_record import _compare_pair
from tracer.analysis._diff_result import DiffResult, _Summary, _ordered, _result, _step_summary
from tracer.analysis._fused import combine
from tracer.analysis._map_file import (UNVOUCHED_NOTE, ModuleMap, same_op_modules,
                                       set_aside, unmatched_pair, vouched)
from tracer.analysis._origin import param_name, sig
from tracer.analysis._setup import compare_setups, first_setup, step_inputs
from tracer.analysis._written import mark_written
from tracer.storage import READ_ERRORS, ReadError, TensorReader, op_capture_of

Progress = Callable[[int, int], None]


def _rows(df: Any) -> list[dict[str, Any]]:
    """The rows of a table as dicts (DataFrame.to_dict("records") is ~10x slower)."""
    cols = list(df.columns)
    return [dict(zip(cols, vals)) for vals in zip(*(df[c].tolist() for c in cols))]


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
    setups: list[dict[str, Any]] = []
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
                              layouts, setups)
            except ReadError as e:
                problems.append(Problem(e.side, *_rank_step(e.side, pl), str(e.path), e.state,
                                        str(e)))
                del rows[done:]  # a step is compared whole or not at all
                continue
            steps.append(_step_summary(pl, rows[done:], problems))
    finally:
        bar.close()
    return _result(rows, kinds, notes, problems, sel.left_out, steps, pd,
                   _Summary(keep_worst), keep_records=True, setup=first_setup(setups, notes),
                   inputs=step_inputs(setups), mapped=module_map is not None)


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
    setups: list[dict[str, Any]] = []
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
                              tol, bar, rows, kinds, notes, layouts, setups)
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
    return _result([], kinds, notes, problems, sel.left_out, steps, pd, summary,
                   setup=first_setup(setups, notes),
                   inputs=step_inputs(setups), mapped=module_map is not None)


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
                  notes: list[str], layouts: frozenset[str] | None = None,
                  setups: list[dict[str, Any]] | None = None) -> None:
    """Compare the records of one step pair into `rows` (`layouts`: two codebases, see
    `_compare_pair`), and the setups the two steps were taken with into `setups`."""
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
        if setups is not None:
            setups.append(compare_setups(
                fa.attrs.get("setup"), fb.attrs.get("setup"), pl, named=layouts is None,
                interrupted=(fa.attrs.get("status") == "interrupted",
                             fb.attrs.get("status") == "interrupted")))
        recs_a, recs_b = _rows(ta), _rows(tb)
        moved = frozenset((str(r["dtype"]), int(r["numel"]), int(r["checksum"])) for r in recs_a
                          if r["phase"] == "optimizer" and r["direction"] == "param"
                          and param_name(r) in layouts) if layouts else frozenset()
        pairs.sort(key=lambda p: (p[0] is None, p[0] if p[0] is not None else p[1]))
        # two codebases: the modules both runs have, B's read as A's through the map
        paired = set(ta["module"]) & set(tb["module"]) if layouts is not None else set()
        same_ops = same_op_modules(ta, tb) if layouts is not None else frozenset()
        matched = 0
        values: tuple[set, set] | None = None
        for ia, ib in pairs:
            ra = recs_a[ia] if ia is not None else None
            rb = recs_b[ib] if ib is not None else None
            matched += ra is not None and rb is not None
            row = _compare_pair(ra, rb, fa, fb, tol, pl, bar,
                                (_file_row(ra, ia), _file_row(rb, ib)), layouts, moved)
            if layouts is None and (ra is None) != (rb is None):
                # a record one run alone makes is a divergence where its value is one the
                # other run never holds (a gradient only it computes), and no evidence where
                # the other run holds it too (an added `x + 0.0`)
                if values is None:
                    values = {sig(r) for r in recs_a}, {sig(r) for r in recs_b}
                row["novel"] = sig(ra if ra is not None else rb) not in values[ra is not None]
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
        mark_fed(rows[len(rows) - len(pairs):], recs_a, recs_b)
        mark_written(rows[len(rows) - len(pairs):], recs_a, recs_b)
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
