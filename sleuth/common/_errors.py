"""The root of every error Sleuth raises on purpose, and the kinds every tool shares.

Each package keeps its own root under `SleuthError` (`tracer.TracerError`,
`profiler.ProfilerError`, `irdump.IrDumpError`, `trainer.TrainerError`,
`dashboard.DashboardError`), and a tool's config, format and other-run errors subclass the
shared kind here as well as its own root: a caller catches `ConfigError` of any tool, or every
error of one tool, and the command line turns any `SleuthError` into one line (its message says
how to fix the problem) instead of a traceback.
"""
from __future__ import annotations


class SleuthError(Exception):
    """Base class of every error a Sleuth package raises on purpose: bad input or a file that
    cannot be used, with a message that names the problem and the fix."""


class ConfigError(SleuthError, ValueError):
    """A config is invalid: the message names the key, the value and a fix."""


class FormatError(SleuthError):
    """A file of a run is missing, unreadable, damaged or of a format version this release
    cannot read: the message names the file."""


class OtherRunError(SleuthError):
    """A run directory holds another run's files: the message names the directory, the other
    run and the fixes."""
