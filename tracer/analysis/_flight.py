"""The flight recorder: the statistics rows of the last few steps, kept in memory while tracing
and written to `RUN/dump/rank{R}/flight_recorder.h5` when a watchpoint stops the run, on an
uncaught exception, or on SIGTERM, so that a crashed run still tells what led to the crash.

It is a row sink of the writer (one tuple append per record, no tensor bytes), or an observer
of writers without sinks. The previous
`sys.excepthook` and SIGTERM handler are chained, not replaced, and restored by `remove()`.
These hooks are the tracer's only crash hooks: a Dumper hears of the crash through them
(`on_crash`) and writes its open step, marked interrupted, before the recorder's file is saved
and the previous hook or handler runs.
"""
from __future__ import annotations

import collections
import datetime as _dt
import itertools
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import numpy as np

FORMAT_VERSION = "1.0"
DEFAULT_STEPS = 3
ENV_STEPS = "SLEUTH_FLIGHT_STEPS"  # 0 switches the recorder off
_STR_COLS = ("name", "module", "op", "phase", "direction", "dtype", "shape", "source")
_INT_COLS = ("step", "seq", "index", "call", "numel", "nan", "posinf", "neginf", "zeros",
             "checksum")
_FLOAT_COLS = ("min", "max", "mean", "norm")
_COLS = _INT_COLS[:2] + _STR_COLS + _INT_COLS[2:] + _FLOAT_COLS


_listeners: dict[int, Callable[[str], None]] = {}
_listener_keys = itertools.count()


class CrashListener:
    """Handle of an `on_crash` callback; `remove()` is idempotent."""

    def __init__(self, key: int) -> None:
        self._key = key

    def remove(self) -> None:
        _listeners.pop(self._key, None)

    def __enter__(self) -> CrashListener:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def on_crash(callback: Callable[[str], None]) -> CrashListener:
    """Call `callback(reason)` when an installed flight recorder's hooks see the process die:
    an uncaught exception ("KeyError: 'x'") or SIGTERM ("SIGTERM"), before the recorder saves
    and the previous hook or handler runs. Exceptions of the callback are printed, never
    raised: they must not hide the crash."""
    key = next(_listener_keys)
    _listeners[key] = callback
    return CrashListener(key)


def _notify(reason: str) -> None:
    for callback in tuple(_listeners.values()):
        try:
            callback(reason)
        except Exception as e:  # noqa: BLE001 - never hide the original error
            print(f"sleuth: while the process died ({reason}): {e}", file=sys.stderr)


def describe_exception(value: BaseException) -> str:
    """ "ValueError: bad", or the type alone when the message is empty ("KeyboardInterrupt")."""
    text = str(value)
    return f"{type(value).__name__}: {text}" if text else type(value).__name__


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
        self._prev_hook: Any = None
        self._prev_sigterm: Any = None
        self._installed = False
        self.saved: Path | None = None
        # a forked child (a DataLoader worker) inherits the hooks and a copy of the rows: only
        # the process that made the recorder writes its file
        self._owner = os.getpid()

    @property
    def keeps(self) -> bool:
        """Whether it keeps steps (and so writes a file); with 0 it only runs the crash hooks."""
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
        from tracer.storage import RECORD_FIELDS

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
        dtype = np.dtype([(c, str_dt if c in _STR_COLS else np.float64 if c in _FLOAT_COLS
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

    # -- crash hooks ----------------------------------------------------------------------------
    def install(self) -> FlightRecorder:
        """Chain into sys.excepthook and the SIGTERM handler (main thread only for signals)."""
        if self._installed:
            return self
        self._installed = True
        self._prev_hook = sys.excepthook
        sys.excepthook = self._excepthook
        if threading.current_thread() is threading.main_thread():
            try:
                self._prev_sigterm = signal.signal(signal.SIGTERM, self._sigterm)
            except (ValueError, OSError):  # not allowed here (embedded interpreters)
                self._prev_sigterm = None
        return self

    def remove(self) -> None:
        """Restore the previous hooks if they are still ours; idempotent."""
        if not self._installed:
            return
        self._installed = False
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._prev_hook
        if self._prev_sigterm is not None:
            try:
                if signal.getsignal(signal.SIGTERM) == self._sigterm:
                    signal.signal(signal.SIGTERM, self._prev_sigterm)
            except (ValueError, OSError):
                pass

    def __enter__(self) -> FlightRecorder:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def _excepthook(self, etype: Any, value: Any, tb: Any) -> None:
        if os.getpid() == self._owner:
            _notify(describe_exception(value) if isinstance(value, BaseException)
                    else etype.__name__)
        try:
            if self.saved is None and os.getpid() == self._owner and self.keeps:
                # (a watchpoint may have written it already, with its reason)
                path = self.save(reason=f"uncaught {etype.__name__}: {value}")
                print(f"sleuth: flight recorder written to {path}", file=sys.stderr)
        except Exception as e:  # noqa: BLE001 - never hide the original error
            print(f"sleuth: could not write the flight recorder: {e}", file=sys.stderr)
        (self._prev_hook or sys.__excepthook__)(etype, value, tb)

    def _sigterm(self, signum: int, frame: Any) -> None:
        if os.getpid() == self._owner:
            _notify("SIGTERM")
        try:
            if os.getpid() == self._owner and self.keeps:
                path = self.save(reason="SIGTERM")
                print(f"sleuth: flight recorder written to {path}", file=sys.stderr)
        except Exception as e:  # noqa: BLE001
            print(f"sleuth: could not write the flight recorder: {e}", file=sys.stderr)
        prev = self._prev_sigterm
        if callable(prev):
            prev(signum, frame)
        elif prev == signal.SIG_IGN:
            return
        else:  # default action: die by the signal, as the run would have without us
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)


def _cell(v: Any, col: str) -> Any:
    if col in _STR_COLS:
        return "" if v is None else str(v)
    if col in _FLOAT_COLS:
        return float("nan") if v is None else float(v)
    return -1 if v is None else int(v)


def read_flight_recorder(path: str | os.PathLike) -> Any:
    """The rows of a flight recorder file as a DataFrame; `.attrs` holds reason and rank."""
    import pandas as pd

    from tracer.storage import open_h5

    with open_h5(path) as f:  # refuses links out of the file and claims past its size
        table = f["records"][()]
        attrs = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in f.attrs.items()}
    df = pd.DataFrame({c: table[c] for c in table.dtype.names})
    for c in _STR_COLS:
        df[c] = [x.decode() if isinstance(x, bytes) else x for x in df[c]]
    df.attrs.update(attrs)
    return df


def install_flight_recorder(writer: Any, config: Any, *, rank: int | None = None,
                            steps: int | None = None) -> FlightRecorder | None:
    """Attach a flight recorder to `writer` (its `row_sinks`, else its `observers`) for the run
    directory of `config` (DumpConfig). Steps kept: `steps`, else $SLEUTH_FLIGHT_STEPS, else 3;
    with 0 it keeps and writes nothing, but its crash hooks still run the `on_crash` listeners."""
    if steps is None:
        steps = int(os.environ.get(ENV_STEPS, DEFAULT_STEPS))
    # with no steps to keep the hooks still go in: they tell the Dumper that the process is
    # dying, so the open step is written, marked interrupted (`on_crash`)
    steps = max(0, steps)
    if rank is None:
        rank = int(getattr(writer, "rank", 0) or 0)
    path = _recorder_path(config, rank)
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
    if not steps:
        pass
    elif sinks is not None:  # a tracer writer: row tuples, no dict per record
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
