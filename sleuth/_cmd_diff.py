"""`sleuth diff A B`: compare two dumps record by record and name the first divergent record.

Exit codes: 0 every selected step of both dumps was read completely and agrees within
tolerance; 1 they diverge, or a step is on one side only; 2 something could not be read (a
truncated, unreadable, partial-only or interrupted step, damaged bytes) or an error (bad path,
missing rank/step, dumps that share no record).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

from sleuth._diff_report import explain_command, format_rank_report, format_report
from sleuth.cli import CliError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "diff", help="compare two dumps and name the first divergent record",
        description="Compare dump A with dump B (run directories, dump directories or step "
        "files): per record cosine similarity, max absolute/relative error, RMSE, share within "
        "tolerance, NaN/Inf differences (or statistics when a side has no tensor bytes), and "
        "the first divergent record in execution order. Exit code 0 same (every selected step read "
        "completely), 1 diverged or a step on one side only, 2 something could not be read "
        "(missing, truncated, damaged, partial-only or interrupted step files are named) or "
        "error.",
    )
    p.add_argument("a", metavar="A", help="run directory, dump directory or step file")
    p.add_argument("b", metavar="B", help="the run to compare with")
    p.add_argument("--step", type=int, help="step of A (default: every step either dump holds; a step on one side only is a problem)")
    p.add_argument("--rank", type=int, help="rank of A (default: every rank, each with the same "
                   "rank of B, and the earliest divergence across ranks)")
    p.add_argument("--b-step", type=int, help="step of B when it differs from --step")
    p.add_argument("--b-rank", type=int, help="rank of B when it differs from --rank")
    p.add_argument("--rtol", type=float, help="relative tolerance (default: per dtype)")
    p.add_argument("--atol", type=float, help="absolute tolerance (default: per dtype)")
    p.add_argument("--cosine-min", type=float, help="smallest cosine that counts as the same")
    p.add_argument("--allow-missing", action="store_true",
                   help="compare only the steps both dumps hold complete and readable; the "
                   "steps left out are listed, and do not change the exit code")
    p.add_argument("--top", type=int, default=10, help="worst records to list (default 10)")
    p.add_argument("--csv", metavar="FILE", help="write every record's row to FILE")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--workers", type=int, help="local processes for the ranks (default: one "
                   "per core; 1: in this process)")
    p.add_argument("--scheduler", metavar="ADDRESS", help="run the ranks on this Dask "
                   "scheduler (tcp://host:8786; default: $SLEUTH_DASK_SCHEDULER, else local "
                   "processes); workers must see the dumps at the same paths")
    p.add_argument("--progress", action="store_true",
                   help="show progress on stderr (default: only when stderr is a terminal)")
    p.add_argument("--map", metavar="FILE",
                   help="a module map (`sleuth map A B > FILE`): B's modules are read as the A "
                        "modules it pairs them with, to compare two codebases")
    p.set_defaults(run=_run)


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


class _RowSinks:
    """Where a streamed diff's rows go, step by step, so that memory holds one step's rows
    whatever the dump's size: the --csv file, and for --json a temporary file spliced into the
    JSON object at the end (the answer's status is known only then)."""

    def __init__(self, csv_path: str | None, json_rows: bool) -> None:
        self.csv_path, self.json_rows = csv_path, json_rows
        self.csv = self.tmp = None
        self.csv_file: Any = None  # tracer.storage.atomic_file: the rows appear whole or not
        self.header = True
        self.first = True

    def __enter__(self) -> "_RowSinks":
        if self.csv_path:
            # beside the target, renamed over it once the diff ends: a diff that fails leaves
            # a file the user had there as it was
            folder = os.path.dirname(os.path.abspath(self.csv_path))
            if not os.path.isdir(folder):
                raise CliError(f"cannot write {self.csv_path}: the folder {folder} does not "
                               "exist")
            from tracer.storage import atomic_file

            try:
                self.csv_file = atomic_file(self.csv_path, "w", newline="")
                self.csv = self.csv_file.__enter__()
            except OSError as e:
                raise CliError(f"cannot write {self.csv_path}: {e}") from e
        if self.json_rows:
            self.tmp = tempfile.TemporaryFile("w+")
        return self

    def add(self, rows: list[dict]) -> None:
        from tracer import DiffResult

        if self.csv is not None:
            try:
                DiffResult.frame(rows).to_csv(self.csv, index=False, header=self.header)
            except OSError as e:
                raise CliError(f"cannot write {self.csv_path}: {e}") from e
            self.header = False
        if self.tmp is not None:
            for r in DiffResult.json_rows(rows):
                self.tmp.write(("" if self.first else ", ") + json.dumps(r, allow_nan=False))
                self.first = False

    def print_json(self, head: dict) -> None:
        """`head` with "records": every row written so far."""
        text = json.dumps(head, allow_nan=False)
        sys.stdout.write(text[:-1] + (', "records": [' if head else '"records": ['))
        self.tmp.seek(0)
        while chunk := self.tmp.read(1 << 20):
            sys.stdout.write(chunk)
        sys.stdout.write("]}\n")
        sys.stdout.flush()

    def __exit__(self, kind: Any, *exc: Any) -> None:
        if self.csv is not None:
            try:
                if self.header and kind is None:  # no step compared: the header alone
                    from tracer import DiffResult

                    DiffResult.frame([]).to_csv(self.csv, index=False)
            except BaseException as e:
                self.csv_file.__exit__(type(e), e, e.__traceback__)  # removes the partial
                raise CliError(f"cannot write {self.csv_path}: {e}") from e
            try:  # renamed into place, or (after an error, or a full disk now) removed
                self.csv_file.__exit__(kind, *exc)
            except OSError as e:
                raise CliError(f"cannot write {self.csv_path}: {e}") from e
            if kind is None:
                print(f"sleuth diff: the records' rows written to {self.csv_path}",
                      file=sys.stderr)
        if self.tmp is not None:
            self.tmp.close()


def _run(args: argparse.Namespace) -> int:
    import tracer
    from tracer import TracerError

    if args.workers is not None and args.workers < 1:
        raise CliError(f"--workers {args.workers}: give 1 or more")
    try:
        tol = tracer.Tolerance(rtol=args.rtol, atol=args.atol, cosine_min=args.cosine_min)
        module_map = None
        if args.map:
            from tracer.analysis import read_module_map

            module_map = read_module_map(args.map)
            if args.rank is None:
                args.rank = 0  # a map pairs one rank's modules: the other ranks have the same
        if wants_ranks(args):
            if args.csv:
                raise CliError("--csv writes one rank pair's records: choose it with --rank R")
            return run_ranks(args, tol)
        progress = args.progress or sys.stderr.isatty()
        with _RowSinks(args.csv, args.json) as sinks:
            result = tracer.diff(args.a, args.b, step=args.step, rank=args.rank,
                                 b_step=args.b_step, b_rank=args.b_rank, tolerance=tol,
                                 progress=progress, allow_missing=args.allow_missing,
                                 module_map=module_map, keep_records=False,
                                 keep_worst=max(args.top, 1), on_rows=sinks.add)
            if args.json:
                sinks.print_json(result.to_dict(records=False))
    except TracerError as e:
        raise CliError(str(e)) from e
    if not args.json:
        print(format_report(result, args.top,
                            explain_command(args.a, args.b, args.step, args.rank,
                                            args.map, args.b_step, args.b_rank)))
    return result.exit_code
