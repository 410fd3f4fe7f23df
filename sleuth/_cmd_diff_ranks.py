"""`sleuth diff A B` on dumps of several ranks: every rank pair diffed (in local processes or
on a Dask cluster), the earliest divergence across ranks, and a rank x step grid."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from sleuth.cli import CliError

_CELL = {"same": ".", "diverged": "X", "interrupted": "i", "missing": "-"}
"""One character per rank x step cell; any other problem state (truncated, unreadable,
damaged, ...) is "?"."""


def wants_ranks(args: argparse.Namespace) -> bool:
    """True when no rank was chosen and either side has more than one rank. Two dumps of one
    rank each (two rank folders of one run, RUN/dump/rank0 and RUN/dump/rank1) are one pair:
    the one-pair diff compares them, whatever their ranks."""
    from pathlib import Path

    from tracer.analysis import dump_ranks

    if args.rank is not None or args.b_rank is not None or args.b_step is not None:
        return False
    if not (Path(args.a).is_dir() and Path(args.b).is_dir()):
        return False
    try:
        ra, rb = dump_ranks(args.a), dump_ranks(args.b)
    except Exception:  # noqa: BLE001 - the one-rank diff reports what is wrong with the path
        return False
    return len(set(ra) | set(rb)) > 1 and not (len(ra) == 1 and len(rb) == 1)


def run_ranks(args: argparse.Namespace, tol: Any) -> int:
    from tracer import TracerError
    from tracer.analysis import diff_ranks

    show = args.progress or sys.stderr.isatty()

    def progress(done: int, total: int) -> None:
        if show:
            print(f"\rdiff: {done}/{total} rank(s)", end="", file=sys.stderr, flush=True)

    try:
        result = diff_ranks(args.a, args.b, step=args.step, tolerance=tol,
                            allow_missing=args.allow_missing, workers=args.workers or 0,
                            scheduler=args.scheduler, progress=progress)
    except TracerError as e:
        raise CliError(str(e)) from e
    if show:
        print(file=sys.stderr)
    if args.json:
        print(json.dumps(result.to_dict(), allow_nan=False))
    else:
        print(format_rank_report(result, args.a, args.b))
    return result.exit_code


def format_rank_report(result: Any, a: str = "A", b: str = "B") -> str:
    """Status, what changed on the rank that diverged first (and the `sleuth explain` command
    for it), the earliest divergence across ranks, each rank's line, then the grid."""
    from sleuth._cmd_diff import diff_command, explain_command, headline

    ranks = result.ranks
    diverged = [r for r in ranks if r["status"] == "diverged"]
    unread = [r for r in ranks if r["status"] == "incomplete"]
    lines = [f"status: {result.status.upper()}   ranks: {len(ranks)} compared "
             f"({len(ranks) - len(diverged) - len(unread)} same, {len(diverged)} diverged, "
             f"{len(unread)} incomplete)   on: {result.engine}"]
    fd = result.earliest
    if fd:
        first = next(r for r in ranks if r["rank"] == fd["rank"])
        lines += headline(first.get("changes") or [],
                          explain_command(a, b, fd["step"], fd["rank"]))
    for side, only in (("A", result.only_a), ("B", result.only_b)):
        if only:
            lines.append(f"rank(s) only in {side}, not compared: {', '.join(map(str, only))}; "
                         f"compare one pair with --rank R --b-rank R2")
    if fd:
        op = f"   op {fd['op']}" if fd["op"] else ""
        lines += ["", f"earliest divergence ({fd['kind']}): rank {fd['rank']} step {fd['step']}: "
                  f"{fd['name']}", f"  module {fd['module']}{op}   phase {fd['phase']}",
                  f"  source {fd['source'] or '-'}", f"  {fd['reason']}",
                  f"  all of it: {diff_command(a, b, fd['step'], fd['rank'])}"]
    lines += ["", "per rank:"]
    for r in ranks:
        first = r["first_divergence"]
        what = (f"first divergence step {first['step']}: {first['name']}" if first else
                r["error"] or ("; ".join(f"{p['side']} step {p['step']}: {p['state']}"
                                         for p in r["problems"][:3]) or "no divergence"))
        lines.append(f"  rank {r['rank']}: {r['status']:<10} {what}")
    lines += ["", "rank x step (. same, X diverged, i interrupted, - missing, ? unreadable):"]
    lines += _grid(result.table())
    return "\n".join(lines)


def _grid(table: dict[int, dict[int, str]]) -> list[str]:
    steps = sorted({s for row in table.values() for s in row})
    if not steps:
        return ["  (no step compared)"]
    shown = steps[:60]
    head = "  rank  " + " ".join(f"{s:>3}" for s in shown)
    out = [head + (f"  (+{len(steps) - 60} steps: see --json)" if len(steps) > 60 else "")]
    for rank, row in table.items():
        out.append(f"  {rank:>4}  " + " ".join(f"{_CELL.get(row.get(s, ''), '?') if s in row else ' ':>3}"
                                             for s in shown))
    return out
