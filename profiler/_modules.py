"""Module ranges: global nn.Module hooks that wrap each module call in a record_function range.

The range is named `sleuth.module::{dotted name}` so the trace (and the module table built from
it) carries the names from `named_modules()`, which torch.profiler's own `with_modules` only
provides for TorchScript and `with_stack`'s `nn.Module: Class_N` events do not give. Backward
time is not measured with backward hooks (they wrap tensors in extra autograd nodes and break on
in-place ops); the table builder attributes autograd nodes to modules through the forward op's
sequence number instead. Installed only while the profiler traces, so idle steps pay nothing.
"""
from __future__ import annotations

import weakref
from typing import Any

from profiler._tables import MODULE_PREFIX


class ModuleRanges:
    """Installs and removes the two global forward hooks; names modules as it first sees them."""

    def __init__(self) -> None:
        self._names: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        self.types: dict[str, str] = {}
        self._stack: list[tuple[Any, Any]] = []
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
            self._stack.pop()[1].__exit__(None, None, None)

    # ---- hooks -----------------------------------------------------------------------------
    def _pre(self, module: Any, args: Any) -> None:
        name = self._names.get(module)
        if name is None:
            name = self._name(module)
        from torch.autograd.profiler import record_function
        rf = record_function(MODULE_PREFIX + name)
        rf.__enter__()
        self._stack.append((module, rf))

    def _post(self, module: Any, args: Any, output: Any) -> None:
        while self._stack:
            m, rf = self._stack.pop()
            rf.__exit__(None, None, None)
            if m is module:
                break

    # ---- naming ----------------------------------------------------------------------------
    def _name(self, module: Any) -> str:
        if self._stack:
            parent_module = self._stack[-1][0]
            parent = self._names.get(parent_module, "<unknown>")
            attr = next((k for k, v in parent_module._modules.items() if v is module), None)
            base = f"{parent}.{attr}" if attr is not None else f"{parent}.<{type(module).__name__}>"
            if parent == "<root>" and attr is not None:
                base = attr
        elif "<root>" not in self.types:
            base = "<root>"
        else:
            base = f"<{type(module).__name__}>"
            n = 2
            while base in self.types:
                base = f"<{type(module).__name__}_{n}>"
                n += 1
        for sub, m in module.named_modules():
            if m in self._names:
                continue
            full = base if not sub else (sub if base == "<root>" else f"{base}.{sub}")
            self._names[m] = full
            self.types[full] = type(m).__name__
        return self._names[module]
