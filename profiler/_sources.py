"""The user's source line of an op, from the Python frames a `with_stack` trace holds.

With `with_stack=True` torch.profiler writes each Python call as a `python_function` event
named `path(line): function`, nested on the op's thread around the ops it made. An op's user
line is the innermost such frame that is not a library's (torch, transformers, the standard
library, Sleuth's own tools): for `aten::addmm` under `nn.Linear` that is the model's line that
called the layer, for an `aten::item` in the loop the loop's line. Without stacks there are no
frames and the source is "" (the module table still names each module's `forward`).

torch shortens a frame's path to what follows its `sys.path` entry (`torch/nn/modules/linear.py`,
`train.py` for a script run as `python examples/train.py`), so a frame is judged by where its
first path component imports from in this process.
"""
from __future__ import annotations

import importlib.util
import os
import re
import sysconfig
from functools import lru_cache
from typing import Any

PYTHON_EVENT = "python_function"
_FRAME_RE = re.compile(r"^(?P<file>.+?)\((?P<line>\d+)\): (?P<func>.*)$")
# Sleuth's own tools: their frames are never the user's line (the trainer's are: it is a model)
_TOOLS = frozenset({"profiler", "tracer", "sleuth", "irdump", "dashboard"})
_LIBRARY_DIRS = ("site-packages", "dist-packages")


def frame_of(name: str) -> tuple[str, int, str] | None:
    """(file, line, function) of a `python_function` event's name, or None."""
    m = _FRAME_RE.match(name)
    if m is None:
        return None
    return m.group("file"), int(m.group("line")), m.group("func")


@lru_cache(maxsize=4096)
def is_library(path: str) -> bool:
    """Whether a frame's (shortened) path is a library's or a tool's rather than the user's."""
    if path.startswith("<") or any(d in path for d in _LIBRARY_DIRS):
        return True
    head = path.replace("\\", "/").lstrip("./").split("/")[0]
    module = head[:-3] if head.endswith(".py") else head
    if not module.isidentifier():
        return False
    if module in _TOOLS:
        return True
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return False
    origin = (spec.origin or "") if spec is not None else ""
    if not origin or origin in ("built-in", "frozen"):
        return spec is not None
    stdlib = sysconfig.get_paths().get("stdlib", "")
    return any(d in origin for d in _LIBRARY_DIRS) or bool(stdlib) and origin.startswith(stdlib)


def user_line(ev: Any, memo: dict[int, str], finder: LineFinder | None = None) -> str:
    """`file:line` of the user's call that made op `ev` (a nested trace event: `.parent`, `.cat`,
    `.name`), or "" when the trace holds no user frame around it.

    The innermost user frame names the function (torch writes its `def` line, or for a frame
    already running when profiling began, the line it was at then); the call inside it is
    found by the name of what it called (a builtin such as `isfinite`, a module attribute such
    as `fc1`, a library function such as `checkpoint`), looked up in that function's source by
    `finder`. `memo` caches the answer for the events below that call.
    """
    chain: list[Any] = []
    p = ev.parent
    while p is not None:
        if id(p) in memo:
            return memo[id(p)]
        if p.cat == PYTHON_EVENT:
            frame = frame_of(p.name)
            if frame is not None and not is_library(frame[0]):
                hit = _callee(chain)
                found = (finder.find(frame, hit[1]) if finder is not None and hit else
                         f"{frame[0]}:{frame[1]}")
                for e in chain[:hit[0] + 1] if hit else ():  # what lies below the call is its own
                    memo[id(e)] = found
                return found
        chain.append(p)
        p = p.parent
    for e in chain:
        memo[id(e)] = ""
    return ""


_BUILTIN_RE = re.compile(r"^<built-in (?:method|function) (\w+)")
_PLUMBING = frozenset({"_call_impl", "_wrapped_call_impl", "inner", "wrapper", "forward",
                       "__call__", "decorate_context", "_fn"})


def _callee(chain: list[Any]) -> tuple[int, str] | None:
    """(index in `chain`, name) of the call the user's frame made: the event nearest that frame
    (the end of `chain`) that names a builtin, a module attribute or a library function."""
    from profiler._tables import MODULE_PREFIX
    for i in range(len(chain) - 1, -1, -1):
        name = chain[i].name
        m = _BUILTIN_RE.match(name)
        if m:
            return i, m.group(1)
        if name.startswith(MODULE_PREFIX):
            attr = name[len(MODULE_PREFIX):].rsplit(".", 1)[-1]
            if not attr.startswith("<") and not attr.isdigit():
                return i, attr
        if chain[i].cat == PYTHON_EVENT:
            frame = frame_of(name)
            if frame is not None and frame[2] not in _PLUMBING and frame[2].isidentifier():
                return i, frame[2]
    return None


class LineFinder:
    """Finds a call's line inside a function's source: the files are found on the search path
    the run recorded (torch shortens a frame's path to what follows its sys.path entry)."""

    def __init__(self, search_path: list[str]) -> None:
        self._path = [p for p in search_path if isinstance(p, str)]
        self._files: dict[str, tuple[str, list[str]] | None] = {}
        self._found: dict[tuple[str, int, str, str], str] = {}

    def _read(self, short: str) -> tuple[str, list[str]] | None:
        if short not in self._files:
            self._files[short] = None
            for root in self._path:
                path = os.path.join(root, short) if root else short
                try:
                    if os.path.isfile(path) and os.path.getsize(path) < 4 << 20:
                        with open(path, encoding="utf-8", errors="replace") as f:
                            self._files[short] = (os.path.abspath(path), f.read().splitlines())
                        break
                except OSError:
                    continue
        return self._files[short]

    def find(self, frame: tuple[str, int, str], token: str) -> str:
        """`file:line` of the first call of `token` in the function of `frame`; the frame's own
        line when the file or the call cannot be found."""
        short, line, func = frame
        key = (short, line, func, token)
        if key not in self._found:
            self._found[key] = self._find(short, line, func, token)
        return self._found[key]

    def _find(self, short: str, line: int, func: str, token: str) -> str:
        got = self._read(short)
        if got is None:
            return f"{short}:{line}"
        path, lines = got
        body = range(len(lines)) if func == "<module>" else _function_body(lines, line, func)
        call = re.compile(rf"(?<![\w]){re.escape(token)}\s*\(")
        for i in body:
            if call.search(lines[i].split("#", 1)[0]):
                return f"{path}:{i + 1}"
        return f"{path}:{line}"


def _function_body(lines: list[str], line: int, func: str) -> range:
    """Indices of the lines of `def func` at or above `line` (1-based), up to its dedent."""
    head = re.compile(rf"^(\s*)(async\s+)?def\s+{re.escape(func)}\b")
    start = None
    for i in range(min(line, len(lines)) - 1, -1, -1):
        m = head.match(lines[i])
        if m:
            start, indent = i, len(m.group(1))
            break
    if start is None:
        return range(0)
    end = start + 1
    while end < len(lines):
        text = lines[end]
        if text.strip() and not text.lstrip().startswith("#") and \
                len(text) - len(text.lstrip()) <= indent and not text.lstrip().startswith(")"):
            break
        end += 1
    return range(start + 1, end)
