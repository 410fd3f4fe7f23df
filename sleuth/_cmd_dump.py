"""`sleuth dump`: list a run's tensor dump (`ls`) and print one step's statistics (`show`)."""
from __future__ import annotations

import argparse
import sys
from typing import Any

from sleuth.cli import CliError
from tracer.storage import printable

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
                        "file size and status: complete, interrupted (the run stopped in "
                        "that step), damaged (its records table does not read), partial "
                        "(being written, or left by a crash) or unreadable. Exit code 0 when "
                        "every file is complete, 1 when one is not, 2 on error (a step "
                        "file that is a soft link looping or leading nowhere included: the "
                        "others are still listed).")
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
    from sleuth._cmd_dump_export import add_parser as add_export

    add_export(sub)
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
        except (OSError, KeyError, ValueError) as e:  # HDF5 metadata that does not read
            raise CliError(f"cannot open the dump at {path}: {_damaged(path)} ({e}); move "
                           f"the damaged file(s) aside to read the others") from e


def _damaged(path: str) -> str:
    """Which step files under `path` fail to open or to show their root attributes."""
    from tracer.storage import damaged_files

    bad = damaged_files(path)
    return ("damaged: " + ", ".join(bad)) if bad else "a file is damaged"


def _human(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return str(n)  # pragma: no cover


def _ls(args: argparse.Namespace) -> int:
    import json

    from tracer.storage import file_rows, path_problem

    d = _open(args.path)
    rows = sorted(file_rows(d), key=lambda r: (r["rank"] is None, r["rank"] or 0,
                                                r["step"] is None, r["step"] or 0))
    bad = [r for r in rows if r["status"] != "complete"]
    # a path that leads to no file is an error in the input, not a step the run left unfinished
    # (an empty rank folder is a folder by right: only step files are judged as files here)
    code = 2 if any(path_problem(r["path"]) for r in bad
                    if r["path"] and r["step"] is not None) else 1 if bad else 0
    if args.json:
        out = {"root": str(d.root), "ranks": d.ranks, "files": rows,
               "skipped": [{"path": p, "reason": r} for p, r in d.skipped],
               "not_complete": len(bad), "notes": _notes(rows)}
        print(json.dumps(out, indent=2))
        return code
    total = sum(r["file_bytes"] or 0 for r in rows)
    readable = [r for r in rows if r["records"] is not None]
    # before the first line: a config that is refused is the command's one line
    captured = _captured(d, readable[0]["rank"], readable[0]["step"]) if readable else None
    # paths, reasons and run ids come from disk: printed with control characters escaped
    print(f"dump {printable(d.root)}: {len(d.ranks)} rank(s), {len(rows)} step file(s), "
          f"{_human(total)}")
    if captured:
        print(captured)
    if rows:
        print(_table(rows))
    for r in bad:
        reason = r["reason"] or "no reason recorded"
        if not reason.startswith(r["status"]):
            reason = f"{r['status']}: {reason}"
        print(f"{printable(r['path'])}: {printable(reason)}")
    for note in _notes(rows):
        print(printable(f"not written: step {note.get('step')} of rank {note.get('rank')}, "
                        f"{note.get('dropped_records')} record(s): {note.get('reason')}"))
    if bad:
        print(f"{len(bad)} of {len(rows)} step file(s) not complete", file=sys.stderr)
    return code


def _table(rows: list[dict]) -> str:
    import pandas as pd

    def cell(v: Any, fmt=str) -> str:
        return "?" if v is None else fmt(v)

    shown = pd.DataFrame({
        "rank": [cell(r["rank"]) for r in rows], "step": [cell(r["step"]) for r in rows],
        "records": [cell(r["records"]) for r in rows],
        "tensor_bytes": [cell(r["tensor_bytes"], _human) for r in rows],
        "file_bytes": [cell(r["file_bytes"], _human) for r in rows],
        "status": [r["status"] for r in rows]})
    return shown.to_string(index=False)


def _notes(rows: list[dict]) -> list[dict]:
    """The lines of each rank's notes.jsonl (steps the tracer dropped at close), with rank."""
    from pathlib import Path

    from tracer.storage import loads_bounded, read_text_bounded

    folders = {r["rank"]: Path(r["path"]).parent for r in rows if r["rank"] is not None}
    notes = []
    for rank, folder in sorted(folders.items()):
        file = folder / "notes.jsonl"
        if not file.exists():
            continue
        try:  # the run's file: read within size and depth limits
            lines = read_text_bounded(file).splitlines()
        except (OSError, ValueError) as e:
            notes.append({"rank": int(rank), "reason": f"unreadable: {e}"})
            continue
        for line in lines:
            try:
                notes.append({"rank": int(rank), **loads_bounded(line, str(file))})
            except (ValueError, TypeError):
                notes.append({"rank": int(rank), "reason": f"unreadable line in {file}"})
    return notes


def _captured(d, rank: int, step: int) -> str:
    """How the first step file was dumped: level, mode and writer (and the op capture of a
    file written through the compiled op observer, which records a few ops differently)."""
    from tracer.storage import config_of, op_capture_of

    attrs = d.attrs(rank, step)
    source = str(d.path(rank, step))
    capture = op_capture_of(attrs, source)
    return (f"captured: level {attrs.get('level', '?')}, mode {attrs.get('mode', '?')}, "
            + ("op capture observer, " if capture == "observer" else "")
            + f"writer {config_of(attrs, source).get('writer', '?')}")


def _show(args: argparse.Namespace) -> int:
    import fnmatch
    import re

    import tracer
    from tracer.analysis import TABLE_READ_ERRORS

    d = _open(args.path)
    rank = args.rank if args.rank is not None else (d.ranks[0] if d.ranks else 0)
    step = args.step
    if step is None:
        steps = d.steps(rank)
        unread = [p for p in d.problems if p.rank == rank and p.state != "interrupted"]
        if not steps and unread:
            raise CliError(f"rank {rank} has no step that reads: "
                           + "; ".join(f"{p.path}: {p.reason}" for p in unread))
        if len(steps) != 1:
            raise CliError(f"rank {rank} has {len(steps)} steps ({', '.join(map(str, steps[:12]))}"
                           f"{', ...' if len(steps) > 12 else ''}): choose one with --step")
        step = steps[0]
    try:
        df = d.stats(rank, step)
        hits = d.hits(rank, step)
    except tracer.TracerError as e:
        raise CliError(str(e)) from e
    except TABLE_READ_ERRORS as e:
        raise CliError(f"{d.path(rank, step)} is damaged: its tables do not read "
                       f"({type(e).__name__}: {e}); `sleuth dump ls` shows each file's "
                       f"status") from e
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
        # the user's call site, where any record's source lies in an installed library
        columns = _SHOW_COLUMNS + (["caller"] if (df.caller != "").any() else [])
        print(df[columns].to_string(index=False, float_format=lambda v: f"{v:.6g}"))
    if len(hits):
        print("\nwatchpoint hits:")
        print(hits.to_string(index=False))
    if args.csv:
        print(f"wrote {args.csv}", file=sys.stderr)
    return 0
