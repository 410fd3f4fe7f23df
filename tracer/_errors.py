"""The tracer's exceptions and warnings: messages that say how to fix the problem.

A failure of the dump itself (a config it cannot use, a run directory holding another run's
dump, a disk that fails, a bug in a hook) does not stop the run it observes: the dump goes
off with one `SleuthWarning` and the training goes on, unless the config says
``"on_error": "raise"`` or ``$SLEUTH_STRICT`` is 1 (`strict`). Sleuth's warnings are printed as
one line, ``sleuth: <message>``, not as Python's default two lines that point into the tracer's
own source (`warn`).
"""
from __future__ import annotations

import os
import warnings
from typing import Any

from sleuth.common import _door

STRICT_ENV = "SLEUTH_STRICT"


class TracerError(Exception):
    """Base class of every error the tracer raises on purpose."""


class ConfigError(TracerError, ValueError):
    """A dump or watch config is invalid: the message names the key, the value and a fix."""


class DumpFormatError(TracerError):
    """A dump file is missing, unreadable, or of a format version this release cannot read."""


class UntrustedFileError(TracerError, _door.UntrustedFileError):
    """A file claims what it does not hold: a dataset larger than the bytes stored for it, or
    data that lies in another file (an HDF5 external link, external storage, a virtual
    dataset); or it brings a stored pattern that does not finish in its time bound; or the
    door refuses it (sleuth.common's UntrustedFileError, as the tools raise it: not a regular
    file, larger than its bound, a path out of the run). Refused outright, never skipped as
    damaged (it is no DumpFormatError, which readers skip and count): a command that meets
    one stops with this message, naming the file."""


class DumpWriteError(TracerError):
    """Writing a dump failed (disk full, permissions, ...); the cause is chained."""


class WatchpointHit(TracerError):
    """A watchpoint with `"on_hit": "raise"` fired: the message names the record, its op, module,
    phase, step and source line. `.hit` holds the hit as a dict."""

    def __init__(self, message: str, hit: dict | None = None) -> None:
        super().__init__(message)
        self.hit = dict(hit or {})


class RecordNotFoundError(TracerError, LookupError):
    """No record of that name in that step of a dump; the message lists close names."""


class SleuthWarning(RuntimeWarning):
    """A warning of Sleuth's own (the dump switched off after an error, steps dropped, a stale
    lock taken over). Printed as one line, ``sleuth: <message>``, on stderr; filtered like any
    warning (``warnings.simplefilter("ignore", tracer.SleuthWarning)``, ``pytest.warns``).

    ``warnings.warn(message, SleuthWarning)`` from any package prints so: making one installs
    the one-line format (`show_one_line`), since `warnings.warn` makes the instance before it
    shows it."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        show_one_line()


def strict() -> bool:
    """True when ``$SLEUTH_STRICT`` is 1: a failure of a tool stops the run instead of turning
    the tool off with a warning (for CI and tests)."""
    return os.environ.get(STRICT_ENV, "").strip() == "1"


def describe_error(error: BaseException) -> str:
    """A tracer error's message alone; any other exception with its type
    (``"OSError: [Errno 28] No space left on device"``)."""
    if isinstance(error, TracerError):
        return str(error) or type(error).__name__
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def warn(message: str, stacklevel: int = 1) -> None:
    """Warn `message` as a SleuthWarning, shown as ``sleuth: <message>`` on one line.

    `stacklevel` counts from the caller, as `warnings.warn`'s does: it places the warning for
    the filters' once-per-location registry, since the line printed names no location."""
    warnings.warn(message, SleuthWarning, stacklevel=stacklevel + 1)


def one_line(message: Any) -> str:
    """The text a SleuthWarning prints: ``sleuth: <message>`` and a newline, the message on one
    line (an exception's text may hold several)."""
    text = " ".join(part.strip() for part in str(message).splitlines() if part.strip())
    return f"sleuth: {text}\n"


def show_one_line() -> None:
    """Make `warnings.formatwarning` print SleuthWarnings as one line (`one_line`); every other
    warning is formatted as before, by the formatter that was in place. Idempotent; installed
    again where someone replaced the formatter since."""
    current = warnings.formatwarning
    if getattr(current, "_sleuth_one_line", False):
        return

    def formatwarning(message: Any, category: Any, filename: str, lineno: int,
                      line: str | None = None) -> str:
        if isinstance(category, type) and issubclass(category, SleuthWarning):
            return one_line(message)
        return current(message, category, filename, lineno, line)

    formatwarning._sleuth_one_line = True  # type: ignore[attr-defined]
    warnings.formatwarning = formatwarning
