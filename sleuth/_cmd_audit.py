"""`sleuth audit RUN`: how much precision each op of one step loses, against float64, without a
reference run.

Exit codes: 0 audited, 2 error (a dump without call specs, a missing rank or step).
"""
from __future__ import annotations

import argparse
import json
import math
import sys

from sleuth.cli import CliError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "audit", help="rank the ops of one step by the precision they lose, against float64",
        description="Re-run every recorded op call of one step in float64 on its recorded "
        "inputs and compare the recorded outputs with that: the relative error each op adds on "
        "its own inputs, also in units of its dtype's roundoff. Lists the ops less exact than "
        "their dtype allows (most units) and those that lose the most precision (largest "
        "error: where a float32 island would help). Needs a dump at level op (or mix) with "
        "mode tensor (or full).")
    p.add_argument("path", metavar="RUN", help="run directory, dump directory or step file")
    p.add_argument("--step", type=int, help="step (default: the rank's first)")
    p.add_argument("--rank", type=int, default=0, help="rank (default 0)")
    p.add_argument("--top", type=int, default=10, help="rows of each list (default 10)")
    p.add_argument("--csv", metavar="FILE", help="write every row to FILE")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    from tracer import TracerError
    from tracer.analysis import audit

    if args.top < 1:
        raise CliError("--top must be 1 or more")
    try:
        result = audit(args.path, step=args.step, rank=args.rank)
    except TracerError as e:
        raise CliError(str(e)) from e
    if args.csv:
        try:
            result.table.to_csv(args.csv, index=False)
        except OSError as e:
            raise CliError(f"cannot write {args.csv}: {e}") from e
        print(f"sleuth audit: {len(result.table)} row(s) written to {args.csv}", file=sys.stderr)
    if args.json:
        print(json.dumps(result.to_dict(), allow_nan=False))
        return 0
    t = result.table
    print(f"rank {result.rank} step {result.step}: {result.calls - len(result.not_replayed)} of "
          f"{result.calls} op call(s) re-run in float64, {len(t)} floating-point output(s) "
          "compared")
    for title, key in (("less exact than their dtype allows (relative error in units of its "
                        "roundoff; about 1 is the best a dtype can do)", "units"),
                       ("losing the most precision (relative error against float64: where a "
                        "float32 island would help first)", "rel_error")):
        rows = t.sort_values(key, ascending=False, kind="stable").head(args.top)
        print(f"\n{title}:")
        for r in rows.to_dict("records"):
            units = f"{r['units']:.1f}" if math.isfinite(r["units"]) else str(r["units"])
            print(f"  {r['rel_error']:10.3g}  {units:>8} units  {r['dtype']:<9} {r['name']}  "
                  f"({r['source'] or '-'})")
    for s in result.not_replayed[:args.top]:
        print(f"not re-run: {s['name']}: {s['why']}")
    if len(result.not_replayed) > args.top:
        print(f"... {len(result.not_replayed) - args.top} more not re-run (--json)",
              file=sys.stderr)
    return 0
