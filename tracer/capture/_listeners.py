"""Listeners of a function torch has no hook for, wrapped while at least one listens.

The gradient scaler's `update` (tracer.capture._scaler) and the gradient-clipping functions
(tracer.capture._setup) are wrapped in place, on their class or module, while a Dumper listens,
and put back when the last one stops: a process without a Dumper runs torch's own functions.
`Listeners` keeps the callbacks and calls `wrap` at the first one and `unwrap` after the last.
"""
from __future__ import annotations

import threading
from typing import Any, Callable


class _Handle:
    """Removes one listener; idempotent (`torch.utils.hooks.RemovableHandle`'s contract)."""

    def __init__(self, owner: Listeners, key: int) -> None:
        self._owner, self._key = owner, key

    def remove(self) -> None:
        self._owner._remove(self._key)

    def __enter__(self) -> _Handle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


class Listeners:
    """The callbacks of one wrapped function, and its wrapping's life."""

    def __init__(self, wrap: Callable[[], None], unwrap: Callable[[], None]) -> None:
        self._wrap, self._unwrap = wrap, unwrap
        self.lock = threading.Lock()
        self._callbacks: dict[int, Callable[..., None]] = {}
        self._next = 0

    def add(self, callback: Callable[..., None]) -> _Handle:
        """Listen with `callback`; the function is wrapped (again, for a class defined since)
        whenever one listens."""
        with self.lock:
            self._next += 1
            self._callbacks[self._next] = callback
            self._wrap()
            return _Handle(self, self._next)

    def _remove(self, key: int) -> None:
        with self.lock:
            self._callbacks.pop(key, None)
            if not self._callbacks:
                self._unwrap()

    def __bool__(self) -> bool:
        return bool(self._callbacks)

    def callbacks(self) -> tuple[Callable[..., None], ...]:
        """The listeners now (a copy: one may be removed while they run)."""
        return tuple(self._callbacks.values())
