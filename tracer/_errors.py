"""The tracer's exceptions: one base class, and messages that say how to fix the problem."""
from __future__ import annotations


class TracerError(Exception):
    """Base class of every error the tracer raises on purpose."""


class ConfigError(TracerError, ValueError):
    """A dump or watch config is invalid: the message names the key, the value and a fix."""


class DumpFormatError(TracerError):
    """A dump file is missing, unreadable, or of a format version this release cannot read."""


class UntrustedFileError(TracerError):
    """A file claims what it does not hold: a dataset larger than the bytes stored for it, or
    data that lies in another file (an HDF5 external link, external storage, a virtual
    dataset); or it brings a stored pattern that does not finish in its time bound. Refused
    outright, never skipped as damaged (it is no DumpFormatError, which readers skip and
    count): a command that meets one stops with this message, naming the file."""


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
