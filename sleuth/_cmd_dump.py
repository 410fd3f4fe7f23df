"""`sleuth dump`: list a run's tensor dump (`ls`) and print one step's statistics (`show`)."""
from __future__ import annotations

import argparse
import sys
from typing import Any

from sleuth.cli import CliError

_SHOW_COLUMNS = ["seq", "name", "dtype", "shape", "min", "max", "mean", "norm", "nan", "posinf",
                 "neginf", "zeros", "source"]


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "dump", help="list a tensor dump and print its statistics",
        description="Inspect the tensor dump under RUN/dump (written by the tracer: "
        "SLEUTH_DUMP_CONFIG=dump.json, see `sleuth docs dump-config`). RUN may be a run directory, its "
        "dump/ folder, a rank folder or one step file.")
    sub = p.add_subparsers(dest="dump_command", metavar="ACTION")
    ls = sub.add_parser("ls", help="ranks, steps, record counts and sizes",
                        description="One line per step file: rank, step, records, tensor bytes, "
                        "file size; partial files left by a crash are listed apart.")
    ls.add_argument("path", metavar="RUN",
                    help="a run directory, its dump/ folder, a rank folder or one step file")
    ls.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ls.set_defaults(run=_ls)
    show = sub.add_parser("show", help="the statistics of every record of one step",
                          description="Print the /records table of one step in execution order.")
    show.add_argument("path", metavar="RUN",
                      help="a run directory, its dump/ folder, a rank folder or one step file")
    show.add_argument("--step", type=int, help="step to show (default: the only one, if one)")
    show.add_argument("--rank", type=int, default=None, help="rank (default: the lowest)")
    show.add_argument("--filter", metavar="GLOB", help="only records whose name matches, e.g. "
                      "'layers.0.*' (fnmatch; 're:REGEX' for a regular expression)")
    show.add_argument("--csv", metavar="FILE", help="also write every column to FILE as CSV")
    show.add_argument("--json", action="store_true", help="print JSON records, every column")
    show.set_defaults(run=_show)
    p.set_defaults(run=lambda args: _usage(p))


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _open(path: str):
    import warnings

    import tracer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # skipped files are reported below, not as warnings
        try:
            return tracer.open_dump(path)
        except tracer.TracerError as e:
            raise CliError(str(e)) from e


def _human(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return str(n)  # pragma: no cover


def _ls(args: argparse.Namespace) -> int:
    import json

    import tracer

    d = _open(args.path)
    try:
        table = d.summary()
    except tracer.TracerError as e:
        raise CliError(str(e)) from e
    if args.json:
        out = {"root": str(d.root), "ranks": d.ranks,
               "files": json.loads(table.to_json(orient="records", double_precision=15)),
               "skipped": [{"path": p, "reason": r} for p, r in d.skipped]}
        print(json.dumps(out, indent=2))
        return 0
    print(f"dump {d.root}: {len(d.ranks)} rank(s), {len(table)} step file(s), "
          f"{_human(int(table.file_bytes.sum()) if len(table) else 0)}")
    if len(table):
        print(_captured(d, int(table["rank"].iloc[0]), int(table["step"].iloc[0])))
        shown = table.drop(columns=["path"]).assign(
            tensor_bytes=table.tensor_bytes.map(_human), file_bytes=table.file_bytes.map(_human),
            complete=table.complete.map({True: "yes", False: "no (closed mid-step)"}))
        print(shown.to_string(index=False))
    for path, reason in d.skipped:
        print(f"skipped {path}: {reason}")
    return 0


def _captured(d, rank: int, step: int) -> str:
    """How the first step file was dumped: level, mode, op capture and writer."""
    from tracer._reader import config_of, op_capture_of

    attrs = d.attrs(rank, step)
    return (f"captured: level {attrs.get('level', '?')}, mode {attrs.get('mode', '?')}, "
            f"op capture {op_capture_of(attrs)}, writer {config_of(attrs).get('writer', '?')}")


def _show(args: argparse.Namespace) -> int:
    import fnmatch
    import re

    import tracer

    d = _open(args.path)
    rank = args.rank if args.rank is not None else (d.ranks[0] if d.ranks else 0)
    step = args.step
    if step is None:
        steps = d.steps(rank)
        if len(steps) != 1:
            raise CliError(f"rank {rank} has {len(steps)} steps ({', '.join(map(str, steps[:12]))}"
                           f"{', ...' if len(steps) > 12 else ''}): choose one with --step")
        step = steps[0]
    try:
        df = d.stats(rank, step)
        hits = d.hits(rank, step)
    except tracer.TracerError as e:
        raise CliError(str(e)) from e
    if args.filter:
        if args.filter.startswith("re:"):
            try:
                pattern = re.compile(args.filter[3:])
            except re.error as e:
                raise CliError(f"--filter: bad regular expression: {e}") from e
            keep = df.name.map(lambda n: bool(pattern.search(n)))
        else:
            keep = df.name.map(lambda n: fnmatch.fnmatchcase(n, args.filter))
        if not keep.any():
            examples = ", ".join(df.name.head(3)) or "none"
            raise CliError(f"--filter {args.filter!r} matches none of the {len(df)} records of "
                           f"rank {rank} step {step}; names look like: {examples}")
        df = df[keep]
    if args.csv:
        df.to_csv(args.csv, index=False)
    if args.json:
        sys.stdout.write(df.to_json(orient="records", indent=1, double_precision=15) + "\n")
        return 0
    print(f"rank {rank} step {step}: {len(df)} record(s)"
          + (f", {len(hits)} watchpoint hit(s)" if len(hits) else ""))
    if len(df):
        print(df[_SHOW_COLUMNS].to_string(index=False, float_format=lambda v: f"{v:.6g}"))
    if len(hits):
        print("\nwatchpoint hits:")
        print(hits.to_string(index=False))
    if args.csv:
        print(f"wrote {args.csv}", file=sys.stderr)
    return 0
