"""A local Dash dashboard over one or more run directories.

`create_app(run_dirs)` builds the app; `serve(app)` runs it on 127.0.0.1. Public names load
lazily (PEP 562) so that `import dashboard` imports neither dash nor pandas; a test pins this list.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "DashboardError": "dashboard._errors",
    "RunDirError": "dashboard._errors",
    "UnsafePathError": "dashboard._errors",
    "create_app": "dashboard._app",
    "serve": "dashboard._serve",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dashboard' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
