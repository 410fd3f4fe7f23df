"""JSON read from files a run wrote, which the tools must not trust: bounded in size and depth.

A file's own content decides how much a naive reader allocates and how deep it recurses: a 200 MB
`run.json` is read whole, and a 200k-deep one overflows the C stack of the json module (or raises
RecursionError inside whatever caught it). These readers check the real size on disk and the
nesting before parsing, and report each case as one `JsonLimitError` line that names the file and
the limit, so a command can exit 2 and a page can show the message.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tracer._errors import DumpFormatError, UntrustedFileError
from tracer.storage._door import read_bounded

MAX_BYTES = 16 * 1024 * 1024
"""The largest JSON file (or inline text) the tools parse; a run's own files are kilobytes."""
MAX_DEPTH = 64
"""The deepest nesting of arrays and objects accepted; configs and run files nest a few levels."""


class JsonLimitError(DumpFormatError, ValueError):
    """A JSON file or text is too large, too deep, not a regular file, or not JSON."""


def check_depth(text: str, source: str, max_depth: int = MAX_DEPTH) -> None:
    """Raise JsonLimitError when `text` nests arrays/objects deeper than `max_depth`.

    A linear scan that skips string contents, so a bracket inside a string never counts.
    """
    depth = 0
    in_string = False
    escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > max_depth:
                raise JsonLimitError(f"{source}: JSON nested deeper than {max_depth} levels; "
                                     "this is not a file sleuth wrote; remove or replace it")
        elif ch in "]}":
            depth -= 1


def loads_bounded(text: str, source: str, *, max_bytes: int = MAX_BYTES,
                  max_depth: int = MAX_DEPTH, **json_kwargs: Any) -> Any:
    """`json.loads(text)` after the size and depth checks; errors name `source`."""
    if len(text) > max_bytes:
        raise JsonLimitError(f"{source}: {len(text):,} characters of JSON, more than the "
                             f"{max_bytes:,} sleuth reads; this is not a file sleuth wrote")
    check_depth(text, source, max_depth)
    try:
        return json.loads(text, **json_kwargs)
    except json.JSONDecodeError as e:
        raise JsonLimitError(f"{source}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from e
    except RecursionError as e:  # pragma: no cover - check_depth keeps far below the limit
        raise JsonLimitError(f"{source}: JSON nested too deep to read") from e


def read_text_bounded(path: str | os.PathLike, *, max_bytes: int = MAX_BYTES) -> str:
    """The text of a regular file of at most `max_bytes` bytes (the door's `read_bounded`:
    measured on disk, then read with the same bound, so a file that grows meanwhile is still
    cut off); JsonLimitError otherwise."""
    path = Path(path)
    try:
        data = read_bounded(path, max_bytes)
    except UntrustedFileError as e:
        raise JsonLimitError(f"{e}; give the path of a JSON file") from e
    except OSError as e:
        raise JsonLimitError(f"{path}: cannot read ({e.strerror or e})") from e
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise JsonLimitError(f"{path}: not UTF-8 text (byte {e.start}); not a JSON file") from e


def load_bounded(path: str | os.PathLike, *, max_bytes: int = MAX_BYTES,
                 max_depth: int = MAX_DEPTH, **json_kwargs: Any) -> Any:
    """Parse the JSON file at `path` within the size and depth limits; JsonLimitError otherwise."""
    text = read_text_bounded(path, max_bytes=max_bytes)
    return loads_bounded(text, str(path), max_bytes=max_bytes, max_depth=max_depth, **json_kwargs)
