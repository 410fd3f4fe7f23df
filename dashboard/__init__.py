"""A local Dash dashboard over one or more run directories.

`create_app(run_dirs)` builds the app; `serve(app)` runs it on 127.0.0.1. Public names load
lazily (PEP 562) so that `import dashboard` imports neither dash nor pandas; a test pins this list.
"""
from __future__ import annotations

from sleuth.common import lazy_exports as _lazy_exports

_EXPORTS: dict[str, str] = {
    "DashboardError": "dashboard._errors",
    "RunDirError": "dashboard._errors",
    "UnsafePathError": "dashboard._errors",
    "create_app": "dashboard._app",
    "serve": "dashboard._serve",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS)
