"""`sleuth dump export`: every rank's and step's statistics as one Parquet dataset."""
from __future__ import annotations

import argparse
import sys
import warnings
from typing import Any

from sleuth.cli import CliError


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "export", help="write the statistics of every rank and step as a Parquet dataset",
        description="Write the /records statistics of every rank and step of RUN's dump as one "
        "Parquet dataset partitioned by rank and step (OUT/rank=R/step=S/part-0.parquet), for "
        "pandas, DuckDB or Spark. Tensor bytes are not exported. Step files that cannot be "
        "read are named and listed in OUT/_sleuth_export.json. Exit code 0 when every step "
        "file was exported complete, 1 when one was left out or cut short, 2 on error or when "
        "no step file could be exported.")
    p.add_argument("path", metavar="RUN",
                   help="a run directory, its dump/ folder, a rank folder or one step file")
    p.add_argument("--format", choices=["parquet"], default="parquet",
                   help="output format (default: parquet)")
    p.add_argument("--out", metavar="OUT", help="dataset folder to write (default: "
                   "RUN/export.parquet for a run directory)")
    p.add_argument("--force", action="store_true", help="replace OUT when it exists")
    p.set_defaults(run=_export)


def _export(args: argparse.Namespace) -> int:
    from pathlib import Path

    import tracer
    from tracer.storage import export_parquet

    run = Path(args.path)
    if args.out:
        out = Path(args.out)
    elif run.is_dir() and (run / "dump").is_dir():
        out = run / "export.parquet"
    else:
        raise CliError(f"{run} is not a run directory: name the dataset folder with --out OUT")
    show = sys.stderr.isatty()

    def progress(done: int, total: int) -> None:
        if show:
            print(f"\rexport: {done}/{total} step file(s)", end="", file=sys.stderr,
                  flush=True)

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the files it skips are reported below
            result = export_parquet(run, out, overwrite=args.force, progress=progress)
    except tracer.TracerError as e:
        raise CliError(str(e)) from e
    if show:
        print(file=sys.stderr)
    print(f"wrote {out}: {result.records} record(s) from {result.files} step file(s), "
          f"{len(result.ranks)} rank(s), steps {_span(result.steps)}")
    for p in result.problems:
        where = f"rank {p['rank']} step {p['step']}" if p["step"] is not None else \
            f"rank {p['rank']}"
        verb = "exported, cut short" if p["state"] == "interrupted" else "not exported"
        print(f"{where} {verb} ({p['state']}): {p['path']}: {p['reason'] or 'no reason recorded'}",
              file=sys.stderr)
    if result.problems:
        print(f"{len(result.problems)} step file(s) not complete: see {out}/_sleuth_export.json",
              file=sys.stderr)
    if not result.files:
        print("sleuth dump: nothing was exported: no step file could be read", file=sys.stderr)
        return 2
    return 1 if result.problems else 0


def _span(steps: list[int]) -> str:
    if not steps:
        return "none"
    return f"{steps[0]}-{steps[-1]}" if len(steps) > 1 else str(steps[0])
