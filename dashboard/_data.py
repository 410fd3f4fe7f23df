"""Data adapters: read a run through the tools' PUBLIC readers (profiler, tracer, irdump) and
metrics.jsonl, return DataFrames, and cache each result until its files change.

A missing package, a reader API that does not exist yet, or a run without that kind of data
raises `NoData` with a sentence the page shows as its empty state ("this run has no profile:
run with --profile"); nothing here draws.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from dashboard._cache import (NoData, ReadError, _api, _cached, _dir_stamps, _lock, _need_dir,
                              _reading, _stamp)
from dashboard._errors import UnsafePathError
from dashboard._metrics import MAX_BYTES as METRICS_MAX_BYTES
from dashboard._metrics import JsonlTail, series_from_wide
from dashboard._runs import export_of, inside
from sleuth.common import number_of, run_files


# ---------------------------------------------------------------- scalars


_tails: dict[Path, JsonlTail] = {}
_metric_notes: dict[Path, list[str]] = {}


def _metrics_frame(path: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    if not path.exists():  # anything else there (a FIFO, a folder) is named by the opener
        return pd.DataFrame(), pd.DataFrame()
    with _lock:
        tail = _tails.get(path)
        size = path.stat().st_size
        if tail is None or size < tail.offset:  # first read, or the file was rewritten
            tail = _tails[path] = JsonlTail()
        return tail.update(path)


def _metrics_series(root: Path, path: Path, notes: list[str]) -> dict[str, pd.DataFrame]:
    """The series of one metrics file; what could not be read goes into `notes`, one line each."""
    try:
        inside(root, path.name)
        m = _cached(("metrics", path), _stamp(path), lambda: series_from_wide(*_metrics_frame(path)))
    except (OSError, ValueError) as e:  # a link out of the run, an unreadable file
        notes.append(str(e) if isinstance(e, UnsafePathError) else f"{path}: cannot be read ({e})")
        return {}
    for tag, frame in m.items():
        if "text_values" in frame.attrs:
            count, first, step = frame.attrs["text_values"]
            notes.append(f"{path}: {tag}: {count:,} value(s) written as text, not as numbers "
                         f"(first {first} at step {step:g}); read as the number they spell, "
                         f"else shown as gaps")
    tail = _tails.get(path)
    if tail is not None and tail.skipped:
        notes.append(f"{path}: {tail.skipped:,} malformed line(s) skipped ({tail.first_bad}); "
                     "the other lines are shown")
    size = _stamp(path)[1]
    if size > METRICS_MAX_BYTES:
        notes.append(f"{path}: {size:,} bytes; only its first {METRICS_MAX_BYTES:,} bytes are read "
                     "and shown")
    return m


def _summary_series(root: Path) -> dict[str, pd.DataFrame]:
    try:
        if not inside(root, "summary").is_dir():
            return {}
    except OSError:  # a link out of the run: no summary scalars (Histograms names the problem)
        return {}
    try:
        read_scalars = _api("profiler", "read_scalars", "summary scalars")
        df = read_scalars(root)
    except NoData:
        return {}
    except Exception:  # noqa: BLE001 - a summary being written; metrics.jsonl still shows
        return {}
    if df is None or df.empty:
        return {}
    t0 = df["wall_time"].min()
    out = {}
    for (rank, tag), g in df.groupby(["rank", "tag"], sort=True):
        g = g.sort_values("step", kind="stable")
        name = str(tag) if int(rank) == 0 else f"{tag} [rank {int(rank)}]"
        out[name] = pd.DataFrame({"step": g["step"].to_numpy(np.float64),
                                  "wall_time": (g["wall_time"] - t0).to_numpy(np.float64),
                                  "value": g["value"].to_numpy(np.float64)})
    return out


def scalars(root: Path) -> dict[str, pd.DataFrame]:
    """Every scalar series of a run, by tag: metrics.jsonl columns (loss, lr, grad_norm,
    tokens_per_s, ...), other ranks' metrics.rank{R}.jsonl (tags suffixed ` [rank R]`), and the
    summary's scalars (prefixed `summary/` on a name clash). Each frame has columns step,
    wall_time (seconds since the first record), value, sorted by step."""
    out: dict[str, pd.DataFrame] = {}
    notes: list[str] = []
    for rank, path in [(None, root / "metrics.jsonl"), *_rank_metrics(root)]:
        m = _metrics_series(root, path, notes)
        suffix = "" if rank is None else f" [rank {rank}]"
        out.update({f"{tag}{suffix}": frame for tag, frame in m.items()})
    with _lock:
        _metric_notes[root] = notes
    s = _cached(("summary-scalars", root), tuple(_dir_stamps(root / "summary")),
                lambda: _summary_series(root))
    for tag, frame in s.items():
        out[f"summary/{tag}" if tag in out else tag] = frame
    return out


def scalar_notes(root: Path) -> list[str]:
    """What `scalars(root)` could not read, one line each (malformed lines skipped and where,
    a file too long to read whole, a link out of the run); empty when everything was read."""
    with _lock:
        return list(_metric_notes.get(root, []))


def _rank_metrics(root: Path) -> list[tuple[int, Path]]:
    """The per-rank metrics files (`metrics.rank{R}.jsonl`) by rank, named as the trainer names
    them (`run_files.METRICS`): a look-alike (`metrics.rank00.jsonl`, a Unicode digit) is no
    rank's file and is not read."""
    found = ((number_of(run_files.METRICS, p.name), p) for p in root.glob("metrics.rank*.jsonl"))
    return sorted((rank, p) for rank, p in found if rank is not None)


