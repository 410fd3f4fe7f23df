"""One saved Chrome trace: read within a size bound, and its host events nested by thread.

`load_trace` reads the file a window saved; `_Ev` is one complete event and `_nest` links each
host event to the innermost event around it on its thread and fills its self time, which the
tables (profiler._tables), the FLOP count (profiler._flops) and the tool-time split
(profiler._own) read. Times are microseconds, as in the trace.

torch.profiler defects handled here:
- ranges overlap without nesting: a `record_function` range (category `user_annotation`)
  opened by an op that a Python dispatch mode intercepts begins inside that mode's
  `PythonDispatchMode` event and outlives it. Such a range is nested in the innermost event
  that holds all of it, not in the one it crosses, and self time subtracts the union of the
  children, so that event's self time does not come out negative;
- self time can still come out negative when a child's clock reading overlaps its parent's end
  (pytorch/pytorch#101861, #128479): durations and self times are clamped at 0 and `_nest`
  returns the number of clamped events (the tables' `clamped_events`).
"""
from __future__ import annotations

import gzip
import json
import os
import re
import zlib
from collections import defaultdict
from pathlib import Path
from typing import Any

from profiler._errors import ProfileFormatError

_STEP_RE = re.compile(r"^ProfilerStep#(\d+)$")


MAX_TRACE_BYTES = 2 * 1024 ** 3
"""The largest trace read, after decompression: a gzip of a few MB can claim many GB."""
MAX_TRACE_RATIO = 100
"""How many times its size a gzipped trace may inflate to (past its first MiB): a trace's JSON
deflates about 13-fold, a gzip bomb of zeros 1000-fold, so a 2 MB bomb is refused after about
200 MB read, never at the 2 GiB bound."""
_PIECE = 1 << 20


def load_trace(path: str | Path) -> dict[str, Any]:
    """Read a Chrome trace (`.json` or `.json.gz`); raise ProfileFormatError when unreadable,
    larger than MAX_TRACE_BYTES once decompressed, or nested past the JSON reader's depth."""
    path = Path(path)
    try:
        from tracer import UntrustedFileError
        from tracer.storage import open_regular

        try:
            file = open_regular(path)  # a FIFO or a device is refused, never waited on
        except UntrustedFileError as e:
            raise ProfileFormatError(f"cannot read trace {e}") from e
        with file:
            raw = _read_bounded(file, path)
        data = json.loads(raw.decode("utf-8"))
    except RecursionError as e:
        raise ProfileFormatError(f"cannot read trace {path}: JSON nested too deep") from e
    except (OSError, EOFError, zlib.error, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ProfileFormatError(f"cannot read trace {path}: {e}") from e
    if isinstance(data, list):  # the bare-array Chrome format is valid too
        data = {"traceEvents": data}
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise ProfileFormatError(f"{path} is not a Chrome trace (no traceEvents list)")
    return data


def _read_bounded(file: Any, path: Path) -> bytes:
    """The bytes of the trace open as `file` (inflated when `path` ends in `.gz`), refused as
    soon as they pass what the file can hold: MAX_TRACE_BYTES, and for a gzip MAX_TRACE_RATIO
    times its size and the inflated size its trailer states. Checked while reading, a piece at
    a time, so a bomb costs the bound, never its claim."""
    size = os.fstat(file.fileno()).st_size
    if not path.name.endswith(".gz"):
        if size > MAX_TRACE_BYTES:
            raise ProfileFormatError(f"{path}: {size:,} bytes, more than the "
                                     f"{MAX_TRACE_BYTES:,} bytes a trace may hold; this is not "
                                     f"a trace sleuth wrote")
        raw = file.read(MAX_TRACE_BYTES + 1)
        if len(raw) > MAX_TRACE_BYTES:  # grew as it was read
            raise ProfileFormatError(f"{path}: more than {MAX_TRACE_BYTES:,} bytes of trace; "
                                     f"this is not a trace sleuth wrote")
        return raw
    stated = None
    if size >= 18:  # header and trailer: the trailer's last 4 bytes are the size mod 2**32
        file.seek(size - 4)
        stated = int.from_bytes(file.read(4), "little")
        file.seek(0)
    by_ratio = max(_PIECE, MAX_TRACE_RATIO * size)
    limit = min(MAX_TRACE_BYTES, by_ratio)
    out = bytearray()
    with gzip.GzipFile(fileobj=file) as f:
        while piece := f.read(_PIECE):
            out += piece
            if stated is not None and len(out) > stated and stated + 2**32 > limit:
                raise ProfileFormatError(
                    f"{path}: inflates past the {stated:,} bytes its gzip trailer states; the "
                    f"file is damaged or forged and was read no further")
            if len(out) > limit:
                why = (f"more than {MAX_TRACE_BYTES:,} bytes" if limit == MAX_TRACE_BYTES else
                       f"more than {MAX_TRACE_RATIO} times its size ({size:,} bytes "
                       f"compressed), where a trace deflates about 13-fold")
                raise ProfileFormatError(
                    f"{path}: inflates to {why}: a gzip bomb, not a trace sleuth wrote; it was "
                    f"read no further (the bound is checked while reading): move it out of the "
                    f"run")
    return bytes(out)


class _Ev:
    """One complete ("X") event with its nesting on its thread."""

    __slots__ = ("name", "cat", "ts", "end", "dur", "tid", "args", "children", "parent", "self_us")

    def __init__(self, e: dict[str, Any]) -> None:
        self.name = str(e.get("name", ""))
        self.cat = str(e.get("cat", ""))
        self.ts = float(e.get("ts", 0.0))
        self.dur = max(0.0, float(e.get("dur", 0.0) or 0.0))
        self.end = self.ts + self.dur
        self.tid = (e.get("pid"), e.get("tid"))
        self.args = e.get("args") or {}
        self.children: list[_Ev] = []
        self.parent: _Ev | None = None
        self.self_us = self.dur


def _nest(events: list[_Ev]) -> int:
    """Link each host event to its innermost enclosing event on the same thread; fill self_us.

    Returns how many self times had to be clamped at 0.
    """
    by_thread: dict[Any, list[_Ev]] = defaultdict(list)
    for ev in events:
        by_thread[ev.tid].append(ev)
    clamped = 0
    for evs in by_thread.values():
        evs.sort(key=lambda x: (x.ts, -x.dur))
        stack: list[_Ev] = []
        for ev in evs:
            while stack and stack[-1].end <= ev.ts:
                stack.pop()
            if ev.cat == "user_annotation":
                # a range: nested in the innermost open event that holds it whole; one it only
                # crosses stays open below it (later events start after it ended)
                parent = next((p for p in reversed(stack) if p.end >= ev.end), None)
            else:  # an op running past its parent's end is clock skew: still its child
                parent = stack[-1] if stack else None
            if parent is not None:
                ev.parent = parent
                parent.children.append(ev)
            stack.append(ev)
        for ev in evs:
            # a union: a crossing range and the event it crossed are siblings that overlap
            child = _union_us([(c.ts, min(c.end, ev.end)) for c in ev.children])
            self_us = ev.dur - child
            if self_us < 0:
                clamped += 1
                self_us = 0.0
            ev.self_us = self_us
    return clamped


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def _ancestors(ev: _Ev):
    p = ev.parent
    while p is not None:
        yield p
        p = p.parent
