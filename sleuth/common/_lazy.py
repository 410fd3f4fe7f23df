"""Lazy public names (PEP 562), the one way every package's `__init__.py` exports.

A package's face maps each public name to the module that defines it and imports that module
only when the name is first asked for: `import tracer` or `import dashboard` costs nothing, and
the readers work where torch (or dash) is not installed, since asking for `open_dump` loads the
reader, never the capture side.
"""
from __future__ import annotations

import importlib
import sys
import types
from typing import Any, Callable


class _Face(types.ModuleType):
    """A package whose public name is also the name of one of its submodules (`trainer.train`,
    the function, in `trainer/train.py`): importing the submodule binds it on the package, and
    refusing that keeps the public name what the face says."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in vars(self).get("_EXPORTS", ()) and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


def lazy_exports(package: str, exports: dict[str, str]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """`__getattr__` and `__dir__` for `package` (the caller's `__name__`), whose public names
    are `exports` (name -> defining module): each loaded on first use. The package's public
    names then stay what `exports` says (`_Face`)."""
    module = sys.modules[package]
    namespace = vars(module)

    def __getattr__(name: str) -> Any:
        where = exports.get(name)
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where), name)
        namespace[name] = value  # later look-ups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    module.__class__ = _Face
    return __getattr__, __dir__
