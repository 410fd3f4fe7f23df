"""The tracer's exceptions: messages that say how to fix the problem.

Each is a `sleuth.common.SleuthError`, and the config, format and other-run errors are also
the shared kinds every tool raises (`sleuth.common.ConfigError`, `FormatError`,
`OtherRunError`). A failure of the dump itself does not stop the run it observes: it goes off
by the rule every tool keeps (`sleuth.common.go_off`: one `SleuthWarning`, or an error under
``"on_error": "raise"`` or ``$SLEUTH_STRICT=1``).
"""
from __future__ import annotations

from sleuth.common import ConfigError as _SharedConfigError
from sleuth.common import FormatError as _SharedFormatError
from sleuth.common import OtherRunError as _SharedOtherRunError
from sleuth.common import SleuthError, _door


class TracerError(SleuthError):
    """Base class of every error the tracer raises on purpose."""


class ConfigError(TracerError, _SharedConfigError):
    """A dump or watch config is invalid: the message names the key, the value and a fix."""


class OtherRunError(TracerError, _SharedOtherRunError):
    """The run directory holds the dump of another run."""


class DumpFormatError(TracerError, _SharedFormatError):
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


REFERENCE_EXIT = 3
"""The exit status of a run a live reference stopped (`tracer.ReferenceDiverged`)."""


class ReferenceDiverged(SystemExit):
    """A live reference with `on_divergence="stop"` found the run's first record out of
    tolerance: the run ends with exit status `REFERENCE_EXIT` (3). A SystemExit rather than a
    TracerError, on purpose: it ends an unedited script (`sleuth run --reference`) with its own
    exit status and no traceback, as `sys.exit(3)` would, and a training loop's
    `except Exception` does not swallow it. The divergence was said on stderr already; the
    message repeats it for a caller that catches this."""

    EXIT_CODE = REFERENCE_EXIT

    def __init__(self, message: str) -> None:
        super().__init__(REFERENCE_EXIT)
        self.message = message

    def __str__(self) -> str:
        return self.message
