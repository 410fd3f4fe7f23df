"""Server-side paging of a table built from a file's rows: the DataTable's filter, sort and page
applied to a DataFrame on the server, so the browser gets one page, whatever the file holds.

A step of a million records is hundreds of MB as DataTable rows; native paging would send them
all. With `page_action="custom"` (and custom sort and filter) the table sends its
`page_current`, `page_size`, `sort_by` and `filter_query`, and these pure functions answer with
the rows of that page. The filter language is the one the DataTable's column filters write:
`{col} op value` joined by ` && `, op one of `= != < <= > >= contains` (with an optional `s`/`i`
prefix for case), a bare value meaning `contains` for text and `=` for numbers.
"""
from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import pandas as pd

from dashboard._values import records, text, whole

MAX_PAGE_ROWS = 500
"""The most rows one page may hold, whatever page size a request asks for."""
MAX_QUERY_CHARS = 4000
"""A longer filter query is not applied (the column filters write a few dozen characters)."""

_OPS = ("contains", "datestartswith", ">=", "<=", "!=", "=", "<", ">", "ge", "le", "ne", "eq",
        "lt", "gt")
_WORD_OPS = {"ge": ">=", "le": "<=", "ne": "!=", "eq": "=", "lt": "<", "gt": ">"}
_PART = re.compile(r"^\s*\{(?P<col>[^}]*)\}\s*(?P<op>[si]?(?:" + "|".join(map(re.escape, _OPS)) +
                   r"))(?=\s|$|[-\d'\"`])\s*(?P<value>.*?)\s*$", re.S)
_BARE = re.compile(r"^\s*\{(?P<col>[^}]*)\}\s+(?P<value>\S.*?)\s*$", re.S)


def parse_filter(query: str | None) -> tuple[list[tuple[str, str, bool, Any]], list[str]]:
    """The parts of a DataTable filter query as (column, op, case_insensitive, value), and the
    parts that could not be understood (shown to the user, not applied)."""
    parts: list[tuple[str, str, bool, Any]] = []
    bad: list[str] = []
    if len(query or "") > MAX_QUERY_CHARS:
        return parts, [f"a filter of {len(query or ''):,} characters (at most {MAX_QUERY_CHARS:,})"]
    for raw in (query or "").split(" && "):
        if not raw.strip():
            continue
        m = _PART.match(raw)
        if m is None:
            bare = _BARE.match(raw)
            if bare is None:
                bad.append(raw.strip())
            else:  # no operator: the column's type decides (contains text, equals a number)
                value = _value(bare.group("value"))
                parts.append((bare.group("col"), "=" if isinstance(value, float) else "contains",
                              False, value))
            continue
        op = m.group("op")
        insensitive = op[0] == "i" and op[1:] in _OPS
        if op[0] in "si" and op[1:] in _OPS:
            op = op[1:]
        op = _WORD_OPS.get(op, op)
        parts.append((m.group("col"), op, insensitive, _value(m.group("value"))))
    return parts, bad


def _value(text: str) -> Any:
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"`":
        q = text[0]
        return text[1:-1].replace("\\" + q, q)
    try:
        return float(text)
    except ValueError:
        return text


def filter_frame(df: pd.DataFrame, query: str | None) -> tuple[pd.DataFrame, list[str]]:
    """The rows of `df` that match `query`, and the parts of it that were not understood (or
    named no column of the table)."""
    parts, bad = parse_filter(query)
    mask = pd.Series(True, index=df.index)
    for col, op, insensitive, value in parts:
        if col not in df:
            bad.append(f"{{{col}}}: no such column")
            continue
        mask &= _match(df[col], op, insensitive, value)
    return df[mask], bad


def _match(col: pd.Series, op: str, insensitive: bool, value: Any) -> pd.Series:
    numeric = pd.api.types.is_numeric_dtype(col) and not pd.api.types.is_bool_dtype(col)
    if op in ("contains", "datestartswith"):
        text = col.astype(str)
        needle = str(value if not isinstance(value, float) or not value.is_integer() else int(value))
        if op == "datestartswith":
            return text.str.startswith(needle)
        return text.str.contains(needle, case=not insensitive, regex=False)
    if numeric and isinstance(value, float):
        left: Any = pd.to_numeric(col, errors="coerce")
        right: Any = value
    else:
        left = col.astype(str)
        right = str(value if not isinstance(value, float) or not value.is_integer() else int(value))
        if insensitive:
            left, right = left.str.lower(), right.lower()
    return {"=": left == right, "!=": left != right, "<": left < right, "<=": left <= right,
            ">": left > right, ">=": left >= right}[op].fillna(False).astype(bool)


def sort_frame(df: pd.DataFrame, sort_by: Sequence[dict[str, Any]] | None) -> pd.DataFrame:
    """`df` sorted as the DataTable's `sort_by` asks ([{column_id, direction}]), missing values
    last; a column of mixed types sorts by its text."""
    keys = [(s.get("column_id"), s.get("direction") != "desc") for s in records(sort_by)
            if text(s.get("column_id")) in df]
    if not keys:
        return df
    cols, ascending = [k for k, _ in keys], [a for _, a in keys]
    try:
        return df.sort_values(cols, ascending=ascending, kind="stable", na_position="last")
    except TypeError:
        return df.sort_values(cols, ascending=ascending, kind="stable", na_position="last",
                              key=lambda c: c.astype(str))


def page_of(df: pd.DataFrame, page_current: Any, page_size: Any) -> tuple[pd.DataFrame, int, int]:
    """One page of `df`: (rows, page_count, page index shown). The page size is capped at
    `MAX_PAGE_ROWS` and the index clamped to the pages there are, so no request can ask for
    more than one bounded page."""
    size = whole(page_size)
    size = min(max(25 if size is None else size, 1), MAX_PAGE_ROWS)
    count = max(1, math.ceil(len(df) / size))
    page = min(whole(page_current) or 0, count - 1)
    return df.iloc[page * size:(page + 1) * size], count, page
