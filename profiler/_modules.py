"""Module ranges: global nn.Module hooks that wrap each module call in a record_function range.

The range is named `sleuth.module::{dotted name}` so the trace (and the module table built from
it) carries the names from `named_modules()`, by the tracer's rule for a module called from
several places (`tracer.capture.CallNames`), which torch.profiler's own `with_modules` only
provides for TorchScript and `with_stack`'s `nn.Module: Class_N` events do not give. Backward
time is not measured with backward hooks (they wrap tensors in extra autograd nodes and break on
in-place ops); the table builder attributes autograd nodes to modules through the forward op's
sequence number instead. Installed only while the profiler traces, so idle steps pay nothing.
While dynamo traces a frame the hooks do nothing: traced, their record_function and name
lookups would break the graph and exhaust its recompile limit, and the model would run eagerly,
another run than the one profiled; code torch.compile compiled runs as one range, its caller's.
"""
from __future__ import annotations

from typing import Any

from torch.compiler import is_compiling

from profiler._attribution import MODULE_PREFIX


class ModuleRanges:
    """Installs and removes the two global forward hooks; names each call as the tracer does
    (`tracer.capture.CallNames`: from the module stack of that call), so a module called from
    several places is timed under each caller and the profile's names are the dump's."""

    def __init__(self) -> None:
        from tracer.capture import CallNames

        self._names = CallNames()
        self.types: dict[str, str] = {}
        self.sources: dict[str, str] = {}  # name -> file:line of its class's forward
        # a top-level module's call sites: name -> {user file:line -> calls}; a with_stack
        # frame names only its function's def line, and `model(x)` calls no attribute
        self.call_lines: dict[str, dict[str, int]] = {}
        self._stack: list[tuple[Any, str, Any]] = []  # (module, call name, open range)
        self._handles: list[Any] = []

    @property
    def installed(self) -> bool:
        return bool(self._handles)

    def install(self) -> None:
        if self._handles:
            return
        from torch.nn.modules.module import (register_module_forward_hook,
                                             register_module_forward_pre_hook)
        self._handles = [register_module_forward_pre_hook(self._pre),
                         register_module_forward_hook(self._post, always_call=True)]

    def remove(self) -> None:
        handles, self._handles = self._handles, []
        for h in handles:
            h.remove()
        while self._stack:  # a range left open (removed mid-forward) must still be closed
            self._stack.pop()[2].__exit__(None, None, None)

    # ---- hooks -----------------------------------------------------------------------------
    def _pre(self, module: Any, args: Any) -> None:
        if is_compiling():
            return
        stack = self._stack
        name = self._names.name(module, stack[-1] if stack else None)
        if name is None:
            if stack:  # a scope-less wrapper: its time is its caller's
                return
            self._names.add_root(module)  # each top-level module that runs is a root
            name = self._names.name(module, None)
            if name is None:  # a wrapper at the top (DDP, torch.compile): its inner one is named
                return
        if name not in self.types:  # once per name: never on the per-call path
            self.types[name] = type(module).__name__
            self.sources[name] = _forward_line(module)
        if not stack:  # a top-level call: one a step, so its caller's line is cheap to find
            line = _caller_line()
            if line:
                sites = self.call_lines.setdefault(name, {})
                sites[line] = sites.get(line, 0) + 1
        from torch.autograd.profiler import record_function
        rf = record_function(MODULE_PREFIX + name)
        rf.__enter__()
        stack.append((module, name, rf))

    def _post(self, module: Any, args: Any, output: Any) -> None:
        if is_compiling():
            return
        stack = self._stack
        if not any(entry[0] is module for entry in stack):
            return  # a module that opened no range
        while stack:
            m, _, rf = stack.pop()
            rf.__exit__(None, None, None)
            if m is module:
                break


def _caller_line() -> str:
    """`file:line` of the user's line (`sleuth.common.frame_kind`: the innermost frame outside
    torch, the standard library and Sleuth's tools) that called a top-level module ("" when
    there is none), as the dump gives that call's records."""
    import sys

    from sleuth.common import INTERNAL, frame_kind
    f = sys._getframe(2)
    while f is not None:
        path = f.f_code.co_filename
        if frame_kind(path) != INTERNAL:
            return f"{path}:{f.f_lineno}"
        f = f.f_back
    return ""


def _forward_line(module: Any) -> str:
    """`file:line` where the module's class defines `forward` ("" when it has no Python code);
    through decorators that wrap it (`functools.wraps`: a library's deprecation or
    output-capturing wrapper), whose own code is not the model's."""
    import inspect
    forward = getattr(type(module), "forward", None)
    try:
        forward = inspect.unwrap(forward) if forward is not None else None
    except ValueError:  # a cycle of __wrapped__
        pass
    code = getattr(forward, "__code__", None)
    return f"{code.co_filename}:{code.co_firstlineno}" if code is not None else ""
