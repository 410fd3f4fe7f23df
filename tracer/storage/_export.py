"""Export a dump's statistics as one Parquet dataset, partitioned by rank and step.

HDF5 step files are one file per rank per step: a 1,000-rank run is 1,000 files a step, which
pandas, DuckDB or Spark users cannot query as one table. The export writes the /records table of
every readable step file to `OUT/rank=R/step=S/part-0.parquet` (hive partitioning, which
`pandas.read_parquet(OUT)`, `pyarrow.dataset.dataset(OUT, partitioning="hive")`, DuckDB's
`read_parquet('OUT/**/*.parquet', hive_partitioning=true)` and Spark all read), one file at a
time, so memory holds one step's table whatever the dump's size. Tensor bytes are never read.

Trust: a step that could not be read is never exported as if it were empty. Every step file
that is not fully readable (partial, truncated, unreadable, damaged table, empty rank folder) is
named in the result and in `OUT/_sleuth_export.json` (a name starting with "_" so that dataset
readers skip it); a step cut short (interrupted) is exported with `status` "interrupted".
The dataset is built in a sibling folder and renamed into place when complete, so a crash leaves
no half dataset under OUT, and an existing OUT is replaced only when asked (`overwrite`).
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from tracer._errors import DumpFormatError, TracerError, UntrustedFileError
from tracer.storage._format import RECORD_COLUMNS
from tracer.storage._bounded_json import load_bounded
from tracer.storage._door import inside_run, kind_problem, number_of, numbered, printable
from tracer.storage._dump import Dump, every_step
from tracer.storage._reader import open_dump
from tracer.storage._scan import PROBLEM_STATES
from tracer.storage._step_reader import READ_ERRORS

MANIFEST = "_sleuth_export.json"


@dataclass
class ExportResult:
    """What `export_parquet` wrote and what it could not read."""

    out: str
    files: int = 0
    """Parquet files written: one per exported (rank, step)."""
    records: int = 0
    ranks: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    problems: list[dict[str, Any]] = field(default_factory=list)
    """One dict (path, rank, step, state, reason) per step file left out or cut short."""

    @property
    def complete(self) -> bool:
        """True when every step file found was exported and ended normally."""
        return not self.problems


def _schema():
    import pyarrow as pa

    kinds = {np.int64: pa.int64(), np.int32: pa.int32(), np.float64: pa.float64()}
    cols = [pa.field(name, kinds.get(kind, pa.string())) for name, kind in RECORD_COLUMNS]
    return pa.schema([*cols, pa.field("status", pa.string())])


def export_parquet(run: str | Path, out: str | Path, *, overwrite: bool = False,
                   progress: Callable[[int, int], None] | None = None) -> ExportResult:
    """Write the statistics of every rank and step of the dump at `run` (a run directory, its
    dump/ folder, a rank folder or one step file) to the Parquet dataset `out`.

    Raises TracerError when `out` exists and `overwrite` is False, or when `run` holds no dump.
    `progress(done, total)` is called after each step file.
    """
    out = Path(out)
    dump = open_dump(run)
    try:
        _refuse_over_dump(dump, Path(run), out)
        if out.exists() and not overwrite:
            raise TracerError(f"{out} exists: choose a new folder, or replace it (--force)")
        if out.exists() and not out.is_dir():
            raise TracerError(f"{out} is a file, not a dataset folder: choose another path")
        return _export(dump, out, progress)
    finally:
        dump.close()


def _refuse_over_dump(dump: Dump, run: Path, out: Path) -> None:
    """An OUT that is the run, holds its dump or lies inside it would be replaced (--force)
    or filled with the dataset: either loses or mixes the dump's files. Refused, naming a
    safe place."""
    target = out.resolve()
    folders = {Path(dump.root).resolve()} | {Path(st.path).resolve().parent
                                             for st in dump.file_states}
    held = folders | {run.resolve()}
    for src in held:
        # OUT is a folder of the dump, holds one (replacing it deletes the step files), or
        # lies inside the dump's own folders (the dataset among the step files)
        if target == src or target in src.parents or (src in folders and src in target.parents):
            safe = (run / "export.parquet") if (run / "dump").is_dir() else \
                run.parent / f"{run.name}.parquet"
            raise TracerError(f"--out {out} is a folder of the dump, holds it or lies in it: "
                              f"the dataset would replace or mix with the step files. Write "
                              f"it beside them, e.g. --out {safe}")


def _export(dump: Dump, out: Path, progress: Callable[[int, int], None] | None) -> ExportResult:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = _schema()
    result = ExportResult(out=str(out))
    result.problems = [_problem(s.path, s.rank, s.step, s.state, s.reason)
                       for s in dump.file_states if s.state in PROBLEM_STATES]
    work = out.with_name(f".{out.name}.partial")
    if work.exists():  # left by an export that crashed: nothing in it is anyone's data
        shutil.rmtree(work)
    work.mkdir(parents=True)
    pairs = [(r, s) for r in dump.ranks for s in dump.steps(r)]
    steps: set[int] = set()
    ranks: set[int] = set()
    try:
        for done, (rank, step) in enumerate(pairs, 1):
            try:
                frame = dump.stats(rank, step)
                status = dump.status(rank, step)[0]
            except READ_ERRORS as e:  # a /records table or attribute that does not read
                if not any(p["rank"] == rank and p["step"] == step for p in result.problems):
                    result.problems.append(_problem(str(dump.path(rank, step)), rank, step,
                                                    "damaged", f"{type(e).__name__}: {e}"))
                continue
            frame["status"] = status
            table = pa.Table.from_pandas(frame, schema=schema, preserve_index=False)
            part = work / f"rank={rank}" / f"step={step}"
            part.mkdir(parents=True)
            pq.write_table(table, part / "part-0.parquet")
            result.files += 1
            result.records += table.num_rows
            ranks.add(rank)
            steps.add(step)
            if progress:
                progress(done, len(pairs))
        result.ranks, result.steps = sorted(ranks), sorted(steps)
        manifest = dict(source=str(dump.root), files=result.files, records=result.records,
                        ranks=result.ranks, steps=result.steps, problems=result.problems,
                        skipped=[dict(path=p, reason=r) for p, r in dump.skipped],
                        partitioning=["rank", "step"])
        (work / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        _swap(work, out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return result


def _problem(path: str, rank: int, step: int | None, state: str, reason: str) -> dict[str, Any]:
    return dict(path=path, rank=rank, step=step, state=state, reason=reason)


def _swap(work: Path, out: Path) -> None:
    """Put the finished dataset at `out`; an old dataset there goes only once the new one is in
    place (renames within one folder)."""
    if not out.exists():
        os.replace(work, out)
        return
    old = out.with_name(f".{out.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    os.replace(out, old)
    os.replace(work, out)
    shutil.rmtree(old, ignore_errors=True)


def read_export(path: str | Path):
    """The exported dataset at `path` as one pandas DataFrame with int `rank` and `step`
    columns first, every step read through `ExportedDump` (its names, folders and files
    checked); a TracerError names a folder that is not an export, a DumpFormatError a part
    that does not read."""
    import pandas as pd

    path = Path(path)
    if not (path / MANIFEST).is_file():
        raise TracerError(f"{path} is not a sleuth Parquet export (no {MANIFEST}); write one "
                          f"with `sleuth dump export RUN --format parquet --out {path}`")
    export = ExportedDump(path)
    frames = []
    for rank in export.ranks:
        frame = every_step(export, rank)
        frame.insert(0, "rank", rank)
        frames.append(frame)
    if not frames or not export.manifest.get("files"):
        return pd.DataFrame(columns=["rank", "step", *(n for n, _ in RECORD_COLUMNS), "status"])
    frame = pd.concat(frames, ignore_index=True)
    for col in ("rank", "step"):
        frame[col] = frame[col].astype("int64")
    return frame.sort_values(["rank", "step", "seq"], kind="stable").reset_index(drop=True)


_RANK_PART = numbered(r"rank={n}")
_STEP_PART = numbered(r"step={n}")
"""An export's partition folders: canonical ASCII numbers only, as the door's file names, so
`step=01` or `step=٠` never stands in for a step the export holds."""


def _manifest(root: Path) -> dict[str, Any]:
    """The export's manifest: an object whose `problems` is a list of objects; a TracerError
    naming the export and what is wrong otherwise."""
    def refuse(why: str) -> TracerError:
        return TracerError(f"{printable(root)} is not a sleuth Parquet export ({MANIFEST}: "
                           f"{why}); write one with `sleuth dump export RUN` (it goes to "
                           "RUN/export.parquet)")
    try:
        manifest = load_bounded(root / MANIFEST)
    except (OSError, ValueError) as e:
        raise refuse(str(e)) from e
    if not isinstance(manifest, dict):
        raise refuse("not an object")
    problems = manifest.get("problems") or []
    if not isinstance(problems, list) or not all(isinstance(p, dict) for p in problems):
        raise refuse("its problems are not a list of objects")
    return manifest


def _not_inside(root: Path, folder: Path) -> str | None:
    """Why the partition `folder` is not read (the door's `inside_run`: a soft link out of the
    export, or one that loops; or no folder at all), None for a folder inside `root`: sleuth
    writes no links, and one leading out would show another dataset's rows as this export's."""
    try:
        inside_run(root, folder, folder.name)
    except UntrustedFileError as e:
        return str(e)
    return None if folder.is_dir() else "not a folder: not read"


class ExportedDump:
    """A Parquet export read with the reading side of `Dump` that needs no tensor bytes:
    `ranks`, `steps(rank)`, `stats(rank, step)` (step None: every step of the rank with a
    leading `step` column), `status(rank, step)`, `skipped`. One (rank, step) reads one Parquet
    file, so a dashboard over an export of thousands of ranks opens only what it shows.
    Partition folders are read by strict names and only while they stay inside the export;
    a part that is not a regular file is refused, never opened."""

    def __init__(self, path: str | Path) -> None:
        self.root = Path(path)
        self.manifest = _manifest(self.root)
        self.skipped = [(str(p.get("path", "")), str(p.get("reason", "")))
                        for p in self.manifest.get("problems") or []
                        if p.get("state") != "interrupted"]
        """(path, reason) of each step file the export left out, as its manifest names them,
        and of each partition folder that leads out of the export."""
        self._parts: dict[int, dict[int, Path]] = {}
        for rank_dir in sorted(self.root.glob("rank=*")):
            rank = number_of(_RANK_PART, rank_dir.name)
            for step_dir in sorted(rank_dir.glob("step=*")) if rank is not None else ():
                step = number_of(_STEP_PART, step_dir.name)
                if step is None:
                    continue
                why = _not_inside(self.root, step_dir)
                if why:
                    self.skipped.append((printable(step_dir), why))
                    continue
                self._parts.setdefault(rank, {})[step] = step_dir
        self.ranks = sorted(self._parts)

    def steps(self, rank: int) -> list[int]:
        return sorted(self._parts.get(rank, {}))

    def stats(self, rank: int = 0, step: int | None = None):
        """The records of one step in seq order, as `Dump.stats` gives them (plus `status`)."""
        import pyarrow.parquet as pq

        if step is None:
            return every_step(self, rank)
        part = self._parts.get(rank, {}).get(step)
        if part is None:
            why = next((f": the export left it out ({p['state']}: {p['reason']})"
                        for p in self.manifest.get("problems") or []
                        if p.get("rank") == rank and p.get("step") == step), "")
            raise DumpFormatError(f"no rank {rank} step {step} in the export {self.root}{why} "
                                  f"(ranks: {self.ranks}; steps of rank {rank}: "
                                  f"{self.steps(rank)})")
        import pyarrow as pa

        files = sorted(part.glob("*.parquet"))
        for f in files:
            problem = kind_problem(f)
            if problem:
                raise DumpFormatError(f"{printable(f)}: {problem}")
        try:
            frame = pq.read_table(files, partitioning=None).to_pandas()
        except (OSError, ValueError, TypeError, KeyError, IndexError, NotImplementedError,
                pa.ArrowException) as e:
            raise DumpFormatError(f"{printable(part)}: the Parquet file does not read ({e}); "
                                  "export the dump again") from e
        return frame.sort_values("seq", kind="stable").reset_index(drop=True)

    def status(self, rank: int, step: int) -> tuple[str, str]:
        frame = self.stats(rank, step)
        status = str(frame["status"].iloc[0]) if len(frame) and "status" in frame else "complete"
        return status, ""

    def tensor(self, rank: int, step: int, name: str):
        raise DumpFormatError("a Parquet export holds statistics only, no tensor bytes: open "
                              "the HDF5 dump it was exported from for the tensor")

    def close(self) -> None:
        pass


def is_export(path: str | Path) -> bool:
    """Whether `path` is a folder `export_parquet` wrote (it holds the manifest)."""
    return (Path(path) / MANIFEST).is_file()
