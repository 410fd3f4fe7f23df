"""Source locations: which user line made a node, by the rule every Sleuth package shares
(`sleuth.common`: the innermost frame outside torch, the standard library and Sleuth's tools,
printed by `short_path`), so a node, the dump's record and the profile's op of one call name
one line.
"""
from __future__ import annotations

import re
import sys
from functools import lru_cache

from sleuth.common import INTERNAL, frame_kind, short_path

_FRAME_RE = re.compile(r'File "([^"]+)", line (\d+)')


@lru_cache(maxsize=4096)
def _is_line(filename: str) -> bool:
    return frame_kind(filename) != INTERNAL


def location(filename: str, line: int) -> str:
    return f"{short_path(filename)}:{line}"


def user_frame_location(skip: int = 1) -> str:
    """Location of the innermost user frame on the current Python stack ("" if none)."""
    frame = sys._getframe(skip)
    while frame is not None:
        filename = frame.f_code.co_filename
        if _is_line(filename):
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
        if _is_line(filename):
            return location(filename, int(line))
    return location(frames[-1][0], int(frames[-1][1])) if frames else ""
