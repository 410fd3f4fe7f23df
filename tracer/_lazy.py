"""Lazy public names for the tracer's packages (PEP 562).

Each package's `__init__.py` maps its public names to the private modules that define them and
imports a module only when one of its names is first asked for. That keeps `import tracer` free
and lets the reader and the diff run where torch is not installed: asking for `open_dump` loads
the reader, never the capture side.
"""
from __future__ import annotations

import importlib
import sys
from typing import Any, Callable


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any],
                                                                 Callable[[], list[str]]]:
    """`__getattr__` and `__dir__` for `package`, whose public names are `exports`
    (name -> defining module)."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        vars(sys.modules[package])[name] = value  # later look-ups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
