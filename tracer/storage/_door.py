"""The tools' face of the one door to a run's files (sleuth.common's door, where the rules are
written once: strict names, paths kept inside the run, regular files only, bounded reads, whole
outputs, names printed escaped). The same functions, with a refusal raised as
tracer.UntrustedFileError, the error the tools' readers, the CLI and the dashboard know."""
from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO

from sleuth.common import _door
from sleuth.common._door import (RANK_DIR, STEP_FILE, STEP_PARTIAL, atomic_file, kind_problem,
                                 number_of, numbered, printable)
from tracer._errors import UntrustedFileError

__all__ = ["RANK_DIR", "STEP_FILE", "STEP_PARTIAL", "atomic_file", "inside_run", "kind_problem",
           "number_of", "numbered", "open_regular", "printable", "read_bounded"]


def open_regular(path: str | os.PathLike) -> BinaryIO:
    """sleuth.common's `open_regular`: the regular file at `path`, open for binary reading."""
    try:
        return _door.open_regular(path)
    except _door.UntrustedFileError as e:
        raise UntrustedFileError(str(e)) from e


def read_bounded(path: str | os.PathLike, max_bytes: int) -> bytes:
    """sleuth.common's `read_bounded`: a regular file's bytes, at most `max_bytes` of them."""
    try:
        return _door.read_bounded(path, max_bytes)
    except _door.UntrustedFileError as e:
        raise UntrustedFileError(str(e)) from e


def inside_run(run_dir: str | os.PathLike, source: str | os.PathLike, name: object) -> Path:
    """sleuth.common's `inside_run`: the path `name` (read from `source`) names, inside the run."""
    try:
        return _door.inside_run(run_dir, source, name)
    except _door.UntrustedFileError as e:
        raise UntrustedFileError(str(e)) from e
