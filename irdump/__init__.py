"""Graph export: capture a model's forward and backward graphs and write them as text, ordered
text, DOT and SVG; read them back for the dashboard.

Public names are loaded lazily (PEP 562) so `import irdump` costs nothing; a test pins this list.
"""
from __future__ import annotations

from sleuth.common import lazy_exports as _lazy_exports

_EXPORTS: dict[str, str] = {
    # graph model
    "Graph": "irdump._graph",
    "Node": "irdump._graph",
    "Param": "irdump._graph",
    "TensorType": "irdump._graph",
    # errors
    "IrDumpError": "irdump._errors",
    "CaptureError": "irdump._errors",
    "RenderError": "irdump._errors",
    "IrFormatError": "irdump._errors",
    # capture and write
    "capture_graphs": "irdump._save",
    "save_graphs": "irdump._save",
    "to_ir": "irdump._text",
    "to_sorted_ir": "irdump._text",
    "to_dot": "irdump._dot",
    "render_svg": "irdump._dot",
    "attach_from_env": "irdump._attach",
    # read
    "list_graphs": "irdump._read",
    "read_ir": "irdump._read",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS)
