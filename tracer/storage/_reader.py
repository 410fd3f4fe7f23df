"""Read dumps back: `open_dump(path) -> Dump`, statistics as DataFrames, tensors lazily.

The one reader of the step-file format, in four parts: the folders scanned and every file
classified (`_scan`), one step file's metadata and tables read and checked (`_step_reader`),
stored bytes decoded (`_decode`), and the `Dump` object over them (`_dump`); the listing behind
`sleuth dump ls` (`_listing`) and the diff's chunked tensor reader (`_tensor_reader`) read
through the same parts. No torch at module level: `sleuth diff` and the dashboard read dumps
without it. Dtypes numpy lacks (bfloat16, float8) are stored as raw bits and decoded from the
`dtype` column (docs/dump-format.md).
"""
from __future__ import annotations

from pathlib import Path

from sleuth.common import warn
from tracer.storage._dump import Dump
from tracer.storage._scan import SKIPPED_STATES, scan_dump


def open_dump(path: str | Path) -> Dump:
    """Open a dump: a run directory, its dump/ folder, one rank folder, or one step file.

    Every step file is classified (`Dump.file_states`, see FileState): partial files
    (`*.partial`, being written or left by a crash), truncated and unreadable files are left
    out of the readable steps and listed in `Dump.skipped` with a warning; interrupted steps
    stay readable and are listed in `Dump.problems` with the reason. Files of different runs are
    never combined: the files of the run `dump/dump.json` names (without it, of the run that
    wrote the newest file) are kept, the others are "other_run" and skipped (docs/dump-format.md,
    "Run id"). Raises DumpFormatError when
    there is no dump at `path`, a single step file given as `path` cannot be read, or a file
    has a newer major format version than this release reads.
    """
    files, states, root = scan_dump(path)
    skipped = [(s.path, s.reason) for s in states if s.state in SKIPPED_STATES]
    if skipped:
        warn(f"skipped {len(skipped)} partial, unreadable or other-run file(s) under {root}, "
             f"e.g. {skipped[0][0]} ({skipped[0][1]})", stacklevel=2)
    return Dump(files, skipped, root, states)
