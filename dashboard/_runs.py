"""The runs a dashboard shows: their roots, labels, run.json, what data each holds, and the one
place that turns a requested relative path into a file under a run root (or refuses it)."""
from __future__ import annotations

import json
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
    """A short unique name: run.json's `name`, else the folder name."""


def load_runs(run_dirs: Iterable[str | os.PathLike[str]]) -> list[Run]:
    """Resolve `run_dirs` into `Run`s with unique labels.

    Raises:
        RunDirError: a path does not exist or is not a directory, or the list is empty.
    """
    roots = [Path(p).expanduser().resolve() for p in run_dirs]
    if not roots:
        raise RunDirError("no run directory given: pass at least one, e.g. `sleuth dashboard runs/a`")
    runs: list[Run] = []
    seen: dict[str, int] = {}
    for i, root in enumerate(roots):
        if not root.is_dir():
            raise RunDirError(f"run directory {str(root)!r} does not exist or is not a directory")
        name = str(read_run_json(root).get("name") or root.name)
        # Two runs may share a name (two seeds of one config): suffix to keep labels unique.
        seen[name] = seen.get(name, 0) + 1
        label = name if seen[name] == 1 else f"{name} ({seen[name]})"
        runs.append(Run(index=i, root=root, label=label))
    return runs


def read_run_json(root: Path) -> dict[str, Any]:
    """run.json as a dict, or {} when absent or unreadable (a run may not have written it yet)."""
    try:
        data = json.loads((root / "run.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def available(root: Path) -> dict[str, bool]:
    """Which kinds of data a run holds: metrics, summary, dump, profile, ir, checkpoints."""
    out = {}
    for kind, rel in _DATA_KINDS.items():
        p = root / rel
        out[kind] = p.is_file() if p.suffix else (p.is_dir() and any(p.iterdir()))
    out["dump"] = out["dump"] or export_of(root) is not None
    return out


def export_of(root: Path) -> Path | None:
    """The Parquet export of a dump's statistics (`sleuth dump export`) that the Dumps page
    reads for a run without a dump/ folder: the run folder itself when it is one, else
    RUN/export.parquet (where the export goes by default); None when neither, or when the run
    has its HDF5 dump."""
    if (root / "dump").is_dir():
        return None
    from tracer.storage import is_export

    return next((p for p in (root, root / "export.parquet") if is_export(p)), None)


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


def safe_path(root: Path, rel: str) -> Path:
    """The file `rel` under `root`, refusing anything that could leave it.

    Raises:
        UnsafePathError: `rel` is absolute, contains `..`, a backslash or a NUL, or resolves
            (through a symlink) outside `root`.
    """
    if not rel or "\x00" in rel or "\\" in rel:
        raise UnsafePathError(f"refused path {rel!r}")
    pure = PurePosixPath(rel)
    if pure.is_absolute() or rel.startswith("/") or any(part == ".." for part in pure.parts):
        raise UnsafePathError(f"refused path {rel!r}: only paths inside the run directory are served")
    path = (root / pure).resolve()
    if not path.is_relative_to(root):
        raise UnsafePathError(f"refused path {rel!r}: it leads outside the run directory")
    return path


def run_options(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """Dropdown options for a run list."""
    return [{"label": r.label, "value": r.index} for r in runs]
