"""The tracer's exceptions: one base class, and messages that say how to fix the problem."""
from __future__ import annotations


class TracerError(Exception):
    """Base class of every error the tracer raises on purpose."""


class ConfigError(TracerError, ValueError):
    """A dump or watch config is invalid: the message names the key, the value and a fix."""


class DumpFormatError(TracerError):
    """A dump file is missing, unreadable, or of a format version this release cannot read."""
