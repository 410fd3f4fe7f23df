"""One run per run directory: which runs a directory's files belong to, refusing another run's
directory, and replacing an old run's files on request.

Every file a run writes carries its run id: `run.json`, the metrics header, checkpoints'
`meta.json`, the dump (`dump/dump.json` and each step file), the summary files and the profile's
window files. Before a run writes anything, `claim_run_dir` reads those ids (never the bulk of a
file) and refuses a directory that holds another run's files. With `overwrite`,
`remove_run_files` removes the files Sleuth writes there, by name, and nothing else: a user's own
files in the run directory stay.

The trainer and the CLI (`sleuth run`) share this module; it imports no tool, and takes the
names of what each tool writes from the one list of them (`sleuth.common._run_files`).
"""
from __future__ import annotations

import json
import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path

from sleuth.common import (UntrustedFileError, h5_run_id, kind_problem, left_open_for_write,
                           open_regular, process_alive, read_bounded, run_files)
from trainer._errors import OtherRunError

LEGACY = ""  # the run id read from a file written before run ids
_JSON_LIMIT = 1 << 20  # a run's small JSON files; a larger one is not Sleuth's


@dataclass
class RunFiles:
    """The files Sleuth wrote into one run directory, by the run id each carries."""

    run_dir: Path
    owner: str | None = None
    """The run id run.json names (LEGACY when it names none); None without a run.json."""
    by_run: dict[str, list[str]] = field(default_factory=dict)
    """Run id -> names of what carries it, relative to the run directory ("dump/", ...)."""
    dump_steps: int = 0
    """Step files in dump/rank*/."""
    live_lock: str = ""
    """A dump rank lock whose writer may still run (its description), "" when none."""
    damaged: str = ""
    """Why run.json names no run that can be read ("" when it is sound or missing): which run
    wrote the directory is then unknown, never guessed to be a run from before run ids."""

    @property
    def empty(self) -> bool:
        return not self.by_run

    def others(self, run_id: str) -> dict[str, list[str]]:
        """The runs other than `run_id` found here, with their files."""
        return {rid: names for rid, names in self.by_run.items() if rid != run_id}


def _read_json(path: Path) -> object:
    """A small JSON file's value, or None when it is missing, not a regular file, too large or
    not JSON: a run's id is read from it, and nothing here may block or blow up."""
    return _read_json_why(path)[0]


def _read_json_why(path: Path) -> tuple[object, str]:
    """`_read_json`'s value, and why there is none ("" when read or missing). Read through the
    door (sleuth.common.read_bounded): a FIFO is never waited on, a device never read."""
    try:
        raw = read_bounded(path, _JSON_LIMIT)
    except FileNotFoundError:
        return None, ""
    except UntrustedFileError:
        if kind_problem(path):
            return None, "not a regular file"
        size = path.stat().st_size
        return None, f"{size:,} bytes, over the {_JSON_LIMIT:,} a run file holds"
    except OSError as e:
        return None, f"cannot be read: {e.strerror or e}"
    try:
        return json.loads(raw), ""
    except RecursionError:
        return None, "nested too deep to be a run file"
    except json.JSONDecodeError as e:
        return None, ("empty" if not raw else
                      f"not JSON: {e.msg}, line {e.lineno} column {e.colno}")
    except ValueError:  # UnicodeDecodeError
        return None, "not UTF-8 text"


def _json_kind(value: object) -> str:
    kinds = ((bool, "JSON true/false"), (dict, "a JSON object"), (list, "a JSON array"),
             (str, "a JSON string"), ((int, float), "a JSON number"))
    return next((name for k, name in kinds if isinstance(value, k)), "JSON null")


def _run_json_id(path: Path) -> tuple[str, str]:
    """run.json's run id (LEGACY for a run from before run ids), and why it is damaged."""
    value, why = _read_json_why(path)
    if why:
        return LEGACY, why
    if not isinstance(value, dict):
        return LEGACY, f"{_json_kind(value)}, not an object"
    run_id = value.get("run_id", LEGACY)
    if not isinstance(run_id, str):
        return LEGACY, f"its run_id is {_json_kind(run_id)}, not a string"
    return run_id, ""


def _id_of(value: object) -> str:
    run_id = value.get("run_id") if isinstance(value, dict) else None
    return run_id if isinstance(run_id, str) else LEGACY


def _metrics_id(path: Path) -> str:
    """The run id of a metrics file's header line."""
    try:
        with open_regular(path) as f:  # a FIFO named metrics.jsonl is never waited on
            first = f.readline(_JSON_LIMIT)
        return _id_of(json.loads(first))
    except (OSError, ValueError, RecursionError, UntrustedFileError):
        return LEGACY


