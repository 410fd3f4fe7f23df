"""One writer per rank and one run per dump: the rank lock, the run id and the run file.

A writer holds `RUN/dump/rank{R}/.lock` (JSON: pid, host, process start time, run id, when it
was taken) from its first step to `close()`. The file is created with O_EXCL, so of two
writers of one rank exactly one gets it; the other is refused with the owner's name. A lock
whose owner is gone (same host, no process with that pid and start time) is stale and taken
over with a warning; a lock of another host cannot be checked from here and is never taken.

Every step file carries the run id of the run that wrote it (root attribute `run_id`) and
`RUN/dump/dump.json` names the run the dump belongs to. All ranks of one run find the same id
without talking to each other, by the rule every tool shares (`sleuth.common.resolve_run_id`).
A writer whose rank folder or run file belongs to another run is refused unless the config
says `"overwrite": true`; then, holding the lock, it removes the other run's step files of its
rank (never anything else) before it writes.
Readers keep the files of one run only (`one_run`).

This module must not import torch: the reader uses it.
"""
from __future__ import annotations

import atexit
import datetime as _dt
import fcntl
import json
import os
import socket
import uuid
from pathlib import Path

from sleuth.common import (RUN_ID_ENV, h5_run_id, process_alive, process_start_time,
                           resolve_run_id, warn)
from tracer._errors import (DumpFormatError, DumpWriteError, OtherRunError, TracerError,
                            UntrustedFileError)
from tracer.storage._door import STEP_FILE, numbered, open_regular

LOCK_NAME = ".lock"
DUMP_JSON = "dump.json"
DUMP_JSON_VERSION = "1.0"
OVERWRITE_ENV = "SLEUTH_DUMP_OVERWRITE"
# what a step file of another run leaves besides itself: a crash's partials, the flight recorder
_DUMP_LEFTOVER = numbered(r"step{n}\.h5(?:\.data)?\.partial|flight_recorder\.h5(?:\.partial)?")


class DumpLockedError(TracerError):
    """Another live writer holds this rank's lock."""


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def file_run_id(path: Path) -> str:
    """The run id of a step file, "" for one that carries none; opened by the one checked
    opener (`open_h5`: no link out of the file, no claim past its size)."""
    from tracer.storage._h5open import open_h5

    with open_h5(path) as f:
        return h5_run_id(f.attrs)


def read_run_file(dump_dir: Path) -> str | None:
    """The run id `dump_dir/dump.json` names, or None when there is none that reads."""
    from tracer.storage._bounded_json import load_bounded

    try:  # bounded: a run's file, read by every tool that opens the dump
        data = load_bounded(dump_dir / DUMP_JSON)
    except (OSError, ValueError):
        return None
    run_id = data.get("run_id") if isinstance(data, dict) else None
    return run_id if isinstance(run_id, str) and run_id else None


def _write_run_file(dump_dir: Path, run_id: str, world_size: int) -> None:
    """Write dump.json atomically (temporary file, fsync, rename)."""
    body = json.dumps({"format_version": DUMP_JSON_VERSION, "run_id": run_id,
                       "world_size": int(world_size), "created": _now()}, indent=2) + "\n"
    temp = dump_dir / f"{DUMP_JSON}.{os.getpid()}.partial"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, body.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temp, dump_dir / DUMP_JSON)


class RankLock:
    """`RUN/dump/rank{R}/.lock`, held by this process (see the module docstring)."""

    def __init__(self, path: Path, content: dict) -> None:
        self.path = path
        self.content = content
        self._pid = os.getpid()
        _held.add(self)

    @classmethod
    def acquire(cls, rank_dir: Path, run_id: str) -> RankLock:
        """Take the lock of `rank_dir`, taking over a stale one; DumpLockedError when another
        live writer (or a writer of another host) holds it."""
        path = rank_dir / LOCK_NAME
        content = {"pid": os.getpid(), "host": socket.gethostname(),
                   "started": process_start_time(os.getpid()), "run_id": run_id, "since": _now()}
        body = (json.dumps(content, indent=2) + "\n").encode()
        for _ in range(3):
            try:
                _create_exclusive(path, body)
            except FileExistsError:
                _take_over_if_stale(rank_dir, path)
                continue
            return cls(path, content)
        raise DumpLockedError(f"{path}: could not take the lock (it kept changing hands); "
                              f"is another writer starting on rank folder {rank_dir}?")

    def release(self) -> None:
        """Remove the lock file if this process took it and it is still ours. Idempotent;
        a no-op in a forked child (the parent still writes)."""
        if self._pid != os.getpid() or self.path is None:
            return
        path, self.path = self.path, None
        _held.discard(self)
        try:
            if _read_lock(path) == self.content:
                path.unlink()
        except OSError:
            pass


