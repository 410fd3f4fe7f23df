"""The flight recorder's writer: the statistics rows of the last few steps, kept in memory while
tracing and written to `RUN/dump/rank{R}/flight_recorder.h5` when a watchpoint stops the run, on
an uncaught exception, or on SIGTERM, so that a crashed run still tells what led to the crash.

It is a row sink of the writer (one tuple append per record, no tensor bytes), or an observer
of writers without sinks. It hears of the crash from the tracer's crash hooks (tracer._crash),
after every Dumper has written its open step; `_flight_reader.py` reads the file back.
"""
from __future__ import annotations

import collections
import datetime as _dt
import json
import os
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np

from sleuth.common import warn
from tracer._crash import CrashListener, on_crash
from tracer.storage._format import RECORD_FIELDS

FORMAT_VERSION = "1.0"
DEFAULT_STEPS = 3
ENV_STEPS = "SLEUTH_FLIGHT_STEPS"  # 0 switches the recorder off
STR_COLS = ("name", "module", "op", "phase", "direction", "dtype", "shape", "source")
_INT_COLS = ("step", "seq", "index", "call", "numel", "nan", "posinf", "neginf", "zeros",
             "checksum")
_FLOAT_COLS = ("min", "max", "mean", "norm")
_COLS = _INT_COLS[:2] + STR_COLS + _INT_COLS[2:] + _FLOAT_COLS


