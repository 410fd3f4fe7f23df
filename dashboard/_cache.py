"""How the data adapters (dashboard._data) read a run: `NoData` and `ReadError`, the empty
state and the error panel a page shows; each result cached until the stamps (mtime and size) of
the files it read change; a tool's public function found, or NoData; a reader's error turned
into ReadError; a folder of the run required to be inside it and to hold something.
"""
from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any, TypeVar

from dashboard._errors import UnsafePathError
from sleuth.common import FormatError
from dashboard._runs import inside

T = TypeVar("T")


class NoData(Exception):
    """This run has no data of the asked kind (or its reader is not installed): the message is
    the empty state the page shows, and says how to get the data."""


class ReadError(NoData, FormatError):
    """A file of the run exists but cannot be read (damaged, half-written, of an unknown
    version: the tools' `FormatError`): the page shows an error panel with the reader's
    message, which names the file."""


_cache: dict[Hashable, tuple[Hashable, Any]] = {}
_lock = threading.RLock()  # _cached makers may read through other cached readers


def _cached(key: Hashable, stamp: Hashable, make: Callable[[], T]) -> T:
    """`make()`, reused while `stamp` (mtimes of the files it reads) is unchanged."""
    with _lock:
        hit = _cache.get(key)
        if hit is not None and hit[0] == stamp:
            return hit[1]
        value = make()
        _cache[key] = (stamp, value)
        return value


def _stamp(path: Path) -> tuple[int, int]:
    try:
        st = path.stat()
    except OSError:
        return (0, 0)
    return (st.st_mtime_ns, st.st_size)


def _api(package: str, name: str, what: str) -> Any:
    """A public function of a Sleuth tool package, or NoData when it is not available."""
    try:
        return getattr(importlib.import_module(package), name)
    except (ImportError, AttributeError) as e:
        raise NoData(f"{what} needs `{package}.{name}`, which this installation lacks ({e})") from e


def _reading(what: str, fn: Callable[[], T]) -> Callable[[], T]:
    """`fn` with a reader's error (a corrupt or half-written file, an unknown format version)
    turned into NoData, so the page shows the reader's message instead of failing."""
    def run() -> T:
        try:
            return fn()
        except NoData:
            raise
        except Exception as e:  # noqa: BLE001 - any reader error becomes the page's empty state
            raise ReadError(f"could not read {what}: {e}") from e
    return run


def _need_dir(root: Path, sub: str, message: str) -> Path:
    """`root/sub` when it is a folder inside the run that holds something; NoData with
    `message` when it does not, ReadError when it is a link out of the run or unreadable."""
    try:
        p = inside(root, sub)
        if not p.is_dir() or not any(p.iterdir()):
            raise NoData(message)
    except OSError as e:  # UnsafePathError included
        raise ReadError(str(e) if isinstance(e, UnsafePathError) else f"{root / sub}: {e}") from e
    return p


def _dir_stamps(p: Path) -> list[tuple[int, int]]:
    if not p.is_dir():
        return []
    return [_stamp(Path(e.path)) for e in sorted(os.scandir(p), key=lambda e: e.name)]
