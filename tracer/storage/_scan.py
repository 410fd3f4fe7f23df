"""Scanning a dump's folders: which step files exist, and what state each is in.

Every step file, partial file and empty rank folder under a dump gets a `FileState`: readable
("complete", "interrupted") or not ("partial_only", "truncated", "unreadable", "other_run", ...),
with the reason in words. Only each file's root attributes are read here (rank, step, format
version, status, run id); `Dump` reads the tables. Files of different runs are never combined
(tracer.storage._lock.one_run). No torch.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

import h5py

from sleuth.common import h5_run_id
from tracer._errors import DumpFormatError
from tracer.storage._door import RANK_DIR, STEP_FILE, STEP_PARTIAL
from tracer.storage._h5open import open_h5, path_problem
from tracer.storage._lock import DUMP_JSON, one_run
from tracer.storage._step_reader import NewerFormat, check_version, step_status

_STEP_RE, _PARTIAL_RE, _RANK_RE = STEP_FILE, STEP_PARTIAL, RANK_DIR  # strict names (_door)
_TRUNCATED_RE = re.compile(r"truncated file: eof = (\d+).*stored_eof = (\d+)")
SKIPPED_STATES = ("partial", "partial_only", "truncated", "unreadable", "other_run")
"""FileState.state values of files left out of the readable steps (`Dump.skipped`)."""


class FileState(NamedTuple):
    """What `open_dump` found about one step file (or one rank folder).

    `state` is one of:
    - "complete": read and ended normally;
    - "interrupted": readable, but the step was ended by an exception, a signal or the process
      exiting (root attribute `status` "interrupted", or `complete` 0 in older files); its
      records are the ones made so far, and `reason` says why it ended;
    - "partial_only": only a `*.partial` file exists for the step (being written, or left by
      a crash before it was complete): nothing of the step can be read;
    - "partial": a `*.partial` file left beside the complete file of the same step (ignored);
    - "truncated": the file is shorter than its HDF5 superblock says (a copy cut short, a
      disk that filled);
    - "unreadable": the file does not open as a dump file (damaged, or not written by sleuth);
    - "empty": a rank folder with no step file at all (`step` is None);
    - "other_run": a readable file written by another run than the dump's (its `run_id`), left
      out so that two runs' files are never combined (`open_dump`).
    """

    path: str
    rank: int
    step: int | None
    state: str
    reason: str = ""
    run_id: str = ""
    """The run that wrote the file ("" before run ids, or when it could not be read)."""


PROBLEM_STATES = ("interrupted", "partial_only", "truncated", "unreadable", "empty",
                  "other_run")
"""FileState.state values that mean a step was not fully read ("partial" is a stale leftover
beside a complete file, worth a note only; "other_run" a file of another run where this run's
step would be, which is not this run's step)."""

UNREAD_STATES = ("partial_only", "truncated", "unreadable", "other_run", "empty")
"""FileState.state values whose data could not be read. Not among them: "partial", a leftover
beside the step's complete file, which is read instead; "interrupted", which is read and named
apart."""


class DumpScan(NamedTuple):
    """What `scan_dump` found: the readable step files by (rank, step), one FileState per
    file or empty rank folder, and the folder (or file) the dump was read from."""

    files: dict[tuple[int, int], Path]
    states: list[FileState]
    root: Path


def scan_dump(path: str | Path) -> DumpScan:
    """Find and classify the step files of a dump: a run directory, its dump/ folder, one rank
    folder, or one step file (see `open_dump`). Raises DumpFormatError when there is no dump at
    `path`, a single step file given as `path` cannot be read, or a file has a newer major
    format version than this release reads."""
    p = Path(path)
    if not p.exists():
        problem = path_problem(p)
        raise DumpFormatError(f"{p}: {problem}" if problem else
                              f"no dump at {p}: the path does not exist")
    files: dict[tuple[int, int], Path] = {}
    states: list[FileState] = []
    if p.is_file():
        if p.name.endswith(".partial"):
            raise DumpFormatError(f"{p} is a partial file (being written, or left by a crash); "
                                  f"open the complete step{{S}}.h5 files instead")
        try:
            rank, step, state = _identify(p)
        except _Unreadable as e:
            raise DumpFormatError(f"cannot read dump file {p}: {e}") from e
        files[(rank, step)] = p
        states.append(state)
        root = p
    else:
        if (p / "dump").is_dir():
            p = p / "dump"
        rank_dirs = [(int(m.group(1)), d) for d in p.iterdir()
                     if d.is_dir() and (m := _RANK_RE.fullmatch(d.name))]
        if not rank_dirs and any(_STEP_RE.fullmatch(c.name) or _PARTIAL_RE.fullmatch(c.name)
                                 for c in p.iterdir()):
            m = _RANK_RE.fullmatch(p.name)
            rank_dirs = [(int(m.group(1)) if m else -1, p)]
        if not rank_dirs:
            raise DumpFormatError(f"no dump at {path}: expected RUN/dump/rank{{R}}/step{{S}}.h5 "
                                  f"(give a run directory, its dump/ folder, a rank folder or a "
                                  f"step file)")
        root = p
        for rank, d in sorted(rank_dirs):
            _scan_rank(rank, d, files, states)
        files, states = _one_run(files, states, dump_folder(p))
    return DumpScan(files, states, root)

def _one_run(files: dict[tuple[int, int], Path], states: list[FileState],
             dump_dir: Path | None) -> tuple[dict[tuple[int, int], Path], list[FileState]]:
    """The files of one run only (`tracer.storage._lock.one_run`); the others' states become
    "other_run" with the reason."""
    by_path = {s.path: s for s in states}
    run_ids = {key: by_path[str(path)].run_id for key, path in files.items()}
    kept, others = one_run(files, run_ids, dump_dir)
    if not others:
        return files, states
    reasons = dict(others)
    return kept, [s._replace(state="other_run", reason=reasons[s.path]) if s.path in reasons
                  else s for s in states]


_PARTIAL_REASON = "partial file: being written, or left by a crash before it was complete"


def _scan_rank(rank: int, d: Path, files: dict[tuple[int, int], Path],
               states: list[FileState]) -> None:
    """Classify the files of one rank folder (rank -1: a folder of step files whose rank is
    read from each file) into `files` (readable steps) and `states`."""
    partials: list[tuple[Path, int | None]] = []
    found = False
    for child in sorted(d.iterdir()):
        m = _STEP_RE.fullmatch(child.name)
        pm = _PARTIAL_RE.fullmatch(child.name)
        if pm:
            partials.append((child, int(pm.group(1))))
            found = True
        elif m:
            found = True
            try:
                if rank < 0:
                    r, s, state = _identify(child)
                else:
                    r, s = rank, int(m.group(1))
                    state = _probe(child, r, s)
            except _Unreadable as e:
                states.append(FileState(str(child), rank, int(m.group(1)), e.state, str(e)))
                continue
            files[(r, s)] = child
            states.append(state)
    used: set[int | None] = {s for _, s in files} if rank < 0 else \
        {s for r, s in files if r == rank}
    for child, step in partials:
        if step in used:  # a leftover beside the step's complete file, or a second partial
            states.append(FileState(str(child), rank, step, "partial", _PARTIAL_REASON
                                    + "; the step's complete file (or first partial) is used"))
            continue
        used.add(step)
        states.append(FileState(str(child), rank, step, "partial_only", _PARTIAL_REASON))
    if not found:
        states.append(FileState(str(d), rank, None, "empty",
                                "empty rank folder: no step file (the run dumped nothing here, "
                                "or its files were removed)"))


class _Unreadable(Exception):
    def __init__(self, message: str, state: str = "unreadable") -> None:
        super().__init__(message)
        self.state = state


def _open_error(path: Path, e: OSError) -> _Unreadable:
    """An h5py open error in words: "truncated" when the file is shorter than HDF5 expects;
    a soft link that loops or leads nowhere named as such, not by HDF5's text."""
    problem = path_problem(path)
    if problem:
        return _Unreadable(f"unreadable: {problem}")
    m = _TRUNCATED_RE.search(str(e))
    if m:
        return _Unreadable(f"truncated: the file has {m.group(1)} bytes but its HDF5 superblock "
                           f"says {m.group(2)} (a copy cut short, a disk that filled, or a "
                           f"writer killed mid-write); dump that step again", "truncated")
    return _Unreadable(f"unreadable: {e}; the file is damaged or not an HDF5 dump file")


def _state_of(f: h5py.File, path: Path, rank: int, step: int) -> FileState:
    """"complete" or "interrupted" (with its reason: `step_status`, the one rule) from a step
    file's root attributes."""
    status, reason = step_status(f.attrs)
    run_id = h5_run_id(f.attrs)
    if status == "interrupted":
        return FileState(str(path), rank, step, "interrupted",
                         f"interrupted: {reason or 'no reason recorded'}", run_id)
    return FileState(str(path), rank, step, "complete", run_id=run_id)


def _open(path: Path) -> h5py.File:
    """A step file opened by the one checked opener (`open_h5`: no link out of the file, no
    claim past its size; a FIFO is refused before the open would block forever)."""
    problem = path_problem(path)
    if problem:
        raise _Unreadable(f"unreadable: {problem}")
    return open_h5(path)


def _probe(path: Path, rank: int, step: int) -> FileState:
    """Check that `path` opens and has a version this release reads; its FileState."""
    try:
        with _open(path) as f:
            check_version(f, path)
            return _state_of(f, path, rank, step)
    except OSError as e:
        raise _open_error(path, e) from e
    except NewerFormat:
        raise
    except (DumpFormatError, RuntimeError, ValueError, TypeError, KeyError) as e:
        # damaged metadata: attributes that do not decode, a missing format_version
        raise _Unreadable(f"unreadable: {e}; the file is damaged or not a sleuth dump file") \
            from e


def dump_folder(p: Path) -> Path | None:
    """The dump folder (holding rank{R}/ and dump.json) of a dump or rank folder; None for a
    folder of step files that is neither."""
    if (p / DUMP_JSON).is_file() or any(_RANK_RE.fullmatch(c.name) for c in p.iterdir()):
        return p
    return p.parent if _RANK_RE.fullmatch(p.name) else None


def _identify(path: Path) -> tuple[int, int, FileState]:
    """(rank, step, FileState) of one step file, from its attributes."""
    try:
        with _open(path) as f:
            check_version(f, path)
            rank, step = int(f.attrs["rank"]), int(f.attrs["step"])
            return rank, step, _state_of(f, path, rank, step)
    except OSError as e:
        raise _open_error(path, e) from e
    except KeyError as e:
        raise _Unreadable(f"unreadable: it lacks the rank/step attributes of a dump file "
                          f"({e})") from e
    except NewerFormat:
        raise
    except (DumpFormatError, RuntimeError, ValueError, TypeError) as e:
        raise _Unreadable(f"unreadable: {e}; the file is damaged or not a sleuth dump file") \
            from e