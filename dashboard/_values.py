"""What a callback takes from the client, checked and converted in one place.

A Dash callback is an HTTP endpoint: anyone who can reach the server can post it any JSON, not
only the values the page's controls send (a dropdown's options, a table's cell, a graph's click).
Every value a callback reads from the client goes through one of these converters, which answer
the Python value the callback expects, or "no value" (None, or an empty list) for anything else:
the callback then shows what it shows when nothing is chosen (its empty state), as the page
does before the user picks. Only numbers typed into a field (`typed_whole`) are a user's
mistake to name: they raise `BadValueError` with one line saying what the field takes."""
from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any

from dashboard._errors import BadValueError

MAX_WHOLE = 2**31 - 1
"""The largest index a callback takes (a run, rank, step, stage or page): far past any real one,
and small enough that no reader is asked for a number it cannot hold."""
MAX_ITEMS = 1000
"""The most items a multi-choice value (runs, series) holds; past this it is not a choice."""
MAX_TEXT = 10_000
"""The longest text a callback takes (a tag, a search, a version token)."""
_SHOWN = 40
"""A rejected value is quoted up to this many characters in its message."""


def whole(value: Any, *, high: int = MAX_WHOLE) -> int | None:
    """`value` as an int from 0 to `high`: a JSON integer (not a bool, not a float) or ASCII
    digits (a URL's query); None for anything else."""
    if isinstance(value, str):
        if not (value.isascii() and value.isdigit() and len(value) <= len(str(high))):
            return None
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value if 0 <= value <= high else None


def wholes(value: Any, *, high: int = MAX_WHOLE) -> list[int]:
    """A multi-choice dropdown's integer values (one value alone counts as a list of one); items
    that are not `whole` are dropped."""
    items = value if isinstance(value, list) else [] if value is None else [value]
    return [i for i in (whole(v, high=high) for v in items[:MAX_ITEMS]) if i is not None]


def text(value: Any, *, max_chars: int = MAX_TEXT) -> str | None:
    """`value` when it is a string of at most `max_chars` characters that UTF-8 can hold, else
    None: a lone surrogate (JSON's "\\udcff") is no text a control sends, and a callback that
    echoes it (a figure's key, a label) would fail to encode its answer."""
    if not isinstance(value, str) or len(value) > max_chars:
        return None
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return None
    return value


def texts(value: Any, *, max_chars: int = MAX_TEXT) -> list[str]:
    """A multi-choice dropdown's string values; items that are not `text` are dropped."""
    items = value if isinstance(value, list) else [] if value is None else [value]
    return [t for t in (text(v, max_chars=max_chars) for v in items[:MAX_ITEMS]) if t is not None]


def choice(value: Any, allowed: Collection[str]) -> str | None:
    """`value` when it is one of the strings `allowed` (a radio item's options), else None."""
    return value if isinstance(value, str) and value in allowed else None


def number(value: Any, *, low: float = -math.inf, high: float = math.inf) -> float | None:
    """`value` as a finite float from `low` to `high` (a slider, an axis range), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        x = float(value)
    except OverflowError:  # an integer past any float
        return None
    return x if math.isfinite(x) and low <= x <= high else None


def record(value: Any) -> dict[str, Any] | None:
    """`value` when it is a JSON object (a table's active cell, a click, a relayout), else None."""
    return value if isinstance(value, dict) else None


def records(value: Any) -> list[dict[str, Any]]:
    """A list of JSON objects (a table's rows); items that are not objects are dropped."""
    return [r for r in value if isinstance(r, dict)] if isinstance(value, list) else []


def typed_whole(value: Any, field: str) -> int | None:
    """A whole number typed into `field` (type=number): None when the field is empty, the
    number, or `BadValueError` saying what the field takes (1.5, -1, a value no field sends)."""
    if value is None:
        return None
    n = whole(value)
    if n is None:
        raise BadValueError(f"{field}: {shown(value)} is not one: type a whole number from 0 to "
                            f"{MAX_WHOLE:,}, or leave it empty")
    return n


def shown(value: Any) -> str:
    """`value` quoted for a message: control characters escaped, at most a few dozen
    characters, so a forged value is never echoed whole or raw."""
    r = ascii(value) if isinstance(value, str) else repr(value)
    return r if len(r) <= _SHOWN else r[:_SHOWN] + "..."
