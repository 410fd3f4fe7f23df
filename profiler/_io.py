"""Atomic file writes and the run-directory layout shared by the profiler's writers and readers."""
from __future__ import annotations

import gzip
import json
import os
import shutil
from pathlib import Path
from typing import Any

FORMAT_VERSION = "1.0"
"""format_version of profile window metadata; readers accept 1.x."""


def rank_from_env(rank: int | None) -> int:
    return int(os.environ.get("RANK", "0")) if rank is None else int(rank)


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def profile_dir(run_dir: str | os.PathLike[str], rank: int) -> Path:
    return Path(run_dir) / "profile" / f"rank{rank}"


def _fsync_replace(partial: Path, final: Path) -> None:
    with open(partial, "rb+") as f:
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, final)


def write_json_atomic(path: Path, data: Any) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data, indent=1, sort_keys=True, default=str))
    _fsync_replace(partial, path)


def gzip_atomic(src: Path, dest: Path) -> None:
    """Compress `src` into `dest` (via dest.partial), then delete `src`."""
    partial = dest.with_name(dest.name + ".partial")
    with open(src, "rb") as fin, gzip.open(partial, "wb", compresslevel=3) as fout:
        shutil.copyfileobj(fin, fout, 1 << 20)
    _fsync_replace(partial, dest)
    src.unlink()


def write_frame_atomic(df: Any, path: Path, fmt: str = "parquet") -> None:
    partial = path.with_name(path.name + ".partial")
    if fmt == "parquet":
        df.to_parquet(partial, index=False)
    else:
        df.to_csv(partial, index=False)
    _fsync_replace(partial, path)
