"""`sleuth check RUN`: evaluate watchpoints on a dump and locate the first NaN/Inf;
`sleuth check --headroom RUN`: the records heading toward overflow or underflow.

Exit codes: 0 nothing found in a dump read completely, 1 a watchpoint hit (or a NaN/Inf origin
found), 2 error, or not everything could be read (partial, unreadable, truncated or damaged
files, nothing to read), or nothing found while a step was interrupted: never "clean" on data
that was not all there.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from sleuth.cli import CliError
from tracer.storage import printable


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "check", help="check a dump against watchpoints; find where the first NaN came from",
        description="Evaluate watchpoints (NaN/Inf, all-zero, too large/small, out of range, "
        "weight change, gradient explosion/vanishing, unchanged weights) on every record of a "
        "dump, and name the first record whose outputs are NaN/Inf while its inputs are finite. "
        "Conditions: --condition nan_inf --condition max_abs_gt=1e4 --condition "
        "out_of_range=-10:10 --condition grad_explode=100 --condition overflow_headroom_lt=8. "
        "With --headroom, the records heading toward overflow or underflow instead, from the "
        "trend of their statistics over the dumped steps. Exit code 0 clean, 1 hits, 2 error or "
        "not everything could be read (each unread file is named).",
    )
    p.add_argument("path", metavar="RUN", help="run directory, dump directory or step file")
    p.add_argument("--rank", type=int, help="only this rank (default: all)")
    p.add_argument("--step", type=int, help="only this step (default: all)")
    p.add_argument("--condition", action="append", metavar="NAME[=VALUE]",
                   help="a watchpoint; VALUE is the threshold, or LOW:HIGH for out_of_range "
                   "(repeatable; default: the dump config's watch list plus nan_inf)")
    p.add_argument("--watch", metavar="JSON",
                   help='watchpoints as JSON or a JSON file: [{"condition": "nan_inf"}, ...]')
    p.add_argument("--first-nan", action="store_true",
                   help="only locate the origin of the first NaN/Inf")
    p.add_argument("--nan-allow", action="append", metavar="PATTERN", default=[],
                   help="records whose NaN/Inf are intended (a causal mask): no nan_inf hit and "
                   "no first-NaN origin on them or on records holding the same values; a glob "
                   "over record names or re:REGEX (repeatable; adds to the dump config's "
                   "nan_allow)")
    p.add_argument("--headroom", action="store_true",
                   help="only the headroom trends: per record, log2 max|x| and the share of "
                   "zeros fitted over the dumped steps; lists the records heading toward "
                   "overflow (steps left until the dtype's largest value) or underflow (zeros "
                   "rising toward every element; max|x| below the smallest normal), soonest "
                   "first")
    p.add_argument("--horizon", type=float, metavar="STEPS",
                   help="with --headroom: list trends that reach their limit within STEPS steps "
                   "of a record's last dumped step (default 100)")
    p.add_argument("--window", type=int, metavar="N",
                   help="with --headroom: fit only each record's last N dumped steps (default: "
                   "all of them)")
    p.add_argument("--limit", type=int, default=20,
                   help="hits (with --headroom: rows of each list) to print (default 20)")
    p.add_argument("--workers", type=int, metavar="N",
                   help="local processes checking the ranks of a dump of several ranks "
                   "(default: one per core, at most one per rank; 1 checks them in this process)")
    p.add_argument("--scheduler", metavar="ADDRESS",
                   help="check the ranks on this Dask scheduler (tcp://host:8786; default: "
                   "$SLEUTH_DASK_SCHEDULER, else local processes); every worker must see the "
                   "dump at the same path")
    p.add_argument("--csv", metavar="FILE", help="write every hit to FILE")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=_run)


def parse_condition(spec: str) -> dict[str, Any]:
    """'max_abs_gt=1e4' -> {"condition": "max_abs_gt", "threshold": 1e4};
    'out_of_range=-1:1' -> {"condition": "out_of_range", "low": -1, "high": 1}."""
    name, _, value = spec.partition("=")
    out: dict[str, Any] = {"condition": name.strip()}
    if not value:
        return out
    try:
        if name.strip() == "out_of_range":
            low, _, high = value.partition(":")
            if low:
                out["low"] = float(low)
            if high:
                out["high"] = float(high)
        else:
            out["threshold"] = float(value)
    except ValueError as e:
        raise CliError(f"--condition {spec}: {value!r} is not a number (out_of_range takes "
                       "LOW:HIGH)") from e
    return out


def _watch(args: argparse.Namespace) -> list[dict] | None:
    points: list[dict] = []
    if args.watch:
        from sleuth._configs import json_option

        loaded = json_option(args.watch, "--watch")
        points += loaded if isinstance(loaded, list) else [loaded]
    points += [parse_condition(c) for c in args.condition or []]
    return points or None


def _clean(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else str(v)
    return v


def _run(args: argparse.Namespace) -> int:
    if args.headroom:
        return _run_headroom(args)
    for flag, value in (("--horizon", args.horizon), ("--window", args.window)):
        if value is not None:
            raise CliError(f"{flag} goes with --headroom (sleuth check --headroom RUN {flag} ...)")
    from tracer import TracerError
    from tracer.analysis import Coverage, check, describe_origin, find_first_nan
    from sleuth._cmd_dump import _open

    if args.workers is not None and args.workers < 1:
        raise CliError(f"--workers {args.workers}: give 1 or more")
    _watch(args)  # a bad --watch is reported before the dump is opened
    dump = _open(args.path)
    engine = "in-process"
    try:
        if _several_ranks(args):
            dump.close()  # each rank's task opens its own files
            hits = _check_ranks(args)
            engine = hits.attrs["engine"]
            origin = hits.attrs["first_nan"]
            cov = hits.attrs["coverage"]
            if args.first_nan:
                hits = None
        elif args.first_nan:
            coverage = Coverage()
            origin = find_first_nan(dump, coverage, rank=args.rank, step=args.step,
                                    nan_allow=args.nan_allow)
            hits = None
            cov = coverage.to_dict()
        else:
            hits = check(dump, watch=_watch(args), rank=args.rank,
                               step=args.step, nan_allow=args.nan_allow)
            origin = hits.attrs.get("first_nan")
            cov = hits.attrs["coverage"]
    except TracerError as e:
        raise CliError(str(e)) from e
    n = 0 if hits is None else len(hits)
    if args.csv and hits is not None:
        try:
            hits.to_csv(args.csv, index=False)
        except OSError as e:
            raise CliError(f"cannot write {args.csv}: {e}") from e
        print(f"sleuth check: {len(hits)} hit(s) written to {args.csv}", file=sys.stderr)
    found = bool(n) or origin is not None
    code, verdict = _verdict(args, found, origin, cov)
    if args.json:
        out = {"status": {0: "clean", 1: "hit", 2: "incomplete"}[code], "found": found,
               "verdict": verdict, "read": cov["read"], "unread": cov["unread"],
               "interrupted": cov["interrupted"], "engine": engine,
               "first_nan": {k: _clean(v) for k, v in origin.items()} if origin else None}
        if hits is not None:
            out["hits"] = [{k: _clean(v) for k, v in h.items()} for h in hits.to_dict("records")]
        print(json.dumps(out, allow_nan=False))
        return code
    if origin is not None:
        print(describe_origin(origin))
        for s in origin.get("skipped_values") or []:
            print(f"  passed over {s['name']} ({s['values']}): {s['why']}")
    elif args.first_nan and cov["read"]:
        print("no NaN or Inf origin in the steps that were read (values a later op absorbs, "
              "like a causal mask's -inf before softmax, and nan_allow records are passed "
              "over)")
    if hits is not None and cov["read"]:
        if not n:
            print("no watchpoint hit in the steps that were read")
        else:
            by = hits["condition"].value_counts()
            print(f"{n} watchpoint hits: " + ", ".join(f"{c} {k}" for c, k in by.items()))
            for h in hits.head(args.limit).to_dict("records"):
                op = f"{h['op']} " if h["op"] else ""
                print(f"  step {h['step']} rank {h['rank']}  {h['condition']:<16} "
                      f"{h['value']:<10.4g} {h['name']}  ({op}{h['module']}, "
                      f"{h['source'] or '-'})")
            if n > args.limit:
                print(f"  ... {n - args.limit} more (--limit, --csv)")
    return _close(cov, code, verdict, "searched, records up to the stop")



def _several_ranks(args: argparse.Namespace) -> bool:
    """Whether each rank is checked as its own task: no --rank, a directory, several ranks."""
    if args.rank is not None or not Path(args.path).is_dir():
        return False
    from tracer.analysis import dump_ranks

    return len(dump_ranks(args.path)) > 1


def _check_ranks(args: argparse.Namespace) -> Any:
    """`check_ranks` with the CLI's options and a progress line on a terminal."""
    from tracer.analysis import check_ranks

    show = sys.stderr.isatty()

    def progress(done: int, total: int) -> None:
        if show:
            print(f"\rcheck: {done}/{total} rank(s)", end="", file=sys.stderr, flush=True)

    try:
        return check_ranks(args.path, watch=None if args.first_nan else _watch(args),
                           step=args.step, nan_allow=args.nan_allow,
                           only_first_nan=args.first_nan, workers=args.workers or 0,
                           scheduler=args.scheduler, progress=progress)
    finally:
        if show:
            print(file=sys.stderr)


