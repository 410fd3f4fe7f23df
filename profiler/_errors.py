"""The profiler package's exception hierarchy: every error it raises derives from ProfilerError."""
from __future__ import annotations


class ProfilerError(Exception):
    """Base class of every error raised by the `profiler` package."""


class ConfigError(ProfilerError, ValueError):
    """A collector or summary configuration is invalid; the message names the field and the fix."""


class ProfileFormatError(ProfilerError):
    """A file under RUN/profile or RUN/summary is missing, unreadable or of an unknown version."""
