"""The profiler package's exception hierarchy: every error it raises derives from ProfilerError,
a `sleuth.common.SleuthError`; its config and format errors are the shared kinds too."""
from __future__ import annotations

from sleuth.common import ConfigError as _SharedConfigError
from sleuth.common import FormatError, SleuthError


class ProfilerError(SleuthError):
    """Base class of every error raised by the `profiler` package."""


class ConfigError(ProfilerError, _SharedConfigError):
    """A collector or summary configuration is invalid; the message names the field and the fix."""


class ProfileFormatError(ProfilerError, FormatError):
    """A file under RUN/profile or RUN/summary is missing, unreadable or of an unknown version."""
