"""Whole-file writes (through the door's one atomic_file) and the run-directory layout shared by the profiler's writers and readers."""
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


def write_json_atomic(path: Path, data: Any) -> None:
    """`data` as JSON at `path`, whole or not at all (the door's atomic_file)."""
    from tracer.storage import atomic_file

    with atomic_file(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(data, indent=1, sort_keys=True, default=str))


def gzip_atomic(src: Path, dest: Path) -> None:
    """Compress `src` into `dest` (whole or not at all), then delete `src`."""
    from tracer.storage import atomic_file

    with open(src, "rb") as fin, atomic_file(dest, "wb") as out, \
            gzip.GzipFile(filename="", fileobj=out, mode="wb", compresslevel=3) as fout:
        shutil.copyfileobj(fin, fout, 1 << 20)
    src.unlink()


def write_frame_atomic(df: Any, path: Path, fmt: str = "parquet") -> None:
    """A table at `path` as parquet or CSV, whole or not at all."""
    from tracer.storage import atomic_file

    with atomic_file(path, "wb") as f:
        if fmt == "parquet":
            df.to_parquet(f, index=False)
        else:
            df.to_csv(f, index=False)