def _h5_id(path: Path) -> str:
    """The `run_id` root attribute of an HDF5 file (a summary), LEGACY when it has none."""
    if kind_problem(path):  # a FIFO would hold HDF5's open forever
        return LEGACY
    try:
        import h5py

        try:
            f = h5py.File(path, "r", locking=False)
        except OSError as e:  # a writer killed mid-run leaves SWMR's "open for write" flag set
            if not left_open_for_write(e):
                return LEGACY
            f = h5py.File(path, "r", libver="latest", swmr=True, locking=False)
        with f:
            return h5_run_id(f.attrs)
    except Exception:  # noqa: BLE001 - an unreadable file carries no id that can be read
        return LEGACY


def _children(folder: Path, pattern: re.Pattern[str]) -> list[Path]:
    try:
        return sorted(p for p in folder.iterdir() if pattern.fullmatch(p.name))
    except OSError:
        return []


def scan_run_dir(run_dir: str | os.PathLike[str]) -> RunFiles:
    """Read the run ids of the Sleuth files in `run_dir` (a missing directory is empty).

    Files that carry no id of their own (the IR graphs, files written before run ids) are
    counted as the run's that run.json names."""
    root = Path(run_dir)
    found = RunFiles(root)
    if not root.is_dir():
        return found

    def add(run_id: str, name: str) -> None:
        names = found.by_run.setdefault(run_id, [])
        if name not in names:
            names.append(name)

    if os.path.lexists(root / "run.json"):
        found.owner, found.damaged = _run_json_id(root / "run.json")
        add(found.owner, "run.json")
    fallback = found.owner if found.owner is not None else LEGACY
    for path in _children(root, run_files.METRICS):
        add(_metrics_id(path) or fallback, path.name)
    for path in _children(root / "checkpoints", run_files.CHECKPOINT_DIR):
        add(_id_of(_read_json(path / "meta.json")) or fallback, f"checkpoints/{path.name}/")
    dump = root / "dump"
    ranks = _children(dump, run_files.RANK_DIR)
    steps = [p for r in ranks for p in _children(r, run_files.STEP_FILE)]
    found.dump_steps = len(steps)
    if (dump / "dump.json").exists() or steps:
        add(_id_of(_read_json(dump / "dump.json")) or fallback, "dump/")
    for rank in ranks:
        found.live_lock = found.live_lock or _live_lock(rank / ".lock")
    for path in _children(root / "summary", run_files.SUMMARY):
        add(_h5_id(path) or fallback, "summary/")
    for rank in _children(root / "profile", run_files.RANK_DIR):
        windows = _children(rank, run_files.PROFILE_FILE)
        metas = [p for p in windows if run_files.WINDOW_META.fullmatch(p.name)]
        for path in metas:
            add(_id_of(_read_json(path)) or fallback, "profile/")
        if windows and not metas:  # traces whose metadata a crash never wrote
            add(fallback, "profile/")
    if _children(root / "ir", run_files.IR_FILE):
        add(fallback, "ir/")
    return found


def _live_lock(path: Path) -> str:
    """A description of the dump writer holding `path` when it may still run; "" when there is
    no lock or its writer is gone (same host, no such process)."""
    owner = _read_json(path)
    if not path.exists():
        return ""
    if not isinstance(owner, dict):
        return f"{path} (an unreadable lock)"
    pid, host = owner.get("pid"), owner.get("host")
    who = f"{path}: pid {pid} on host {host}, run {owner.get('run_id', '?')}"
    if host != socket.gethostname() or not isinstance(pid, int):
        return who  # another host's process cannot be checked from here
    started = owner.get("started")
    return who if process_alive(pid, str(started) if started else None) else ""


def _describe(run_id: str) -> str:
    return f"run {run_id}" if run_id else "a run written before run ids"


