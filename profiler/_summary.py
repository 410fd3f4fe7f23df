"""SummaryWriter: scalars and histograms of one rank, appended to RUN/summary/rank{R}.h5.

Crash safety: the file is HDF5 in SWMR mode (libver "latest"), written only by appending to
resizable datasets and flushed every `flush_every` records or `flush_secs` seconds. SWMR's
ordered metadata writes keep the file readable after a SIGKILL (tested): a reader loses at most
the records since the last flush. A crashed file keeps its "open for write" flag, so readers
fall back to opening it in SWMR read mode, and a writer that finds the file already present
starts a new segment `rank{R}.seg{N}.h5` rather than touching it; readers merge the segments.

Layout (format_version 1.0): root attributes format_version, kind, rank, created, run_id (the
run that wrote the file; readers refuse to merge files of different runs);
`tags` (fixed-length UTF-8, index = tag id); `scalars` (tag, step, wall_time, value);
`hist_index` (tag, step, wall_time, offset, bins) pointing into `hist_data` (float64: the
bins+1 edges, then the bins counts).

Writing never stops the run it observes: a summary that cannot be opened or written (a full
disk, an unwritable folder) goes off with one `sleuth: ...` warning and the run goes on;
`SLEUTH_STRICT=1` raises ProfilerError instead (`sleuth.common.go_off`, every tool's rule).
"""
from __future__ import annotations

import atexit
import difflib
import os
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable

from profiler._errors import ConfigError, ProfilerError
from profiler._io import rank_from_env
from profiler._own import own_work
from sleuth.common import SleuthWarning, go_off, inherited_run_id, strict

FORMAT_VERSION = "1.0"
TAG_BYTES = 512
_FREQ_KEYS = ("scalar", "histogram")


class SummaryCapReached(SleuthWarning):
    """Warned once when a summary file reaches `max_bytes`; later records are dropped. Printed
    as one line, `sleuth: ...`, as every warning of Sleuth's (sleuth.common.SleuthWarning)."""


def _dtypes() -> dict[str, Any]:
    import numpy as np
    return {
        "tags": np.dtype(f"S{TAG_BYTES}"),
        "scalars": np.dtype([("tag", "<i4"), ("step", "<i8"), ("wall_time", "<f8"), ("value", "<f8")]),
        "hist_index": np.dtype([("tag", "<i4"), ("step", "<i8"), ("wall_time", "<f8"),
                                ("offset", "<i8"), ("bins", "<i4")]),
        "hist_data": np.dtype("<f8"),
    }


