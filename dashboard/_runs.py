"""The runs a dashboard shows: their roots, labels, run.json, what data each holds, and the one
place that turns a requested relative path into a file under a run root (or refuses it).

Everything here reads files a run (or whoever can write into its folder) wrote: run.json goes
through `tracer.storage.load_bounded` (size and depth limits), and a sub-folder or file that is
a symbolic link leading out of the run directory is refused, not followed."""
from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from dashboard._errors import RunDirError, UnsafePathError

# Sub-folders and files a run directory may hold (docs/architecture.md), checked by `available`.
_DATA_KINDS: dict[str, str] = {
    "metrics": "metrics.jsonl",
    "summary": "summary",
    "dump": "dump",
    "profile": "profile",
    "ir": "ir",
    "checkpoints": "checkpoints",
}


@dataclass(frozen=True, kw_only=True)
class Run:
    """One run directory shown by the dashboard."""

    index: int
    """Position in the dashboard's run list: the id used in URLs and callbacks."""
    root: Path
    """The resolved run directory; nothing outside it is ever served."""
    label: str
    """A short unique name: the run's folder, relative to the folder that holds all the runs
    given (`runs/a runs/b` are "a" and "b"; `x/seed0 y/seed0` are "x/seed0" and "y/seed0").
    run.json's `name` (often the preset, shared by many runs) is a detail, not the label."""


RUN_JSON_MAX_BYTES = 1 << 20
"""The largest run.json the dashboard reads: the trainer's is a few kilobytes (argv, versions,
the resolved config), and the Runs page sends what it reads to the browser."""


def load_runs(run_dirs: Iterable[str | os.PathLike[str]]) -> list[Run]:
    """Resolve `run_dirs` into `Run`s labelled by folder. Reads no file of the runs, so a
    damaged run.json cannot stop the dashboard from starting: its page says what is wrong.

    Raises:
        RunDirError: a path does not exist or is not a directory, or the list is empty.
    """
    roots = []
    for p in run_dirs:
        try:
            root = Path(p).expanduser().resolve()
            is_dir = root.is_dir()
        except (OSError, RuntimeError) as e:  # a symlink loop, a name too long
            raise RunDirError(f"run directory {str(p)!r} cannot be opened: {e}") from e
        if not is_dir:
            raise RunDirError(f"run directory {str(root)!r} does not exist or is not a directory")
        roots.append(root)
    if not roots:
        raise RunDirError("no run directory given: pass at least one, e.g. `sleuth dashboard runs/a`")
    runs: list[Run] = []
    seen: dict[str, int] = {}
    for i, (root, name) in enumerate(zip(roots, folder_labels(roots))):
        # The same folder given twice: suffix to keep labels unique.
        seen[name] = seen.get(name, 0) + 1
        label = name if seen[name] == 1 else f"{name} ({seen[name]})"
        runs.append(Run(index=i, root=root, label=label))
    return runs


def folder_labels(roots: Sequence[Path]) -> list[str]:
    """Each root relative to the deepest folder that holds them all; a root that is that folder
    itself (or a single run) is named by its folder name."""
    common = Path(os.path.commonpath([str(r) for r in roots]))
    out = []
    for r in roots:
        rel = r.relative_to(common).as_posix()
        out.append(rel if rel != "." else (r.name or str(r)))
    return out


def read_run_json(root: Path) -> dict[str, Any]:
    """run.json as a dict; {} when absent, unreadable or not an object (`run_json_problem`
    says which)."""
    return load_run_json(root)[0]


def load_run_json(root: Path) -> tuple[dict[str, Any], str | None]:
    """run.json as a dict, and None or one line saying why it could not be read (too large,
    nested too deep, not JSON, not an object, a link out of the run). Absent is not a problem:
    a run may not have written it yet, and folders of other scripts have none."""
    from tracer.storage import JsonLimitError, load_bounded

    try:
        path = inside(root, "run.json")
    except UnsafePathError as e:
        return {}, str(e)
    if not os.path.lexists(path):
        return {}, None
    try:
        data = load_bounded(path, max_bytes=RUN_JSON_MAX_BYTES)
    except JsonLimitError as e:
        return {}, str(e)
    if not isinstance(data, dict):
        return {}, f"{path}: not a JSON object (a {type(data).__name__}); this is not a run.json sleuth wrote"
    return data, None