def claim_run_dir(run_dir: str | os.PathLike[str], run_id: str, *, overwrite: bool = False,
                  fixes: str | None = None, damaged_fixes: str | None = None) -> RunFiles:
    """Check that `run_dir` holds no file of a run other than `run_id`; return what it holds.

    Reads only. With `overwrite`, another run's files are allowed (the caller then removes them
    with `remove_run_files`), unless a dump writer may still be writing there.

    Args:
        run_dir: the run directory.
        run_id: the id of the run about to write there (a resumed run: the id it continues).
        overwrite: the caller will replace the other run's files.
        fixes: the end of the refusal, naming the caller's own flags.
        damaged_fixes: the end of the refusal of a damaged run.json (no run to continue).

    Raises:
        OtherRunError: one line naming the directory, the other run (or the damaged run.json)
            and the fixes.
    """
    found = scan_run_dir(run_dir)
    if found.damaged and not overwrite:
        record = found.run_dir / "run.json"
        if _full_folder(record):  # --overwrite removes only Sleuth's files, never a user's folder
            raise OtherRunError(f"{record} is a folder holding files, where Sleuth writes its run "
                                f"record, so which run wrote {found.run_dir} cannot be told; "
                                "move that folder away, or pick another --run-dir")
        raise OtherRunError(f"{record} is damaged ({found.damaged}), so which "
                            f"run wrote {found.run_dir} cannot be told; "
                            + (damaged_fixes or "pass --overwrite to replace that run's "
                               "files, or another --run-dir"))
    others = found.others(run_id)
    if overwrite and (others or found.dump_steps) and found.live_lock:
        raise OtherRunError(f"{found.run_dir} is being written by another process "
                            f"({found.live_lock}); --overwrite would remove its files: wait for "
                            f"it to end, or pick another --run-dir")
    if others and not overwrite:
        other, names = next(iter(others.items()))
        more = f" and {len(others) - 1} more run(s)" if len(others) > 1 else ""
        shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
        resumable = any(n.startswith("checkpoints/") for n in names)
        fixes = fixes or ("pass --overwrite to replace it, "
                          + ("--resume latest to continue it, " if resumable else "")
                          + "or another --run-dir")
        raise OtherRunError(f"{found.run_dir} holds the files of another run ({_describe(other)}"
                            f"{more}: {shown}); {fixes}")
    return found


def _full_folder(p: Path) -> bool:
    try:
        return p.is_dir() and not p.is_symlink() and any(p.iterdir())
    except OSError:
        return False


def remove_run_files(run_dir: str | os.PathLike[str]) -> list[Path]:
    """Remove the files Sleuth writes in `run_dir` (run.json, metrics, checkpoints, dump,
    summary, profile, IR graphs), by name; folders left empty go too. A file of any other
    name, and the folder holding it, stays. Returns the files removed.

    Raises:
        OtherRunError: a file cannot be removed (named, with the fix)."""
    root = Path(run_dir)
    removed: list[Path] = []

    def unlink(p: Path) -> None:
        try:
            if p.is_dir() and not p.is_symlink():  # a folder where Sleuth writes a file
                p.rmdir()
            else:
                p.unlink()
        except FileNotFoundError:
            return
        except OSError as e:
            if p.is_dir() and not p.is_symlink():
                raise OtherRunError(f"{p} is a folder holding files, where Sleuth writes a file; "
                                    "--overwrite removes only Sleuth's own files: move it "
                                    "away, or pick another --run-dir") from e
            raise OtherRunError(f"cannot remove {p} of the old run: {e.strerror or e}; remove "
                                f"it by hand, or pick another --run-dir") from e
        removed.append(p)

    def rmdir(p: Path) -> None:
        try:
            p.rmdir()
        except OSError:  # not empty (a user's file), or gone
            pass

    for name in run_files.RUN_JSON:
        unlink(root / name)
    for p in _children(root, run_files.METRICS):
        unlink(p)
    for ckpt in _children(root / "checkpoints", run_files.CHECKPOINT_DIR):
        for name in run_files.CHECKPOINT_FILES:
            unlink(ckpt / name)
        rmdir(ckpt)
    for rank in _children(root / "dump", run_files.RANK_DIR):
        for p in _children(rank, run_files.DUMP_FILE):
            unlink(p)
        rmdir(rank)
    for p in _children(root / "dump", run_files.DUMP_TOP):
        unlink(p)
    for p in _children(root / "summary", run_files.SUMMARY):
        unlink(p)
    for rank in _children(root / "profile", run_files.RANK_DIR):
        for p in _children(rank, run_files.PROFILE_FILE):
            unlink(p)
        rmdir(rank)
    for p in _children(root / "ir", run_files.IR_FILE):
        unlink(p)
    for rank in _children(root / "data", run_files.RANK_DIR):  # the demo corpus, written per rank
        for p in _children(rank, run_files.CORPUS):
            unlink(p)
        rmdir(rank)
    for folder in ("checkpoints", "dump", "summary", "profile", "ir", "data"):
        rmdir(root / folder)
    return removed
