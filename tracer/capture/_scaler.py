"""Steps the gradient scaler skipped: `GradScaler.update()` as a step boundary.

A mixed-precision loop with `torch.amp.GradScaler` calls ``scaler.step(optimizer)``, which
skips ``optimizer.step()`` when the gradients hold Inf or NaN, and then ``scaler.update()``.
Steps are counted by the optimizer hook, so without this a skipped iteration would run on into
the next one: one step file holding several iterations, its records counted as calls 1, 2, ...
and no longer matching another run's names. Skipped iterations come at the start of a run,
while the scale calibrates, and exactly when a run goes NaN, so that is when a dump matters.

torch has no hook for the scaler; this wraps ``update`` of `GradScaler` and of each subclass
that defines its own (FSDP's ``ShardedGradScaler``), while at least one Dumper listens, and puts
the original back when the last one stops. The listeners run before the original ``update``, so
the scale's own ops fall at the start of the next step whether or not the optimizer ran.
"""
from __future__ import annotations

import functools
import threading
from typing import Any, Callable

from tracer.capture._listeners import Listeners

_originals: dict[type, Callable[..., Any]] = {}
_inside = threading.local()  # a subclass's update calling its parent's: one notification


def _unwrap() -> None:
    for cls, original in _originals.items():
        cls.update = original  # type: ignore[attr-defined]
    _originals.clear()


def _wrap_classes() -> None:
    for cls in _scaler_classes():
        if cls in _originals:
            continue
        original = cls.__dict__["update"]
        _originals[cls] = original
        cls.update = _wrapped(original)  # type: ignore[attr-defined]


_listeners = Listeners(_wrap_classes, _unwrap)


def on_scaler_update(callback: Callable[[Any], None]) -> Any:
    """Call ``callback(scaler)`` at the start of every ``GradScaler.update()``; returns a handle
    whose ``remove()`` stops it. Scaler classes defined later are wrapped by `rewrap()`."""
    return _listeners.add(callback)


def rewrap() -> None:
    """Wrap scaler classes defined since the listeners came (a module imported later)."""
    if _listeners:
        with _listeners.lock:
            _wrap_classes()


def _scaler_classes() -> list[type]:
    try:
        from torch.amp.grad_scaler import GradScaler
    except ImportError:  # torch < 2.3: torch.cuda.amp's is the base
        from torch.cuda.amp import GradScaler  # type: ignore[no-redef]
    found, todo = [], [GradScaler]
    while todo:
        cls = todo.pop()
        if "update" in cls.__dict__:
            found.append(cls)
        todo += cls.__subclasses__()
    return found


def _wrapped(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def update(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(_inside, "active", False):
            return original(self, *args, **kwargs)
        _inside.active = True
        try:
            for callback in _listeners.callbacks():
                callback(self)
            return original(self, *args, **kwargs)
        finally:
            _inside.active = False

    return update