def inside(root: Path, rel: str) -> Path:
    """`root / rel` when it stays inside the run directory, following symbolic links; absent
    paths are returned as they are (a run may not have written them yet).

    Raises:
        UnsafePathError: the path is a symbolic link (or passes through one) that leads out of
            the run directory, or loops.
    """
    path = root / rel
    try:
        real = path.resolve()
    except (OSError, RuntimeError) as e:
        raise UnsafePathError(f"{path}: cannot be followed ({e}); the dashboard reads only "
                              "files inside the run directory") from e
    if not real.is_relative_to(root):
        raise UnsafePathError(f"{path} is a symbolic link to {real}, outside the run directory; "
                              "the dashboard reads only files inside it: replace the link with "
                              "the data, or pass that folder as a run of its own")
    return path


def available(root: Path) -> dict[str, bool]:
    """Which kinds of data a run holds: metrics, summary, dump, profile, ir, checkpoints."""
    out = {}
    for kind, rel in _DATA_KINDS.items():
        try:
            p = inside(root, rel)
            out[kind] = p.is_file() if p.suffix else (p.is_dir() and any(p.iterdir()))
        except (OSError, UnsafePathError):  # unreadable, or a link out: the page says which
            out[kind] = False
    try:
        out["dump"] = out["dump"] or export_of(root) is not None
    except (OSError, UnsafePathError):
        pass
    return out


def link_problems(root: Path) -> list[str]:
    """One line for each data file or folder of the run that is a symbolic link leading out of
    it (and so is not read): the Runs page shows them on the run's card."""
    out = []
    for rel in ("run.json", *_DATA_KINDS.values(), "export.parquet"):
        try:
            inside(root, rel)
        except UnsafePathError as e:
            out.append(str(e))
    return out


def export_of(root: Path) -> Path | None:
    """The Parquet export of a dump's statistics (`sleuth dump export`) that the Dumps page
    reads for a run without a dump/ folder: the run folder itself when it is one, else
    RUN/export.parquet (where the export goes by default); None when neither, or when the run
    has its HDF5 dump."""
    if (root / "dump").is_dir():
        return None
    from tracer.storage import is_export

    candidates = (root, inside(root, "export.parquet"))
    return next((p for p in candidates if is_export(p)), None)


# The data files of each kind, as the writers name them. Readers may write caches next to them
# (the profiler's table cache, an index): those must not count as new data, or reading a run
# would make every open page re-read it once more.
_DATA_FILES: tuple[tuple[str, str], ...] = (
    (".", "run.json"), (".", "metrics*.jsonl"), ("summary", "rank*.h5"), ("dump/rank*", "step*.h5"),
    ("export.parquet", "_sleuth_export.json"), (".", "_sleuth_export.json"),
    ("profile/rank*", "window*.trace.json*"), ("ir", "*.ir"), ("ir", "*.svg"),
)


def fingerprint(root: Path) -> tuple[tuple[str, int, int], ...]:
    """A token that changes when any data file of the run appears or changes (name, mtime,
    size), polled by the page's refresh interval; cheap: a few directory listings."""
    stamps: list[tuple[str, int, int]] = []
    for folder, pattern in _DATA_FILES:
        for p in sorted(root.glob(f"{folder}/{pattern}")):
            try:
                st = p.stat()
            except OSError:
                continue
            stamps.append((str(p.relative_to(root)), st.st_mtime_ns, st.st_size))
    return tuple(stamps)


MAX_REL_CHARS = 1024
"""The longest relative path the file routes accept (a run's deepest file is far shorter)."""


def safe_path(root: Path, rel: str) -> Path:
    """The file `rel` under `root`, refusing anything that could leave it.

    Raises:
        UnsafePathError: `rel` is absolute, contains `..`, a backslash or a NUL, is longer
            than any file name can be, or resolves (through a symlink) outside `root`.
    """
    if not rel or "\x00" in rel or "\\" in rel:
        raise UnsafePathError(f"refused path {rel!r}")
    pure = PurePosixPath(rel)
    if pure.is_absolute() or rel.startswith("/") or any(part == ".." for part in pure.parts):
        raise UnsafePathError(f"refused path {rel!r}: only paths inside the run directory are served")
    # No file name on any system is this long; resolving one raises instead of answering.
    if len(rel) > MAX_REL_CHARS or any(len(part.encode("utf-8", "surrogatepass")) > 255
                                       for part in pure.parts):
        raise UnsafePathError(f"refused path of {len(rel)} characters: no file of a run has that name")
    try:
        path = (root / pure).resolve()
    except (OSError, RuntimeError) as e:
        raise UnsafePathError(f"refused path {rel[:200]!r}: {e}") from e
    if not path.is_relative_to(root):
        raise UnsafePathError(f"refused path {rel!r}: it leads outside the run directory")
    return path


def run_options(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """Dropdown options for a run list: the folder label, the full path as the tooltip."""
    return [{"label": r.label, "value": r.index, "title": str(r.root)} for r in runs]
