"""One record pair of a diff compared into one row of its records table: by shape first, then
by tensor bytes where both sides stored them (tracer.analysis._diff_bytes), else by statistics
and sketches (tracer.analysis._compare); a fused module against its parts combined
(tracer.analysis._fused); the layouts two codebases may store the same values in.
"""
from __future__ import annotations

import math
from typing import Any, Callable

from tracer.analysis._compare import Tolerance, compare_sketch, compare_stats, nonfinite_differ
from tracer.analysis._diff_bytes import compare_tensor
from tracer.analysis._diff_plan import Plan
from tracer.analysis._diff_result import COLUMNS, _COUNTS
from tracer.analysis._fused import compare_fused, is_combined
from tracer.analysis._origin import param_name
from tracer.storage import TensorReader

CHUNK_ELEMENTS = 1 << 22  # 16 MiB of float32 per side per read


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
        # a tensor of no elements has no bytes in any mode: it says nothing of the dump's mode
        empty = int(ra["numel"]) == 0 and int(rb["numel"]) == 0
        row["compared"] = "empty" if empty else "statistics"
        row.update(compare_stats(ra, rb, tol))
        if fa is not None and fb is not None and not empty:
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
        # statistics beyond tolerance keep their error: sampled elements that agree never
        # make a record's statistics agree (docs/diff.md, "Sketches")
        row["error"] = (max(row["error"], m["error"]) if row["verdict"] == "diverged"
                        else m["error"])
    if m["verdict"] != "diverged":
        return
    if row["verdict"] == "diverged":
        row["reason"] = f"{row['reason']}; {m['reason']}"
        return
    row["verdict"] = "diverged"
    row["reason"] = (f"statistics agree, but {m['reason']}: elements moved or changed in a way "
                     f"the statistics do not show (a permutation, a transpose, swapped heads)")