# ---------------------------------------------------------------- histograms


def histograms(root: Path) -> pd.DataFrame:
    """All histograms of a run: DataFrame[rank, tag, step, edges, counts] (profiler's reader)."""
    _need_dir(root, "summary", "this run has no summary histograms: run with --summary")
    read = _api("profiler", "read_histograms", "histograms")

    def make() -> pd.DataFrame:
        df = read(root)
        return df if df is not None else pd.DataFrame()

    df = _cached(("histograms", root), tuple(_dir_stamps(root / "summary")), _reading("the histograms", make))
    if df.empty:
        raise NoData("this run logged no histograms: run with --summary")
    return df


# ---------------------------------------------------------------- profile


def profile(root: Path) -> Any:
    """The run's `profiler.Profile` (ops, modules, steps, memory, cluster DataFrames)."""
    prof = _need_dir(root, "profile", "this run has no profile: run with --profile")
    read = _api("profiler", "read_profile", "the profile page")
    stamp = tuple(_stamp(Path(d)) for d, _, _ in os.walk(prof))
    return _cached(("profile", root), stamp, _reading("the profile", lambda: read(root)))


def profile_diff(root_a: Path, root_b: Path) -> Any:
    """`profiler.diff_profiles` of two runs (B against A), cached until either profile changes."""
    for root in (root_a, root_b):
        _need_dir(root, "profile", f"{root.name} has no profile: run with --profile")
    diff = _api("profiler", "diff_profiles", "the profile comparison")
    stamp = tuple(_stamp(Path(d)) for root in (root_a, root_b)
                  for d, _, _ in os.walk(root / "profile"))
    return _cached(("profile_diff", root_a, root_b), stamp,
                   _reading("the two profiles", lambda: diff(profile(root_a), profile(root_b))))


# ---------------------------------------------------------------- dumps


def dump(root: Path) -> Any:
    """The run's `tracer.Dump` (ranks, steps, stats, tensor); where the run has no dump/ but a
    Parquet export of one (`sleuth dump export`: RUN/export.parquet, or the run folder given is
    the export itself), a `tracer.storage.ExportedDump` over it: statistics, no tensors."""
    try:
        export = export_of(root)
    except OSError as e:  # UnsafePathError: export.parquet is a link out of the run
        raise ReadError(str(e)) from e
    if export is not None:
        from tracer.storage import ExportedDump

        stamp = tuple(_dir_stamps(export))
        return _cached(("export", root), stamp,
                       _reading("the Parquet export", lambda: ExportedDump(export)))
    d = _need_dir(root, "dump", "this run has no tensor dump: run with --dump CONFIG, or "
                  "export one here (sleuth dump export DUMP --out RUN/export.parquet)")
    from tracer import open_dump

    stamp = tuple(_dir_stamps(d)) + tuple(s for r in sorted(d.iterdir()) for s in _dir_stamps(r))
    return _cached(("dump", root), stamp, _reading("the dump", lambda: open_dump(root)))


