"""Source locations: which user line made a node, printed without machine-specific paths.

A location is `path:LINE` of the innermost frame outside torch and irdump. The path is relative
to the current directory when the file lies under it, else relative to the `site-packages` (or
other `sys.path`) root that holds it, so the same code gives the same text on every machine.
"""
from __future__ import annotations

import os
import re
import sys
from functools import lru_cache
from pathlib import Path

_SKIP_DIRS: tuple[str, ...] | None = None
_FRAME_RE = re.compile(r'File "([^"]+)", line (\d+)')


def _skip_dirs() -> tuple[str, ...]:
    global _SKIP_DIRS
    if _SKIP_DIRS is None:
        import torch

        here = os.path.dirname(os.path.abspath(__file__))
        dirs = [os.path.dirname(os.path.abspath(torch.__file__)), here]
        # contextlib / functools wrappers are never "the user's line"
        dirs.append(os.path.dirname(os.path.abspath(os.__file__)))
        _SKIP_DIRS = tuple(d + os.sep for d in dirs)
    return _SKIP_DIRS


@lru_cache(maxsize=4096)
def _is_user_file(filename: str) -> bool:
    if filename.startswith("<"):
        return False
    path = os.path.abspath(filename)
    stdlib = os.path.dirname(os.path.abspath(os.__file__)) + os.sep
    if path.startswith(stdlib) and "site-packages" not in path and "dist-packages" not in path:
        return False
    return not any(path.startswith(d) for d in _skip_dirs() if d != stdlib)


@lru_cache(maxsize=4096)
def relative_path(filename: str) -> str:
    """`filename` relative to the cwd, else to the sys.path root holding it, else its name."""
    path = os.path.abspath(filename)
    cwd = os.getcwd() + os.sep
    if path.startswith(cwd):
        return Path(path[len(cwd):]).as_posix()
    roots = sorted((os.path.abspath(p) + os.sep for p in sys.path if p), key=len, reverse=True)
    for root in roots:
        if path.startswith(root):
            return Path(path[len(root):]).as_posix()
    return Path(path).name


def location(filename: str, line: int) -> str:
    return f"{relative_path(filename)}:{line}"


def user_frame_location(skip: int = 1) -> str:
    """Location of the innermost user frame on the current Python stack ("" if none)."""
    frame = sys._getframe(skip)
    while frame is not None:
        filename = frame.f_code.co_filename
        if _is_user_file(filename):
            return location(filename, frame.f_lineno)
        frame = frame.f_back
    return ""


def stack_trace_location(stack_trace: str | None) -> str:
    """Location of the innermost user frame in a formatted traceback (torch.export's
    `stack_trace` node meta lists frames outermost first). When every frame is library code
    (an `nn.Sequential` of torch modules), the innermost frame is used instead."""
    if not stack_trace:
        return ""
    frames = _FRAME_RE.findall(stack_trace)
    for filename, line in reversed(frames):
        if _is_user_file(filename):
            return location(filename, int(line))
    return location(frames[-1][0], int(frames[-1][1])) if frames else ""