def _close(cov: dict[str, Any], code: int, verdict: str, interrupted_use: str) -> int:
    """The lines every check answer ends with: the interrupted steps (and how their records were
    used), the files not read, and on stderr why the answer is incomplete; returns `code`."""
    for i in cov["interrupted"]:
        print(f"step {i['step']} rank {i['rank']} is {i['status']} "
              f"({printable(i['reason'] or 'no reason recorded')}): {interrupted_use}")
    for u in cov["unread"]:  # paths and reasons (run ids) from disk: controls escaped
        print(f"not read: {printable(u['path'])}: {printable(u['reason'])}")
    if code == 2:
        print(f"sleuth check: {verdict}", file=sys.stderr)
    return code

def _verdict(args: argparse.Namespace, found: bool, origin: dict | None,
             cov: dict[str, Any]) -> tuple[int, str]:
    """The exit code and, when it is 2, why: nothing is called clean on data not all read."""
    from tracer.analysis import Coverage

    if cov["read"] and args.first_nan and origin is not None:
        before = origin.get("unread_before") or []
        if before:
            empty = [u for u in before if u.get("state") == "empty"]
            files = [u for u in before if u.get("state") != "empty"]
            where = []
            if files:
                where.append(f"{len(files)} earlier step file(s) that could not be read: "
                             + ", ".join(u["path"] for u in files))
            if empty:
                where.append(f"{len(empty)} rank folder(s) that hold no step file (those ranks "
                             "dumped nothing): " + ", ".join(u["path"] for u in empty))
            return 2, "the origin may lie in " + "; or in ".join(where)
        return 1, "origin found"
    return Coverage.verdict(cov, found, args.path)