def dump_stats(root: Path, rank: int, step: int) -> pd.DataFrame:
    """The statistics table of one step of one rank, with a `hit` column naming the watchpoint
    conditions each record hit (empty string when none)."""
    d = dump(root)
    df = _reading(f"rank {rank} step {step} of the dump", lambda: d.stats(rank=rank, step=step))().copy()
    hits = dump_hits(root, rank, step)
    if not hits.empty and "seq" in hits:
        by_seq = hits.groupby("seq")["condition"].agg(lambda c: ",".join(sorted(set(map(str, c)))))
        df["hit"] = df["seq"].map(by_seq).fillna("")
    else:
        df["hit"] = ""
    return df


_TABLES_KEPT = 4
"""Table frames of this many (run, rank, step) stay in memory: each may hold a million rows."""
_tables: OrderedDict[Hashable, tuple[Hashable, pd.DataFrame]] = OrderedDict()


def dump_table(root: Path, rank: int, step: int, make: Callable[[pd.DataFrame], pd.DataFrame]) -> pd.DataFrame:
    """`make(dump_stats(root, rank, step))`, kept while the dump is unchanged, for the last few
    steps shown: the Dumps page pages, sorts and filters it on every request."""
    key, stamp = (root, rank, step), dump_version(root)
    with _lock:
        hit = _tables.get(key)
        if hit is not None and hit[0] == stamp:
            _tables.move_to_end(key)
            return hit[1]
    frame = make(dump_stats(root, rank, step))
    with _lock:
        _tables[key] = (stamp, frame)
        _tables.move_to_end(key)
        while len(_tables) > _TABLES_KEPT:
            _tables.popitem(last=False)
    return frame


def dump_version(root: Path) -> tuple:
    """A token that changes when the run's dump (or its Parquet export) changes."""
    try:
        export = export_of(root)
    except OSError:
        export = None
    return dump_stamp(root) + (tuple(_dir_stamps(export)) if export is not None else ())


def dump_hits(root: Path, rank: int, step: int) -> pd.DataFrame:
    """Watchpoint hits of one step: `tracer.check` over that step (the dump config's watchpoints
    plus NaN/Inf, and the hits recorded live); empty when unavailable."""
    try:
        exported = export_of(root) is not None
    except OSError:
        return pd.DataFrame()
    if exported:
        return pd.DataFrame()  # watchpoints are evaluated on the HDF5 dump; NaN/Inf still show
    try:
        from tracer import check

        df = _cached(("hits", root, rank, step), dump_stamp(root),
                     lambda: check(root, rank=rank, step=step, first_nan=False))
    except Exception:  # noqa: BLE001 - hits are an overlay: the table shows without them
        return pd.DataFrame()
    return df if df is not None else pd.DataFrame()


def dump_stamp(root: Path) -> tuple:
    try:
        d = inside(root, "dump")
        if not d.is_dir():
            return ()
    except OSError:  # a link out of the run: `dump` says so
        return ()
    return tuple(_dir_stamps(d)) + tuple(s for r in sorted(d.iterdir()) if r.is_dir() for s in _dir_stamps(r))


def record_history(root: Path, rank: int, name: str) -> pd.DataFrame:
    """One record over the dumped steps of a rank: step, dtype, overflow_bits, underflow_bits,
    zero_share (`tracer.analysis.record_headroom` of each step's row; NaN where the record has
    no headroom that step: a NaN in it, an integer dtype). Empty when no step holds it."""
    from tracer.analysis import record_headroom

    def read() -> pd.DataFrame:
        stats = dump(root).stats(rank=rank)
        rows = []
        for row in stats[stats["name"] == name].to_dict("records"):
            h = record_headroom(row) or {}
            rows.append({"step": int(row["step"]), "dtype": row["dtype"],
                         **{k: (np.nan if h.get(k) is None else float(h[k]))
                            for k in ("overflow_bits", "underflow_bits", "zero_share")}})
        return pd.DataFrame(rows, columns=["step", "dtype", "overflow_bits", "underflow_bits",
                                           "zero_share"])

    return _cached(("history", root, rank, name), dump_stamp(root),
                   _reading(f"{name!r} over the steps of rank {rank}", read))


