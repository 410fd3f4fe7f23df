"""Source location of user code: ``path/to/file.py:LINE`` of the innermost frame that is not
torch, site-packages or Sleuth's own tool packages.

Hooks run deep inside torch, so this walks ``sys._getframe`` outward. Whether a code object is
"internal" is decided once per code object and cached, and formatted locations are cached per
(code, line), so a call costs a few dictionary look-ups per frame and never ``inspect.stack``.
"""
from __future__ import annotations

import os
import sys
import types

_TOOL_PACKAGES = ("tracer", "profiler", "irdump", "sleuth", "dashboard")
# Sleuth's reference trainer is the user's code even when installed into site-packages; its
# locations print relative to the folder holding the packages ("trainer/model.py:33").
_PACKAGES_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_USER_PACKAGE_ROOTS = (os.path.join(_PACKAGES_ROOT, "trainer") + os.sep,)


def _internal_prefixes() -> tuple[str, ...]:
    import torch

    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.dirname(here)
    prefixes = [os.path.dirname(os.path.abspath(torch.__file__)) + os.sep]
    prefixes += [os.path.join(repo, pkg) + os.sep for pkg in _TOOL_PACKAGES]
    return tuple(prefixes)


_PREFIXES: tuple[str, ...] | None = None
_internal: dict[types.CodeType, bool] = {}
_formatted: dict[tuple[types.CodeType, int], str] = {}
_relpath: dict[str, str] = {}


def _is_internal(code: types.CodeType) -> bool:
    global _PREFIXES
    if _PREFIXES is None:
        _PREFIXES = _internal_prefixes()
    path = code.co_filename
    internal = not path.startswith(_USER_PACKAGE_ROOTS) and (
        path.startswith(_PREFIXES)
        or "site-packages" in path
        or "dist-packages" in path
        or path.startswith("<frozen")
        or path.startswith(os.path.dirname(os.__file__) + os.sep)  # the standard library
    )
    _internal[code] = internal
    return internal


def _relative(path: str) -> str:
    rel = _relpath.get(path)
    if rel is None:
        try:
            cwd = os.getcwd()
            absolute = os.path.abspath(path)
            if absolute.startswith(_USER_PACKAGE_ROOTS):
                rel = os.path.relpath(absolute, _PACKAGES_ROOT)
            elif absolute.startswith(cwd + os.sep):
                rel = os.path.relpath(absolute, cwd)
            else:
                rel = path
        except (OSError, ValueError):  # a deleted cwd or another drive: keep the path as given
            rel = path
        _relpath[path] = rel
    return rel


def user_source(skip: int = 1) -> str:
    """``file:line`` of the innermost user frame above the caller, or ``""`` when there is none.

    ``skip`` frames are skipped first (1 = the caller of this function).
    """
    frame: types.FrameType | None = sys._getframe(skip)
    internal = _internal
    while frame is not None:
        code = frame.f_code
        flag = internal.get(code)
        if flag is None:
            flag = _is_internal(code)
        if not flag:
            key = (code, frame.f_lineno)
            text = _formatted.get(key)
            if text is None:
                text = f"{_relative(code.co_filename)}:{frame.f_lineno}"
                _formatted[key] = text
            return text
        frame = frame.f_back
    return ""
