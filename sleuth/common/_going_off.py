"""A tool that fails while it observes a run: it warns once and goes off, or, under
`SLEUTH_STRICT=1`, raises.

A tool that watches a training run (the dump, the profiler, the summary, the IR exporter, the
start-up hook that attaches them) is not the run: a full disk or another run's files in the
folder turn that tool off with one line, ``sleuth: <what> ..., and the run goes on without it``,
and the training goes on. `SLEUTH_STRICT=1` (`sleuth run --strict`; CI and tests) means one
thing everywhere: such a failure stops the run instead, as an exception (the start-up hook,
which runs inside the user's ``import torch``, stops with that line and exit 2).

Sleuth's warnings are `SleuthWarning`s, printed as that one line rather than Python's two
lines that point into Sleuth's own source.
"""
from __future__ import annotations

import os
import warnings
from typing import Any

from sleuth.common._errors import SleuthError

STRICT_ENV = "SLEUTH_STRICT"


class SleuthWarning(RuntimeWarning):
    """A warning of Sleuth's own (a tool switched off after an error, steps dropped, a stale
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
    the tool off with a warning."""
    return os.environ.get(STRICT_ENV, "").strip() == "1"


def describe_error(error: BaseException) -> str:
    """A Sleuth error's message alone; any other exception with its type
    (``"OSError: [Errno 28] No space left on device"``)."""
    if isinstance(error, SleuthError):
        return str(error) or type(error).__name__
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def warn(message: str, stacklevel: int = 1) -> None:
    """Warn `message` as a SleuthWarning, shown as ``sleuth: <message>`` on one line.

    `stacklevel` counts from the caller, as `warnings.warn`'s does: it places the warning for
    the filters' once-per-location registry, since the line printed names no location."""
    warnings.warn(message, SleuthWarning, stacklevel=stacklevel + 1)


def go_off(error: BaseException, *, tool: str, off: str, doing: str = "",
           raise_as: type[SleuthError] = SleuthError, raises: bool | None = None,
           stopped_by: str = "SLEUTH_STRICT=1", stacklevel: int = 1) -> None:
    """A tool's own work failed while it observes a run: raise, or warn that it is off.

    Raises where `raises` says so (default: `strict()`; the dump's config may ask too): the
    error itself when it is a `raise_as` already, else a `raise_as` ``<tool>: <doing> failed:
    <cause> (<stopped_by> stops the run here; ...)`` chained to it. Otherwise warns
    ``sleuth: <off>, and the run goes on without it: <doing> failed: <cause> (SLEUTH_STRICT=1
    stops the run instead)``. `tool` names the
    tool ("profiler"), `off` says what went off ("the profiler is off from step 3 on"). The
    caller keeps the tool off (its hooks removed, nothing more written) and calls this once:
    the warning is said once. `stacklevel` counts from the caller, as `warn`'s does."""
    cause = f"{doing} failed: {describe_error(error)}" if doing else describe_error(error)
    if strict() if raises is None else raises:
        if isinstance(error, raise_as):
            raise error
        raise raise_as(f"{tool}: {cause} ({stopped_by} stops the run here; without it, {off} "
                       f"and the run goes on)") from error
    warn(f"{off}, and the run goes on without it: {cause} (SLEUTH_STRICT=1 stops the run "
         f"instead)", stacklevel=stacklevel + 1)


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