def dump_tensor(root: Path, rank: int, step: int, name: str) -> np.ndarray:
    """One stored tensor as numpy (bf16/fp8 upcast exactly); NoData when the dump holds no bytes."""
    try:
        return np.asarray(dump(root).tensor(rank=rank, step=step, name=name))
    except NoData:
        raise
    except Exception as e:  # noqa: BLE001 - statistics-only dumps hold no tensor bytes
        raise NoData(f"no tensor data for {name!r}: dump with mode 'tensor' or 'full' ({e})") from e


# ---------------------------------------------------------------- diff


def explain(root_a: Path, root_b: Path, *, rank: int = 0, step: int | None = None) -> Any:
    """`tracer.analysis.explain(a, b)`: the verdict and the chain, cached while neither dump
    changes; NoData naming why it cannot run (no dump, no op-level tensors)."""
    for root in (root_a, root_b):
        _need_dir(root, "dump", f"run {root.name!r} has no tensor dump to explain")
    from tracer.analysis import explain as run_explain

    stamp = (dump_stamp(root_a), dump_stamp(root_b))
    return _cached(("explain", root_a, root_b, rank, step), stamp,
                   _reading("the explanation", lambda: run_explain(root_a, root_b, rank=rank,
                                                                   step=step)))


def diff(root_a: Path, root_b: Path, **kwargs: Any) -> Any:
    """`tracer.diff(a, b, **kwargs)`: a DiffResult with status, first_divergence, records."""
    for root in (root_a, root_b):
        _need_dir(root, "dump", f"run {root.name!r} has no tensor dump to diff: run both with --dump CONFIG")
    from tracer import diff as run_diff

    key = ("diff", root_a, root_b, tuple(sorted(kwargs.items())))
    return _cached(key, (dump_stamp(root_a), dump_stamp(root_b)),
                   _reading("the diff", lambda: run_diff(root_a, root_b, **kwargs)))


def rank_diff(root_a: Path, root_b: Path, step: int | None = None) -> Any:
    """`tracer.diff_ranks(a, b)`: every rank pair, the earliest divergence across ranks and the
    rank x step table (in this process: a dashboard request never starts a pool)."""
    for root in (root_a, root_b):
        _need_dir(root, "dump", f"run {root.name!r} has no tensor dump to diff: run both with --dump CONFIG")
    from tracer import diff_ranks

    key = ("rank_diff", root_a, root_b, step)
    return _cached(key, (dump_stamp(root_a), dump_stamp(root_b)),
                   _reading("the diff over ranks",
                            lambda: diff_ranks(root_a, root_b, step=step, workers=1)))


def rank_count(root: Path) -> int:
    """How many ranks the run's dump has (0 without a dump or when it does not open)."""
    if not dump_stamp(root):
        return 0
    from tracer.analysis import dump_ranks

    try:
        return len(_cached(("ranks", root), dump_stamp(root), lambda: dump_ranks(root)))
    except Exception:  # noqa: BLE001 - the diff itself reports what does not read
        return 0


# ---------------------------------------------------------------- graphs


def graphs(root: Path) -> pd.DataFrame:
    """The run's graphs: DataFrame[stage, name, ir, sorted_ir, dot, svg] (irdump's lister)."""
    ir = _need_dir(root, "ir", "this run has no IR graphs: run with --save-graphs")
    list_graphs = _api("irdump", "list_graphs", "the graph page")
    df = _cached(("graphs", root), tuple(_dir_stamps(ir)), _reading("the graphs", lambda: list_graphs(root)))
    if df is None or df.empty:
        raise NoData("this run has no IR graphs: run with --save-graphs")
    return df


def ir_nodes(path: Path) -> pd.DataFrame:
    """The nodes of one `.ir` file: DataFrame[index, name, op, module, source, ...]."""
    read_ir = _api("irdump", "read_ir", "graph search")
    return _cached(("ir", path), _stamp(path), _reading(path.name, lambda: read_ir(path)))


def node_name_for_record(record: str) -> str | None:
    """The IR node stem of a dump record name: `{module}::{op}.{phase}.{call}` for op records
    (docs/dump-format.md; IR nodes use the same stem), the module scope for module records;
    None for names that are not `{scope}.{phase}.{call}.{direction}.{index}`."""
    parts = record.split(".")
    if len(parts) < 5 or parts[-4] not in ("forward", "backward", "optimizer"):
        return None
    scope = ".".join(parts[:-4])
    return f"{scope}.{parts[-4]}.{parts[-3]}" if "::" in scope else scope
