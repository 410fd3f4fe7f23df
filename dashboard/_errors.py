"""The dashboard's exceptions: one base class (a `sleuth.common.SleuthError`), and messages that
say how to fix the problem."""
from __future__ import annotations

from sleuth.common import SleuthError


class DashboardError(SleuthError):
    """Base class of every error the dashboard raises on purpose."""


class RunDirError(DashboardError, ValueError):
    """A run directory is missing or is not a directory: the message names it."""


class UnsafePathError(DashboardError, PermissionError):
    """A requested file lies outside the run roots (`..`, an absolute path, a symlink out)."""


class BadValueError(DashboardError, ValueError):
    """A value typed into a page's field that the field does not take: the message says what
    it takes (`dashboard._values`)."""