class _NoLock:
    """Stands for the lock where the rank folder cannot be created."""

    def release(self) -> None:
        pass


_NO_LOCK = _NoLock()
_held: set[RankLock] = set()  # held until released, even by a writer nobody closed


def _create_exclusive(path: Path, body: bytes) -> None:
    """Create `path` holding `body`, or raise FileExistsError: written under a temporary name
    and hard-linked into place, so nobody ever reads a lock without its owner in it (O_EXCL
    where the filesystem has no hard links)."""
    temp = path.with_name(f"{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.partial")
    _write_new(temp, body)
    try:
        os.link(temp, path)
    except FileExistsError:
        raise
    except OSError:  # no hard links here
        _write_new(path, body)
    finally:
        temp.unlink()


def _write_new(path: Path, body: bytes) -> None:
    """Create `path` (FileExistsError if it exists) holding `body`."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, body)
    finally:
        os.close(fd)


@atexit.register
def _release_at_exit() -> None:
    # a writer never closed (the script forgot close(), or died of an exception) still leaves
    # no lock behind; a killed process does, and the next writer finds it stale
    for lock in list(_held):
        lock.release()


def _read_lock(path: Path) -> dict | None:
    try:
        with open_regular(path) as f:  # a FIFO as the lock would stop the writer at its start
            data = json.loads(f.read(1 << 20).decode("utf-8"))
    except (FileNotFoundError, NotADirectoryError):  # no lock (a file where a folder goes is
        return None                                  # the writer's error to report)
    except (OSError, ValueError, UntrustedFileError):
        return {}
    return data if isinstance(data, dict) else {}


def _describe(owner: dict) -> str:
    return (f"pid {owner.get('pid', '?')} on host {owner.get('host', '?')}, run "
            f"{owner.get('run_id', '?')}, since {owner.get('since', '?')}")


def _refuse_live_owner(rank_dir: Path, path: Path, owner: dict) -> None:
    """Raise DumpLockedError unless the lock `owner` (read from `path`) is stale: its writer, of
    this host, is gone."""
    pid, host = owner.get("pid"), owner.get("host")
    fix = ("wait for it to finish, or write this run elsewhere (a new run directory: the "
           "dump config's \"path\" or --run-dir)")
    if not isinstance(pid, int) or not isinstance(host, str):
        raise DumpLockedError(f"{path} is not a lock this sleuth reads; if no other process "
                              f"writes rank folder {rank_dir}, delete it and run again")
    if host != socket.gethostname():
        raise DumpLockedError(f"{rank_dir} is being written by another process "
                              f"({_describe(owner)}); {fix}. It runs on another host, so "
                              f"sleuth cannot tell whether it is still alive: if it is not, "
                              f"delete {path} and run again")
    if process_alive(pid, owner.get("started")):
        raise DumpLockedError(f"{rank_dir} is being written by another process "
                              f"({_describe(owner)}); {fix}")


def _take_over_if_stale(rank_dir: Path, path: Path) -> None:
    """Remove `path` when its owner is gone; raise DumpLockedError when it may be alive.

    Under an flock of the rank folder, re-reading the lock first: two writers that both found
    it stale would otherwise each remove it, the second one the first one's fresh lock."""
    dir_fd = os.open(rank_dir, os.O_RDONLY)
    try:
        fcntl.flock(dir_fd, fcntl.LOCK_EX)
        owner = _read_lock(path)
        if owner is None:  # released meanwhile: try again
            return
        _refuse_live_owner(rank_dir, path, owner)
        path.unlink()
        warn(f"took over the stale lock {path} of a writer that is gone "
             f"({_describe(owner)}); its complete step files are kept", stacklevel=4)
    finally:
        os.close(dir_fd)


def claim_rank(run_dir: Path, rank: int, world_size: int, *, overwrite: bool = False
               ) -> tuple[str, RankLock | _NoLock]:
    """Take rank `rank`'s lock under `run_dir` and make sure its dump is this run's.

    Returns (run id, lock). Raises DumpLockedError when another writer holds the rank, and
    OtherRunError when the dump there belongs to another run and `overwrite` is off (also
    when $SLEUTH_DUMP_OVERWRITE is off); with it on, that run's step files of this rank are
    removed once the lock is held."""
    overwrite = overwrite or os.environ.get(OVERWRITE_ENV, "").strip().lower() in (
        "1", "true", "yes", "on")
    dump_dir = Path(run_dir) / "dump"
    rank_dir = dump_dir / f"rank{rank}"
    run_id = resolve_run_id(world_size)
    # refused before anything is made in another writer's or another run's folder (a rank
    # folder, a lock); taking the lock and `_claim` check again, race-free
    owner = _read_lock(rank_dir / LOCK_NAME)
    if owner is not None:
        _refuse_live_owner(rank_dir, rank_dir / LOCK_NAME, owner)
    named = read_run_file(dump_dir)
    if named is not None and named != run_id and not overwrite:
        raise OtherRunError(_other_run(dump_dir, f"{dump_dir / DUMP_JSON} names run {named}",
                                       run_id))
    try:
        rank_dir.mkdir(parents=True, exist_ok=True)
    except OSError:
        # no rank folder can be made there (a file in the way, no permission): nothing can be
        # written either, and the first step file reports that through on_error
        return run_id, _NO_LOCK
    try:
        lock = RankLock.acquire(rank_dir, run_id)
    except OSError as e:
        raise DumpWriteError(f"cannot take the lock {rank_dir / LOCK_NAME}: {e.strerror or e}; "
                             f"check that the run directory is writable") from e
    try:
        _claim(dump_dir, rank_dir, run_id, world_size, overwrite)
    except BaseException:
        lock.release()
        raise
    return run_id, lock