class FlightRecorder:
    """A ring buffer of the statistics rows of the last `steps` steps."""

    def __init__(self, path: str | os.PathLike, *, steps: int = DEFAULT_STEPS, rank: int = 0,
                 step_of: Any = None) -> None:
        self.path = Path(path)
        self.rank = rank
        # (step, its rows: tuples or dicts) of the newest steps
        self.steps: collections.deque[tuple[int, list[Any]]] = collections.deque(maxlen=steps)
        self._step_of = step_of  # callable giving the current step when rows do not carry it
        self._lock = threading.Lock()
        self._current: tuple[int, list] | None = None  # the newest entry of `steps`
        self._listener: CrashListener | None = None
        self.saved: Path | None = None

    @property
    def keeps(self) -> bool:
        """Whether it keeps steps (and so writes a file)."""
        return bool(self.steps.maxlen)

    # -- observer -------------------------------------------------------------------------------
    def __call__(self, row: dict[str, Any]) -> None:
        """Keep a row dict (the observer API, for writers without `row_sinks`)."""
        step = row.get("step")
        if step is None and self._step_of is not None:
            step = self._step_of()
        self._keep(-1 if step is None else int(step), row)

    def add_row(self, row: tuple, step: int) -> None:
        """Keep a /records row tuple (a tracer writer's `row_sinks`: no dict per record)."""
        current = self._current
        if current is not None and current[0] == step:  # `_keep`'s common case, inline
            current[1].append(row)
        else:
            self._keep(step, row)

    def _keep(self, step: int, row: Any) -> None:
        current = self._current
        if current is None or current[0] != step:
            with self._lock:
                if not self.steps or self.steps[-1][0] != step:
                    self.steps.append((step, []))
                current = self._current = self.steps[-1]
        # Writers hand over a fresh dict or an immutable tuple, so keeping it is safe, and it is
        # the cheapest thing to do on every record; rows become tables only when saved. A list
        # append needs no lock (atomic under the GIL; `rows()` copies under the lock).
        current[1].append(row)

    def rows(self) -> list[tuple]:
        where = {c: RECORD_FIELDS.index(c) for c in _COLS if c != "step"}
        with self._lock:
            kept = [(step, row) for step, rows in self.steps for row in rows]
        return [tuple(step if c == "step" else _cell(
                    row[where[c]] if isinstance(row, tuple) else row.get(c), c) for c in _COLS)
                for step, row in kept]

    # -- writing --------------------------------------------------------------------------------
    def save(self, reason: str) -> Path:
        """Write the buffered rows atomically; returns the file path."""
        import h5py

        rows = self.rows()
        str_dt = h5py.string_dtype("utf-8")
        dtype = np.dtype([(c, str_dt if c in STR_COLS else np.float64 if c in _FLOAT_COLS
                           else np.int64) for c in _COLS])
        table = np.array(rows, dtype=dtype)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(self.path.name + ".partial")
        try:
            with h5py.File(partial, "w") as f:
                f.attrs["format_version"] = FORMAT_VERSION
                f.attrs["rank"] = int(self.rank)
                f.attrs["reason"] = reason
                f.attrs["created"] = _dt.datetime.now(_dt.timezone.utc).isoformat(
                    timespec="seconds")
                f.attrs["steps"] = json.dumps([s for s, _ in self.steps])
                f.create_dataset("records", data=table)
            fd = os.open(partial, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(partial, self.path)
        except BaseException:
            # (a full disk): no half-written file left beside the step files
            try:
                partial.unlink()
            except OSError:
                pass
            raise
        self.saved = self.path
        return self.path

    # -- the crash ------------------------------------------------------------------------------
    def install(self) -> FlightRecorder:
        """Save on a crash (tracer._crash), after the Dumpers wrote their open steps."""
        if self._listener is None:
            self._listener = on_crash(self._crashed, last=True)
        return self

    def remove(self) -> None:
        """Stop listening for a crash; idempotent."""
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.remove()

    def __enter__(self) -> FlightRecorder:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def _crashed(self, reason: str) -> None:
        # (a watchpoint that stopped the run may have written it already, with its reason)
        if self.saved is not None or not self.keeps:
            return
        try:
            path = self.save(reason=reason if reason == "SIGTERM" else f"uncaught {reason}")
            print(f"sleuth: flight recorder written to {path}", file=sys.stderr)
        except Exception as e:  # noqa: BLE001 - never hide the original error
            print(f"sleuth: could not write the flight recorder: {e}", file=sys.stderr)


def _cell(v: Any, col: str) -> Any:
    if col in STR_COLS:
        return "" if v is None else str(v)
    if col in _FLOAT_COLS:
        return float("nan") if v is None else float(v)
    return -1 if v is None else int(v)


def flight_steps() -> int:
    """The steps a flight recorder keeps: $SLEUTH_FLIGHT_STEPS, else 3; 0 (or a value that is
    not a whole number, warned about) keeps none."""
    text = os.environ.get(ENV_STEPS, "").strip()
    if not text:
        return DEFAULT_STEPS
    try:
        return max(0, int(text))
    except ValueError:
        warn(f"{ENV_STEPS}={text!r} is not a whole number: no flight recorder for this run "
             f"(set it to the number of steps to keep, e.g. {DEFAULT_STEPS}, or 0 for none)",
             stacklevel=3)
        return 0


def install_flight_recorder(writer: Any, config: Any, *, rank: int | None = None,
                            steps: int | None = None) -> FlightRecorder | None:
    """Attach a flight recorder to `writer` (its `row_sinks`, else its `observers`) for the run
    directory of `config` (DumpConfig). Steps kept: `steps`, else `flight_steps()`; with none to
    keep there is no recorder (None). The Dumper's own crash hooks write the open step either
    way."""
    if steps is None:
        steps = flight_steps()
    steps = max(0, steps)
    if rank is None:
        rank = int(getattr(writer, "rank", 0) or 0)
    path = _recorder_path(config, rank)
    if not steps:
        disarm_flight_recorder(config, rank)
        return None
    # The recorder outlives its writer on purpose: `with Dumper(...)` closes the writer before
    # an exception escaping the block reaches sys.excepthook. One recorder per file, so a
    # second Dumper on the same run reuses the hooks instead of chaining them again.
    recorder = _RECORDERS.get(path)
    if recorder is None:
        recorder = _RECORDERS[path] = FlightRecorder(path, steps=steps, rank=rank)
    else:
        recorder.steps = collections.deque(maxlen=steps)
        recorder.saved = None
    recorder._step_of = lambda: getattr(writer, "step", None)
    sinks = getattr(writer, "row_sinks", None)
    if sinks is not None:  # a tracer writer: row tuples, no dict per record
        sinks.append(recorder.add_row)
    else:
        writer.observers.append(recorder)
    return recorder.install()


def disarm_flight_recorder(config: Any, rank: int) -> None:
    """Take the recorder of `config`'s run and `rank` off the crash hooks: its Dumper closed
    with no exception in flight, so a later SIGTERM or crash of the process (a notebook, a
    dashboard served from the same process) has nothing of this run to report and must not
    write a flight recorder file into it."""
    recorder = _RECORDERS.pop(_recorder_path(config, rank), None)
    if recorder is not None:
        recorder.remove()


def _recorder_path(config: Any, rank: int) -> Path:
    run_dir = config.run_dir() if hasattr(config, "run_dir") else Path(
        os.environ.get("SLEUTH_RUN_DIR", "./sleuth_run"))
    return Path(run_dir).resolve() / "dump" / f"rank{rank}" / "flight_recorder.h5"


_RECORDERS: dict[Path, FlightRecorder] = {}
