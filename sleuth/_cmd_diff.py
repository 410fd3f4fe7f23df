"""`sleuth diff A B`: compare two dumps record by record and name the first divergent record.

Exit codes: 0 the dumps agree within tolerance, 1 they diverge, 2 error (bad path, missing
rank/step, dumps that share no record).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from sleuth.cli import CliError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "diff", help="compare two dumps and name the first divergent record",
        description="Compare dump A with dump B (run directories, dump directories or step "
        "files): per record cosine similarity, max absolute/relative error, RMSE, share within "
        "tolerance, NaN/Inf differences (or statistics when a side has no tensor bytes), and "
        "the first divergent record in execution order. Exit code 0 same, 1 diverged, 2 error.",
    )
    p.add_argument("a", metavar="A", help="run directory, dump directory or step file")
    p.add_argument("b", metavar="B", help="the run to compare with")
    p.add_argument("--step", type=int, help="step of A (default: every step both dumps hold)")
    p.add_argument("--rank", type=int, default=0, help="rank of A (default 0)")
    p.add_argument("--b-step", type=int, help="step of B when it differs from --step")
    p.add_argument("--b-rank", type=int, help="rank of B when it differs from --rank")
    p.add_argument("--rtol", type=float, help="relative tolerance (default: per dtype)")
    p.add_argument("--atol", type=float, help="absolute tolerance (default: per dtype)")
    p.add_argument("--cosine-min", type=float, help="smallest cosine that counts as the same")
    p.add_argument("--top", type=int, default=10, help="worst records to list (default 10)")
    p.add_argument("--csv", metavar="FILE", help="write every record's row to FILE")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--progress", action="store_true",
                   help="show progress on stderr (default: only when stderr is a terminal)")
    p.set_defaults(run=_run)


def _fmt(v: Any, kind: str = "g") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:.6f}" if kind == "cos" else f"{v:.3g}"
    return str(v)


def _severity(row: dict) -> tuple:
    cos = row.get("cosine")
    cos = 1.0 if cos is None or (isinstance(cos, float) and math.isnan(cos)) else cos
    rel = row.get("max_rel_err")
    rel = row.get("norm_rdiff") if rel is None or (isinstance(rel, float) and math.isnan(rel)) \
        else rel
    rel = 0.0 if rel is None or (isinstance(rel, float) and math.isnan(rel)) else rel
    return (-(1.0 - cos), -rel)


def format_report(result: Any, top: int = 10) -> str:
    """The terminal report: status line, first divergence, then the worst records as a table."""
    c = result.counts()
    lines = [f"status: {result.status.upper()}   compared: {result.compared}   records: "
             f"{sum(c.values())} ({c['same']} same, {c['diverged']} diverged, {c['only_a']} only "
             f"in A, {c['only_b']} only in B)"]
    fd = result.first_divergence
    if fd:
        op = f"   op {fd['op']}" if fd["op"] else ""
        cross = ""
        if (fd["b_step"], fd["b_rank"]) != (fd["step"], fd["rank"]):
            cross = f" vs B step {fd['b_step']}, rank {fd['b_rank']}"
        lines += ["", f"first divergence ({fd['kind']}): {fd['name']}",
                  f"  module {fd['module']}{op}   phase {fd['phase']}   step {fd['step']}   "
                  f"rank {fd['rank']}{cross}",
                  f"  source {fd['source'] or '-'}",
                  f"  {fd['reason']}"]
        if fd["kind"] == "data":
            lines.append("  the model's input differs: the two runs were fed different data")
        elif fd["kind"] == "parameter":
            lines.append("  the weights differed before this step began")
    for note in result.notes:
        lines.append(f"note: {note}")
    df = result.records
    rows = df[df["verdict"] == "diverged"].to_dict("records")
    if rows:
        first = rows[0]
        worst = sorted(rows[1:], key=_severity)[:max(top - 1, 0)]
        table = [first] + worst
        head = ("order", "name", "phase", "dtype", "cosine", "max_abs", "max_rel", "within",
                "nan/inf", "compared")
        cells = [[str(r["order"]), r["name"] or r["b_name"], r["phase"],
                  r["dtype"] if r["dtype"] == r["b_dtype"] else f"{r['dtype']}/{r['b_dtype']}",
                  _fmt(r["cosine"], "cos"), _fmt(r["max_abs_err"]),
                  _fmt(r["max_rel_err"] if r["compared"] == "tensor" else r["max_rdiff"]),
                  _fmt(r["within"]), _fmt(_nan_inf(r)), r["compared"]] for r in table]
        widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(head)]
        widths[1] = min(widths[1], 70)
        lines += ["", f"divergent records (first, then the worst {len(worst)}):",
                  "  ".join(h.ljust(w) for h, w in zip(head, widths))]
        for cell in cells:
            if len(cell[1]) > widths[1]:
                cell[1] = "..." + cell[1][-(widths[1] - 3):]
            lines.append("  ".join(v.ljust(w) for v, w in zip(cell, widths)))
    return "\n".join(lines)


def _nan_inf(r: dict) -> Any:
    n, i = r.get("nan_diff"), r.get("inf_diff")
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return None
    return int(n) + int(i)


def _run(args: argparse.Namespace) -> int:
    import tracer
    from tracer._errors import TracerError

    try:
        tol = tracer.Tolerance(rtol=args.rtol, atol=args.atol, cosine_min=args.cosine_min)
        progress = args.progress or sys.stderr.isatty()
        result = tracer.diff(args.a, args.b, step=args.step, rank=args.rank,
                             b_step=args.b_step, b_rank=args.b_rank, tolerance=tol,
                             progress=progress)
    except TracerError as e:
        raise CliError(str(e)) from e
    if args.csv:
        try:
            result.records.to_csv(args.csv, index=False)
        except OSError as e:
            raise CliError(f"cannot write {args.csv}: {e}") from e
    if args.json:
        print(json.dumps(result.to_dict(), allow_nan=False))
    else:
        print(format_report(result, args.top))
    return 0 if result.status == "same" else 1