def _claim(dump_dir: Path, rank_dir: Path, run_id: str, world_size: int,
           overwrite: bool) -> None:
    steps = [p for p in rank_dir.iterdir() if STEP_FILE.fullmatch(p.name)]
    named = read_run_file(dump_dir)
    other = None
    if named is not None and named != run_id:
        other = f"{dump_dir / DUMP_JSON} names run {named}"
    elif steps:
        newest = max(steps, key=_mtime)
        try:
            found = file_run_id(newest)
        except (OSError, DumpFormatError, UntrustedFileError):
            found = "(unreadable)"
        if found != run_id:
            other = (f"{rank_dir} holds {len(steps)} step file(s) of run "
                     f"{found or '(written before run ids)'}")
    if other is not None:
        if not overwrite:
            raise OtherRunError(_other_run(dump_dir, other, run_id))
        _remove_other_run(rank_dir, steps, run_id)
    if named != run_id:
        _write_run_file(dump_dir, run_id, world_size)


def _other_run(dump_dir: Path, other: str, run_id: str) -> str:
    """OtherRunError's message: whose dump is there, and the ways out."""
    return (f"{dump_dir} holds the dump of another run ({other}; this run is {run_id}). "
            f"Dump into a new run directory (the dump config's \"path\", or --run-dir), or "
            f"replace the old dump: \"overwrite\": true in the dump config, or --overwrite "
            f"on sleuth train / sleuth run. A run that continues (resume) gives every "
            f"process the same {RUN_ID_ENV}.")


def _mtime(p: Path) -> float:
    try:
        return p.stat().st_mtime
    except OSError:
        return 0.0


def _remove_other_run(rank_dir: Path, steps: list[Path], run_id: str) -> None:
    """Remove this rank's step files of other runs and what they left (partials, the flight
    recorder); step files of this run and every other file stay."""
    removed = 0
    for p in steps:
        try:
            if file_run_id(p) == run_id:
                continue
        except (OSError, DumpFormatError, UntrustedFileError):
            pass  # unreadable: not this run's
        _unlink(p)
        removed += 1
    for p in rank_dir.iterdir():
        if _DUMP_LEFTOVER.fullmatch(p.name):
            _unlink(p)
    if removed:
        warn(f"overwrite: removed {removed} step file(s) of another run from {rank_dir}",
             stacklevel=4)


def _unlink(p: Path) -> None:
    try:
        p.unlink()
    except FileNotFoundError:
        pass
    except OSError as e:
        raise TracerError(f"overwrite: cannot remove {p} of the old dump: {e.strerror or e}; "
                          f"remove it by hand or dump into a new run directory") from e


def one_run(files: dict, run_ids: dict, dump_dir: Path | None
            ) -> tuple[dict, list[tuple[str, str]]]:
    """Keep the files of one run: the one `dump_dir/dump.json` names, else the run of the
    most recently written file. Returns (kept files, [(path, reason)] of the others).
    `files` and `run_ids` map the same keys to paths and run ids ("" before run ids)."""
    ids = set(run_ids.values())
    named = read_run_file(dump_dir) if dump_dir is not None else None
    if named is not None:
        where = f"the run {dump_dir / DUMP_JSON} names"  # type: ignore[operator]
    elif len(ids) > 1:
        named = run_ids[max(files, key=lambda k: _mtime(files[k]))]
        where = "the run of the most recently written file"
    if named is None or ids <= {named}:
        return files, []
    kept, skipped = {}, []
    for key, path in files.items():
        rid = run_ids.get(key, "")
        if rid == named:
            kept[key] = path
        else:
            skipped.append((str(path), f"written by another run ({rid or 'before run ids'}); "
                                       f"this dump is run {named}, {where}"))
    return kept, skipped