# -- --headroom ------------------------------------------------------------------------------------
def _run_headroom(args: argparse.Namespace) -> int:
    from tracer import TracerError
    from tracer.analysis import headroom_trend
    from sleuth._cmd_dump import _open

    for flag, given in (("--step", args.step is not None), ("--first-nan", args.first_nan),
                        ("--condition", bool(args.condition)), ("--watch", bool(args.watch)),
                        ("--csv", bool(args.csv)), ("--workers", args.workers not in (None, 1)),
                        ("--scheduler", bool(args.scheduler))):
        if given:
            why = ("a trend needs every dumped step" if flag == "--step" else
                   "use --json for the trend rows" if flag == "--csv" else
                   "the trends are fitted in this process" if flag in ("--workers",
                                                                        "--scheduler") else
                   "run it as a separate sleuth check")
            raise CliError(f"--headroom and {flag} do not go together: {why}")
    dump = _open(args.path)
    kwargs: dict[str, Any] = {"rank": args.rank, "nan_allow": args.nan_allow}
    if args.horizon is not None:
        kwargs["horizon"] = args.horizon
    if args.window is not None:
        kwargs["window"] = args.window
    try:
        report = headroom_trend(dump, **kwargs)
    except TracerError as e:
        raise CliError(str(e)) from e
    code, verdict = report.verdict
    if args.json:
        print(json.dumps(report.to_dict(), allow_nan=False))
        return code
    ranks = len(report.steps) > 1
    horizon = f"{report.horizon:g}"
    if len(report.overflow):
        print(f"heading toward overflow within {horizon} steps: {len(report.overflow)} "
              "record(s), soonest first (log2 max|x| fitted over the dumped steps)")
        rows = [(f"{r['at_step']}", f"{r['steps_left']:.1f}", f"{r['headroom_bits']:.1f} bits",
                 f"{r['growth_bits']:+.2f} bits", r["dtype"], r["module"], r["name"], r["rank"])
                for r in report.overflow.head(args.limit).to_dict("records")]
        _table(("at step", "steps left", "headroom", "growth/step", "dtype", "module",
                "record"), rows, ranks)
        _more(len(report.overflow), args.limit)
        first = report.overflow.iloc[0]
        sq = first["square_steps_left"]
        when = (f"in {sq:.1f} steps, at step {math.ceil(first['last_step'] + sq)}" if sq > 0
                else "already")
        print(f"  sooner, x*x overflows (headroom below half the dtype's range: a variance, a "
              f"norm, q.k; the usual first Inf): {first['name']} {when}")
    if len(report.underflow):
        print(f"heading toward underflow within {horizon} steps: {len(report.underflow)} "
              "record(s), soonest first")
        rows = []
        for r in report.underflow.head(args.limit).to_dict("records"):
            if r["kind"] == "zero_share":
                now = f"{100 * r['zero_share']:.1f}% zeros"
                per = f"{100 * r['zero_share_per_step']:+.1f}% zeros"
            else:
                now = f"max|x| {-r['underflow_bits']:.1f} bits below normal"
                g = r["growth_bits"]
                per = f"{g:+.2f} bits" if g == g else "-"
            rows.append((f"{r['at_step']}", f"{r['steps_left']:.1f}", now, per, r["dtype"],
                         r["module"], r["name"], r["rank"]))
        _table(("at step", "steps left", "now", "per step", "dtype", "module", "record"), rows,
               ranks)
        _more(len(report.underflow), args.limit)
    if len(report.nonfinite):
        import shlex

        again = ["sleuth", "check", "--first-nan", args.path,
                 *(["--rank", str(args.rank)] if args.rank is not None else [])]
        print(f"already non-finite: {len(report.nonfinite)} record(s), not projected; where "
              f"the first came from: {' '.join(shlex.quote(w) for w in again)}")
        rows = [(f"{r['first_step']}", f"{r['nan']}", f"{r['posinf']}", f"{r['neginf']}",
                 r["module"], r["name"], r["rank"])
                for r in report.nonfinite.head(args.limit).to_dict("records")]
        _table(("first step", "NaN", "+Inf", "-Inf", "module", "record"), rows, ranks)
        _more(len(report.nonfinite), args.limit)
    cov = report.coverage
    if cov["read"]:
        if not report.projected:
            print(report.no_trend_reason())
        elif not report.found:
            print(f"nothing heading toward overflow or underflow within {horizon} steps")
        spans = "; ".join(f"rank {r}: steps {_span(s)}" for r, s in sorted(report.steps.items()))
        few = (f"; {report.too_few} with fewer than {report.min_steps} dumped steps, not "
               "projected" if report.too_few else "")
        print(f"fitted {report.projected} of {report.records} floating-point record(s) ({spans})"
              f"{few}")
    return _close(cov, code, verdict, "its records up to the stop are used")


def _table(header: tuple[str, ...], rows: list[tuple], ranks: bool) -> None:
    """A left-aligned table, two spaces in; the numbers right-aligned; a rank column first when
    the dump has several ranks (each row's last item is its rank)."""
    if ranks:
        header = ("rank", *header)
        rows = [(str(r[-1]), *r[:-1]) for r in rows]
    else:
        rows = [r[:-1] for r in rows]
    numeric = {i for i, h in enumerate(header) if h in ("rank", "at step", "steps left",
                                                         "first step", "NaN", "+Inf", "-Inf")}
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    for row in (header, *rows):
        cells = [str(x).rjust(w) if i in numeric else str(x).ljust(w)
                 for i, (x, w) in enumerate(zip(row, widths))]
        print("  " + "  ".join(cells).rstrip())


def _more(n: int, limit: int) -> None:
    if n > limit:
        print(f"  ... {n - limit} more (--limit, --json)")


def _span(steps: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8"."""
    parts: list[str] = []
    start = prev = None
    for s in sorted(steps):
        if prev is not None and s == prev + 1:
            prev = s
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = s
    if start is not None:
        parts.append(str(start) if start == prev else f"{start}-{prev}")
    return ", ".join(parts) or "none"
