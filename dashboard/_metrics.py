"""metrics.jsonl (and metrics.rank{R}.jsonl) read for the Scalars page: incrementally, in
bounded chunks, and without trusting a line.

A run that is still training appends lines, so only the new complete lines are parsed on each
refresh. The file is whatever its writer (or anyone who can write into the run folder) left
there, so a line that is not a JSON object, is longer than any metrics line, or nests deeper
than `tracer.storage`'s limit is skipped and counted (the page says how many, and where the
first one is), never a server error; pyarrow's fast parser never sees a deeply nested line (it
crashes the process on one); and at most `MAX_BYTES` of a file are read.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

MAX_BYTES = 256 << 20
"""The most of one metrics file that is read: about two million steps of the trainer's lines.
Beyond it the page shows the first part and says so."""
CHUNK_BYTES = 32 << 20
"""Bytes parsed at a time, so the transient memory of a parse stays near this."""
LINE_MAX_BYTES = 1 << 20
"""A line longer than this is skipped: the trainer's lines are a few hundred bytes."""

# Column names the trainer may use for wall-clock time, in order of preference.
TIME_COLUMNS = ("wall_time", "time", "timestamp")
_NOT_SERIES = {"step", "rank", "epoch", "micro_step", *TIME_COLUMNS}


class JsonlTail:
    """One metrics file read so far: the rows, which keys each row had (`present`, so an eval
    line {"step": 4, "eval_loss": ...} does not punch a NaN hole into `loss`, while a logged NaN
    loss stays a NaN), and the lines that were skipped."""

    def __init__(self) -> None:
        self.offset = 0
        """Bytes consumed: complete lines only."""
        self.lines = 0
        """Complete lines consumed (to number the skipped ones)."""
        self.frame = pd.DataFrame()
        self.present = pd.DataFrame()
        self.skipped = 0
        """Lines skipped as malformed."""
        self.first_bad: str | None = None
        """'line N: why' of the first skipped line."""

    def update(self, path: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
        """Parse the complete lines appended since the last call (up to `MAX_BYTES` in all)."""
        from tracer import UntrustedFileError
        from tracer.storage import open_regular

        self._new: list[tuple[pd.DataFrame, pd.DataFrame]] = []
        try:
            file = open_regular(path)  # a FIFO would hold the page forever
        except UntrustedFileError as e:
            raise OSError(str(e)) from e
        with file as f:
            while self.offset < MAX_BYTES:
                f.seek(self.offset)
                want = min(CHUNK_BYTES, MAX_BYTES - self.offset)
                chunk = f.read(want)
                end = chunk.rfind(b"\n") + 1
                if end:
                    self._add(chunk[:end])
                    self.offset += end
                elif len(chunk) == want == CHUNK_BYTES:  # one line longer than a whole chunk
                    rest = _bytes_to_newline(f)
                    if rest is None:
                        break  # still being written
                    self.offset += len(chunk) + rest
                    self.lines += 1
                    self._bad(self.lines, f"longer than {LINE_MAX_BYTES:,} bytes")
                    continue
                if len(chunk) < want or not end:
                    break  # the end of the file, or a half-written last line: the next refresh
        if self._new:  # one concatenation per refresh, however many chunks it read
            frames = [self.frame] if len(self.frame.columns) else []
            presents = [self.present] if len(self.present.columns) else []
            self.frame = pd.concat(frames + [f for f, _ in self._new], ignore_index=True)
            present = pd.concat(presents + [p for _, p in self._new], ignore_index=True)
            self.present = present.fillna(False).astype(bool)
        return self.frame, self.present

    def _add(self, data: bytes) -> None:
        frame, present, bad, n = parse_jsonl(data)
        for line, why in bad:
            self._bad(self.lines + line, why)
        self.lines += n
        if len(frame.columns):
            self._new.append((frame, present))

    def _bad(self, line: int, why: str) -> None:
        self.skipped += 1
        if self.first_bad is None:
            self.first_bad = f"line {line}: {why}"


def _bytes_to_newline(f) -> int | None:
    """Read on to the next newline; the bytes read including it, or None at the end of file."""
    n = 0
    while block := f.read(1 << 20):
        i = block.find(b"\n")
        if i >= 0:
            return n + i + 1
        n += len(block)
    return None


_CAREFUL_OPENS = 32
"""A line that opens more arrays/objects than this is parsed by `tracer.storage.loads_bounded`
(which refuses nesting past its depth limit), never by pyarrow; a metrics line opens one."""


def _suspect_lines(data: bytes) -> np.ndarray:
    """Per line of `data` (which ends with a newline): True when it is longer than
    `LINE_MAX_BYTES` or opens more than `_CAREFUL_OPENS` arrays/objects, so that only those
    lines pay for the careful (bounded) parse. Vectorised: a few passes over the bytes."""
    arr = np.frombuffer(data, np.uint8)
    ends = np.flatnonzero(arr == 10)
    starts = np.concatenate(([0], ends[:-1] + 1))
    opens = np.add.reduceat((arr == 91) | (arr == 123), starts, dtype=np.int64)  # '[' '{'
    return (opens > _CAREFUL_OPENS) | (ends - starts > LINE_MAX_BYTES)


def parse_jsonl(data: bytes) -> tuple[pd.DataFrame, pd.DataFrame, list[tuple[int, str]], int]:
    """Rows of complete JSON lines (`data` ends with a newline): the frame, a same-shaped frame
    saying which keys each line had, the skipped lines as (1-based line, why), and the number
    of lines."""
    suspect = _suspect_lines(data)
    n = len(suspect)
    if not suspect.any():
        try:
            import pyarrow as pa
            import pyarrow.json as pj

            table = pj.read_json(pa.BufferReader(data))
            present = pd.DataFrame({name: table.column(name).is_valid().to_numpy(zero_copy_only=False)
                                    for name in table.column_names})
            return table.to_pandas(), present, [], n
        except Exception:  # noqa: BLE001 - NaN/Infinity literals, mixed types, a bad line: the lenient path
            pass
    rows, bad = _lenient_rows(data, suspect)
    frame = pd.DataFrame.from_records(rows)
    present = pd.DataFrame([{k: True for k in r} for r in rows], columns=frame.columns)
    return frame, present.fillna(False).astype(bool), bad, n


def _lenient_rows(data: bytes, suspect: np.ndarray) -> tuple[list[dict], list[tuple[int, str]]]:
    from tracer.storage import JsonLimitError, loads_bounded

    rows: list[dict] = []
    bad: list[tuple[int, str]] = []
    for i, line in enumerate(data.split(b"\n")[:-1]):
        if not line.strip():
            continue
        try:
            if len(line) > LINE_MAX_BYTES:
                raise ValueError(f"longer than {LINE_MAX_BYTES:,} bytes")
            if suspect[i]:
                row = loads_bounded(line.decode("utf-8"), "this line")
            else:
                row = json.loads(line)
        except json.JSONDecodeError as e:
            bad.append((i + 1, f"invalid JSON ({e.msg} at column {e.colno})"))
            continue
        except (JsonLimitError, ValueError) as e:  # UnicodeDecodeError is a ValueError
            bad.append((i + 1, str(e).removeprefix("this line: ")))
            continue
        if not isinstance(row, dict):
            bad.append((i + 1, f"not a JSON object (a {type(row).__name__})"))
            continue
        rows.append(row)
    return rows, bad


def series_from_wide(df: pd.DataFrame, present: pd.DataFrame | None = None) -> dict[str, pd.DataFrame]:
    """Wide rows (step, loss, lr, ...) to one [step, wall_time, value] frame per numeric column,
    each from the rows that carry that key (`present`; all rows when None). Rows whose step is
    not a number (a header line, a forged value) are left out."""
    if df.empty or "step" not in df:
        return {}
    step = pd.to_numeric(df["step"], errors="coerce")
    keep = step.notna()
    df = df[keep].assign(step=step[keep].astype(np.float64))
    order = df.sort_values("step", kind="stable").index
    df = df.loc[order]
    present = present.loc[order] if present is not None else None
    steps = df["step"].to_numpy(dtype=np.float64)
    wall = None
    for col in TIME_COLUMNS:
        if col in df:
            w = pd.to_numeric(df[col], errors="coerce").to_numpy(dtype=np.float64)
            wall = w - (np.nanmin(w) if np.isfinite(w).any() else 0.0)
            break
    if wall is None and "step_time_s" in df:
        wall = np.nancumsum(pd.to_numeric(df["step_time_s"], errors="coerce").to_numpy(np.float64))
    if wall is None:
        wall = np.full(len(df), np.nan)
    out = {}
    for col in df.columns:
        if col in _NOT_SERIES:
            continue
        texts: list[int] = []
        if pd.api.types.is_numeric_dtype(df[col]):
            values = df[col].to_numpy(dtype=np.float64)
        else:  # one value written as text ("nan") must not make the whole series vanish
            values, texts = _numbers(df[col])
            if values is None:
                continue  # no number at all: a text column (a phase, a name)
        rows = present[col].to_numpy(bool) if present is not None and col in present else slice(None)
        frame = pd.DataFrame({"step": steps[rows], "wall_time": wall[rows], "value": values[rows]})
        if texts:
            first = df[col].iloc[texts[0]]
            frame.attrs["text_values"] = (len(texts), repr(first)[:40], float(steps[texts[0]]))
        out[str(col)] = frame
    return out


def _numbers(column: pd.Series) -> tuple[np.ndarray | None, list[int]]:
    """A column of mixed values as float64: numbers as they are, text as the number it spells
    ("nan", "1e-3") or NaN (a gap); the positions of the values that were not numbers. None
    when the column holds no number at all."""
    values = np.full(len(column), np.nan)
    texts: list[int] = []
    found = False
    for i, v in enumerate(column.to_numpy(dtype=object)):
        if v is None or (isinstance(v, float) and v != v):
            continue  # missing: the row does not carry this key
        if isinstance(v, (bool, int, float, np.number)):
            values[i], found = float(v), True
            continue
        texts.append(i)
        if isinstance(v, str):
            try:
                values[i], found = float(v), True
            except ValueError:
                pass
    return (values if found else None), texts