class SummaryWriter:
    """Append scalars and histograms for one rank.

    Args:
        run_dir: the run directory; the file is `run_dir/summary/rank{R}.h5`.
        rank: default $RANK or 0.
        flush_every: records buffered before they are written and flushed to the file.
        flush_secs: also flush when this many seconds passed since the last flush.
        max_bytes: size cap of the file; when reached, a SummaryCapReached warning is given
            once and later records are dropped.
        frequency: keep a scalar / histogram only at steps divisible by this number.
        run_id: the run the file belongs to (default: the one this process inherits, as the
            Collector's, `sleuth.common.inherited_run_id`).
    """

    def __init__(self, run_dir: str | os.PathLike[str], *, rank: int | None = None,
                 flush_every: int = 100, flush_secs: float = 10.0,
                 max_bytes: int = 256 * 2**20,
                 frequency: dict[str, int] | None = None, run_id: str | None = None) -> None:
        freq = {"scalar": 1, "histogram": 10}
        for key, value in (frequency or {}).items():
            if key not in _FREQ_KEYS:
                close = difflib.get_close_matches(key, _FREQ_KEYS, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {_FREQ_KEYS}"
                raise ConfigError(f"unknown frequency key {key!r}{hint}")
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"frequency[{key!r}] must be an integer >= 1, got {value!r}")
            freq[key] = value
        if flush_every < 1:
            raise ConfigError(f"flush_every must be >= 1, got {flush_every}")
        if max_bytes < 4096:
            raise ConfigError(f"max_bytes must be at least 4096, got {max_bytes}")
        self.frequency = freq
        self.flush_every = flush_every
        self.flush_secs = flush_secs
        self.max_bytes = max_bytes
        self.rank = rank_from_env(rank)
        self.run_id = inherited_run_id() if run_id is None else str(run_id)
        self.path = Path(run_dir) / "summary" / f"rank{self.rank}.h5"
        self.stopped = False
        self._closed = False
        self._tags: dict[str, int] = {}
        self._new_tags: list[str] = []
        self._scalars: list[tuple[int, int, float, float]] = []
        self._hists: list[tuple[int, int, float, Any, Any]] = []
        self._pending_bytes = 0
        self._last_flush = time.monotonic()
        self._file: Any = None
        try:
            self.path = self._choose_path(self.path.parent)
            self._open()
        except (OSError, RuntimeError) as e:
            self._fail(e, f"opening {self.path}")
        atexit.register(self.close)  # records buffered at exit are not lost

    # ---- file ------------------------------------------------------------------------------
    def _choose_path(self, folder: Path) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{self.rank}.h5"
        n = 1
        while path.exists():  # never reopen an existing (maybe crashed) file: new segment
            path = folder / f"rank{self.rank}.seg{n}.h5"
            n += 1
        return path

    def _open(self) -> None:
        import h5py
        dt = _dtypes()
        f = h5py.File(self.path, "w", libver="latest")
        try:
            f.attrs["format_version"] = FORMAT_VERSION
            f.attrs["kind"] = "sleuth.summary"
            f.attrs["rank"] = self.rank
            f.attrs["created"] = datetime.now(timezone.utc).isoformat()
            f.attrs["run_id"] = self.run_id
            # chunks of at most 64 KiB: the size cap is checked on the file's size, which
            # grows a chunk at a time
            for name, chunk in (("tags", 16), ("scalars", 2048), ("hist_index", 1024),
                                ("hist_data", 8192)):
                f.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dt[name],
                                 chunks=(chunk,))
            f.swmr_mode = True  # from here on only appends; the file stays readable
        except Exception:
            f.close()
            raise
        self._file = f

    # ---- API -------------------------------------------------------------------------------
    def add_scalar(self, tag: str, value: float, step: int, wall_time: float | None = None) -> None:
        """Record `value` for `tag` at `step` (kept when step % frequency["scalar"] == 0)."""
        if self.stopped or step % self.frequency["scalar"]:
            return
        self._check_open()
        if hasattr(value, "item"):
            value = value.item()  # a 0-d tensor: this is a device sync, once per scalar
        self._scalars.append((self._tag_id(tag), int(step),
                              time.time() if wall_time is None else float(wall_time), float(value)))
        self._pending_bytes += 28
        self._maybe_flush()

    def add_scalars(self, values: dict[str, float], step: int, wall_time: float | None = None) -> None:
        """Record several scalars at one step."""
        for tag, value in values.items():
            if value is not None:
                self.add_scalar(tag, value, step, wall_time)

    def add_histogram(self, tag: str, values: Any, step: int, bins: int = 64,
                      wall_time: float | None = None) -> None:
        """Record a histogram of the finite entries of `values` (tensor or array-like)."""
        if self.stopped or step % self.frequency["histogram"]:
            return
        self._check_open()
        with own_work("summary"):
            edges, counts = _histogram(values, bins)
        self._hists.append((self._tag_id(tag), int(step),
                            time.time() if wall_time is None else float(wall_time), edges, counts))
        self._pending_bytes += 36 + 8 * (len(edges) + len(counts))
        self._maybe_flush()

    def add_model_histograms(self, model: Any, step: int,
                             kinds: Iterable[str] = ("weights", "grads"), bins: int = 64) -> None:
        """Histograms `weights/{param}` and `grads/{param}` of every parameter of `model`."""
        if self.stopped or step % self.frequency["histogram"]:
            return
        kinds = tuple(kinds)
        bad = [k for k in kinds if k not in ("weights", "grads")]
        if bad:
            raise ConfigError(f"kinds must be among ('weights', 'grads'), got {bad}")
        for name, p in model.named_parameters():
            if "weights" in kinds:
                self.add_histogram(f"weights/{name}", p, step, bins)
            if "grads" in kinds and p.grad is not None:
                self.add_histogram(f"grads/{name}", p.grad, step, bins)

    def flush(self) -> None:
        """Write buffered records and flush the file (no-op once closed)."""
        if self._file is None:
            return
        try:
            self._flush()
        except (OSError, RuntimeError) as e:  # a full disk: h5py raises either
            self._fail(e, f"writing {self.path}")

    def _fail(self, error: BaseException, doing: str) -> None:
        """A failure to write the summary: raised as ProfilerError under SLEUTH_STRICT=1;
        otherwise one `sleuth:` warning, and the writer drops everything from here on."""
        if not strict():  # the run goes on: nothing more is written
            self.stopped = True
            self._scalars, self._hists, self._new_tags = [], [], []
            file, self._file = self._file, None
            if file is not None:
                try:
                    file.close()
                except Exception:  # noqa: BLE001 - the summary is off and said so
                    pass
        go_off(error, tool="summary", off="the summary is off", doing=doing,
               raise_as=ProfilerError, stacklevel=3)

    def _flush(self) -> None:
        import numpy as np
        dt = _dtypes()
        f = self._file
        if self._new_tags:
            self._append(f["tags"], np.array([t.encode() for t in self._new_tags], dtype=dt["tags"]))
            self._new_tags = []
        if self._scalars:
            self._append(f["scalars"], np.array(self._scalars, dtype=dt["scalars"]))
            self._scalars = []
        if self._hists:
            offset = f["hist_data"].shape[0]
            index, chunks = [], []
            for tag, step, wall, edges, counts in self._hists:
                index.append((tag, step, wall, offset, len(counts)))
                chunks.extend((edges, counts))
                offset += len(edges) + len(counts)
            # data before index: a crash between the two leaves unreferenced data, never a
            # dangling index row
            self._append(f["hist_data"], np.concatenate(chunks).astype("<f8"))
            f["hist_data"].flush()
            self._append(f["hist_index"], np.array(index, dtype=dt["hist_index"]))
            self._hists = []
        f.flush()
        self._pending_bytes = 0
        self._last_flush = time.monotonic()
        if not self.stopped and os.path.getsize(self.path) >= self.max_bytes:
            self._stop()

    def close(self) -> None:
        """Flush and close; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        try:
            self.flush()
        finally:
            file, self._file = self._file, None
            if file is not None:
                try:
                    file.close()
                except (OSError, RuntimeError) as e:
                    self._fail(e, f"closing {self.path}")

    def __enter__(self) -> SummaryWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- internals -------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ProfilerError(f"SummaryWriter for {self.path} is closed; create a new one")

    def _tag_id(self, tag: str) -> int:
        tid = self._tags.get(tag)
        if tid is None:
            if len(tag.encode()) > TAG_BYTES:
                raise ConfigError(f"tag {tag[:40]!r}... is longer than {TAG_BYTES} bytes; "
                                  "use a shorter tag")
            tid = self._tags[tag] = len(self._tags)
            self._new_tags.append(tag)
            self._pending_bytes += TAG_BYTES
        return tid

    @staticmethod
    def _append(ds: Any, rows: Any) -> None:
        n = ds.shape[0]
        ds.resize((n + len(rows),))
        ds[n:] = rows
        ds.flush()

    def _maybe_flush(self) -> None:
        if os.path.getsize(self.path) + self._pending_bytes >= self.max_bytes:
            self.flush()
            if not self.stopped:
                self._stop()
            return
        if (len(self._scalars) + len(self._hists) >= self.flush_every
                or time.monotonic() - self._last_flush >= self.flush_secs):
            self.flush()

    def _stop(self) -> None:
        self.stopped = True
        self._scalars, self._hists = [], []
        warnings.warn(
            f"summary {self.path} reached max_bytes={self.max_bytes}: later scalars and "
            "histograms are dropped. Raise the cap with SummaryWriter(..., max_bytes=N) or "
            "SLEUTH_SUMMARY_MAX_BYTES=N, or log less often with frequency={...}.",
            SummaryCapReached, stacklevel=3)


def _histogram(values: Any, bins: int) -> tuple[Any, Any]:
    import numpy as np
    if bins < 1:
        raise ConfigError(f"bins must be >= 1, got {bins}")
    if hasattr(values, "detach"):  # a torch tensor: reduce on its device, move only the counts
        import torch
        if hasattr(values, "to_local"):  # a DTensor (FSDP2): this rank's shard, no collective
            values = values.to_local()
        t = values.detach().flatten().float()
        t = t[torch.isfinite(t)]
        if t.numel() == 0:
            return np.array([0.0, 1.0]), np.array([0.0])
        lo, hi = t.min().item(), t.max().item()
        if lo == hi:
            lo, hi = lo - 0.5, hi + 0.5
        counts = torch.histc(t, bins=bins, min=lo, max=hi).cpu().double().numpy()
        return np.linspace(lo, hi, bins + 1), counts
    arr = np.asarray(values, dtype=np.float64).ravel()
    arr = arr[np.isfinite(arr)]
    if arr.size == 0:
        return np.array([0.0, 1.0]), np.array([0.0])
    lo, hi = float(arr.min()), float(arr.max())
    if lo == hi:
        lo, hi = lo - 0.5, hi + 0.5
    counts, edges = np.histogram(arr, bins=bins, range=(lo, hi))
    return edges, counts.astype(np.float64)
