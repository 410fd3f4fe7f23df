"""The irdump exception hierarchy: one base class (a `sleuth.common.SleuthError`), one subclass
per way things go wrong."""
from __future__ import annotations

from sleuth.common import FormatError, SleuthError


class IrDumpError(SleuthError):
    """Base class of every error irdump raises."""


class CaptureError(IrDumpError):
    """The model could not be captured (neither by torch.export nor by one traced call)."""


class RenderError(IrDumpError):
    """A graph could not be rendered to SVG (usually: Graphviz `dot` is not installed)."""


class IrFormatError(IrDumpError, FormatError):
    """A `.ir` file could not be read: not an IR file, or written by a newer format version."""
