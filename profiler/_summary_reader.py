"""read_scalars / read_histograms: every rank's summary files under RUN/summary, as DataFrames.

Files left by a crash are opened in SWMR read mode (see _summary.py); segments
`rank{R}.seg{N}.h5` of a resumed run are merged in order.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

from profiler._errors import ProfileFormatError
from sleuth.common import h5_run_id



def _file_re() -> Any:
    from tracer.storage import numbered  # strict names: one rule for every reader

    return numbered(r"rank{n}(?:\.seg{n})?\.h5")


def _files(run_dir: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    folder = Path(run_dir) / "summary"
    if not folder.is_dir():
        raise ProfileFormatError(f"no summaries in {run_dir}: expected {folder}/rank*.h5 "
                                 "(write them with profiler.SummaryWriter or SLEUTH_SUMMARY=1)")
    found = []
    names = _file_re()
    for p in folder.iterdir():
        m = names.fullmatch(p.name)
        if m:
            found.append((int(m.group(1)), int(m.group(2) or 0), p))
    return [(rank, p) for rank, _, p in sorted(found)]


# what h5py raises on a summary whose metadata or data are damaged (checksums, missing objects,
# values that do not decode)
_DAMAGED = (OSError, KeyError, ValueError, IndexError, TypeError, RuntimeError)


def _open(path: Path) -> Any:
    """The summary at `path`, open for reading once tracer.storage.check_h5 finds that each of
    its datasets claims no more than the file stores (a series resized to millions of values
    never written reads as fill values from a file of a few KB)."""
    from tracer import UntrustedFileError
    from tracer.storage import check_h5

    f = _open_h5(path)
    try:
        check_h5(f, path)
    except UntrustedFileError as e:
        f.close()
        raise ProfileFormatError(f"cannot read summary: {e}") from e
    except _DAMAGED as e:
        f.close()
        raise ProfileFormatError(f"cannot read summary {path}: it is damaged "
                                 f"({type(e).__name__}: {e}); restore the file, or move it "
                                 f"away to read the other ranks") from e
    except BaseException:
        f.close()
        raise
    return f


def _open_h5(path: Path) -> Any:
    import h5py

    from tracer.storage import kind_problem

    problem = kind_problem(path)  # before h5py opens it: a FIFO would block the open forever
    if problem:
        raise ProfileFormatError(f"cannot read summary {path}: {problem}")
    try:
        return h5py.File(path, "r")
    except OSError as e:
        if "truncated file" in str(e):
            # shorter than its superblock says: a copy cut short or a full disk, never what a
            # killed writer leaves (SWMR writes data before the metadata that points to it).
            # Opened as SWMR it would read past its end, retrying each block for minutes.
            raise ProfileFormatError(f"cannot read summary {path}: it is truncated ({e}); "
                                     f"restore the file, or move it away to read the other "
                                     f"ranks") from e
        from sleuth.common import left_open_for_write

        if not left_open_for_write(e):  # damaged: as SWMR, HDF5 would retry it for minutes
            raise ProfileFormatError(f"cannot read summary {path}: {e}") from e
        try:  # a writer killed mid-run leaves the SWMR "open for write" flag set
            return h5py.File(path, "r", libver="latest", swmr=True)
        except OSError as e:
            raise ProfileFormatError(f"cannot read summary {path}: {e}") from e




def _each(run_dir: str | os.PathLike[str]) -> Iterator[tuple[int, Any, list[str]]]:
    """(rank, open file, tags) of each summary file; an error while the caller reads the file
    is a ProfileFormatError naming it, and so is a file of another run than the first file's
    (`run_id`; files without one, written before run ids, are not checked)."""
    first: tuple[str, Path] | None = None
    for rank, path in _files(run_dir):
        with _open(path) as f:
            try:
                run_id = h5_run_id(f.attrs)
                if run_id and first is None:
                    first = (run_id, path)
                elif run_id and run_id != first[0]:
                    raise ProfileFormatError(
                        f"{path} belongs to run {run_id}, but {first[1].name} to run "
                        f"{first[0]}: {path.parent} mixes two runs' summaries; read one run at "
                        f"a time: move the other run's files away, or log again with "
                        f"--overwrite or another --run-dir")
                version = f.attrs.get("format_version", "")
                version = version.decode() if isinstance(version, bytes) else str(version)
                if not version.startswith("1."):
                    raise ProfileFormatError(f"{path} has format_version {version!r}; this "
                                             "sleuth reads 1.x summaries: upgrade sleuth to "
                                             "read it")
                tags = [t.decode() for t in f["tags"][:]]
                yield rank, f, tags
            except _DAMAGED as e:
                raise ProfileFormatError(f"cannot read summary {path}: it is damaged "
                                         f"({type(e).__name__}: {e}); restore the file, or move "
                                         f"it away to read the other ranks") from e


def read_scalars(run_dir: str | os.PathLike[str]) -> Any:
    """DataFrame[rank, tag, step, wall_time, value] of every rank, in write order."""
    import pandas as pd
    frames = []
    for rank, f, tags in _each(run_dir):
        rows = f["scalars"][:]
        rows = rows[rows["tag"] < len(tags)]  # a crash can leave rows whose tag is unflushed
        frames.append(pd.DataFrame({
            "rank": rank, "tag": [tags[i] for i in rows["tag"]], "step": rows["step"],
            "wall_time": rows["wall_time"], "value": rows["value"]}))
    if not frames:
        return pd.DataFrame(columns=["rank", "tag", "step", "wall_time", "value"])
    return pd.concat(frames, ignore_index=True)


def read_histograms(run_dir: str | os.PathLike[str], tag: str | None = None) -> Any:
    """DataFrame[rank, tag, step, wall_time, edges, counts] (numpy arrays), optionally one tag.

    A writer's index rows point at disjoint blocks of `hist_data`, so together they claim at
    most the values it holds: an index claiming more (rows pointing at the same values again
    and again, 160 million bins from a 200 KiB file), or a row with a negative offset or
    count, is a ProfileFormatError naming the file, raised before any row is copied."""
    import pandas as pd
    out = []
    for rank, f, tags in _each(run_dir):
        index = f["hist_index"][:]
        data = f["hist_data"]
        n_data = data.shape[0]
        _check_index(index, n_data, Path(f.filename))
        want = None if tag is None else (tags.index(tag) if tag in tags else -1)
        for row in index:
            tid = int(row["tag"])
            if tid >= len(tags) or (want is not None and tid != want):
                continue
            off, bins = int(row["offset"]), int(row["bins"])
            if off + 2 * bins + 1 > n_data:
                continue
            block = data[off:off + 2 * bins + 1]
            out.append({"rank": rank, "tag": tags[tid], "step": int(row["step"]),
                        "wall_time": float(row["wall_time"]), "edges": block[:bins + 1],
                        "counts": block[bins + 1:]})
    return pd.DataFrame(out, columns=["rank", "tag", "step", "wall_time", "edges", "counts"])


def _check_index(index: Any, n_data: int, path: Path) -> None:
    if len(index) and (int(index["offset"].min()) < 0 or int(index["bins"].min()) < 1):
        raise ProfileFormatError(f"cannot read summary {path}: it is damaged (a histogram "
                                 f"row with a negative offset or no bins); restore the file, "
                                 f"or move it away to read the other ranks")
    claimed = int((2 * index["bins"].astype("i8") + 1).sum())
    if claimed > n_data:
        raise ProfileFormatError(
            f"cannot read summary {path}: refused: its histogram index claims {claimed:,} "
            f"values, but hist_data holds {n_data:,} (a writer's rows never overlap); the "
            f"file is damaged or forged and was not read: restore it, or move it away to "
            f"read the other ranks")
