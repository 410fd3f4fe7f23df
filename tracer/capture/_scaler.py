"""The gradient scaler, which torch gives no hooks: `update()` as a step boundary, and each
`scale()` and `unscale_()` with the scaler's state, for the step's setup.

A mixed-precision loop with `torch.amp.GradScaler` calls ``scaler.step(optimizer)``, which
skips ``optimizer.step()`` when the gradients hold Inf or NaN, and then ``scaler.update()``.
Steps are counted by the optimizer hook, so without this a skipped iteration would run on into
the next one: one step file holding several iterations, its records counted as calls 1, 2, ...
and no longer matching another run's names. Skipped iterations come at the start of a run,
while the scale calibrates, and exactly when a run goes NaN, so that is when a dump matters.

``unscale_(optimizer)`` runs once an optimizer and step, called by the user (before clipping)
or by ``scaler.step``: after it, the scale the gradients were divided by, the scaler's growth
settings and whether it found Inf or NaN are the step's (`on_scaler_unscale`), and where it was
called says whether a clipping call saw scaled or unscaled gradients.

``scale(loss)`` runs its ops (the scale tensor, the multiplication) at the user's line: that
line is the scaler's, so a run that scales its loss where another does not is a setup that
differs, never an op added there (tracer.analysis._setup).

This wraps ``update``, ``unscale_`` and ``scale`` of `GradScaler` and of each subclass that
defines its own (FSDP's ``ShardedGradScaler``), while at least one Dumper listens, and puts the
originals back when the last one stops. The update listeners run before the original
``update``, so the scale's own ops fall at the start of the next step whether or not the
optimizer ran; the unscale listeners after the original ``unscale_``, which is when its Inf
check is known.
"""
from __future__ import annotations

import functools
import sys
import threading
from typing import Any, Callable

from tracer.capture._listeners import Listeners

_originals: dict[tuple[type, str], Callable[..., Any]] = {}
_inside = threading.local()  # a subclass's method calling its parent's: one notification


def _unwrapper(method: str) -> Callable[[], None]:
    def unwrap() -> None:
        for (cls, name), original in list(_originals.items()):
            if name == method:
                setattr(cls, name, original)
                del _originals[(cls, name)]
    return unwrap


def _wrapper(method: str) -> Callable[[], None]:
    def wrap() -> None:
        for cls in _scaler_classes(method):
            if (cls, method) in _originals:
                continue
            original = cls.__dict__[method]
            _originals[(cls, method)] = original
            setattr(cls, method, _WRAPS[method](original))
    return wrap


_listeners = Listeners(_wrapper("update"), _unwrapper("update"))
_unscale_listeners = Listeners(_wrapper("unscale_"), _unwrapper("unscale_"))
_scale_listeners = Listeners(_wrapper("scale"), _unwrapper("scale"))


def on_scaler_update(callback: Callable[[Any], None]) -> Any:
    """Call ``callback(scaler)`` at the start of every ``GradScaler.update()``; returns a handle
    whose ``remove()`` stops it. Scaler classes defined later are wrapped by `rewrap()`."""
    return _listeners.add(callback)


def on_scaler_unscale(callback: Callable[[Any, Any, bool], None]) -> Any:
    """Call ``callback(scaler, optimizer, explicit)`` after every ``GradScaler.unscale_()`` of
    an enabled scaler (`explicit`: the user called it, not ``scaler.step``); returns a handle
    whose ``remove()`` stops it."""
    return _unscale_listeners.add(callback)


def on_scaler_scale(callback: Callable[[Any], None]) -> Any:
    """Call ``callback(scaler)`` at every ``GradScaler.scale()`` of an enabled scaler (the
    loss scaled: its ops run at the caller's line); returns a handle whose ``remove()`` stops
    it."""
    return _scale_listeners.add(callback)


def rewrap() -> None:
    """Wrap scaler classes defined since the listeners came (a module imported later)."""
    for listeners, method in ((_listeners, "update"), (_unscale_listeners, "unscale_"),
                              (_scale_listeners, "scale")):
        if listeners:
            with listeners.lock:
                _wrapper(method)()


def _scaler_classes(method: str) -> list[type]:
    try:
        from torch.amp.grad_scaler import GradScaler
    except ImportError:  # torch < 2.3: torch.cuda.amp's is the base
        from torch.cuda.amp import GradScaler  # type: ignore[no-redef]
    found, todo = [], [GradScaler]
    while todo:
        cls = todo.pop()
        if method in cls.__dict__:
            found.append(cls)
        todo += cls.__subclasses__()
    return found


def _wrapped_update(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def update(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(_inside, "update", False):
            return original(self, *args, **kwargs)
        _inside.update = True
        try:
            for callback in _listeners.callbacks():
                callback(self)
            return original(self, *args, **kwargs)
        finally:
            _inside.update = False

    return update


def _called_by_step(frame: Any) -> bool:
    """Whether the frame calling ``unscale_`` is a scaler's own ``step``."""
    code = frame.f_code if frame is not None else None
    return code is not None and code.co_name == "step" and "grad_scaler" in code.co_filename


def _wrapped_unscale(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def unscale_(self: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(_inside, "unscale", False):
            return original(self, optimizer, *args, **kwargs)
        explicit = not _called_by_step(sys._getframe(1))
        _inside.unscale = True
        try:
            out = original(self, optimizer, *args, **kwargs)
        finally:
            _inside.unscale = False
        if getattr(self, "_enabled", True):
            for callback in _unscale_listeners.callbacks():
                try:
                    callback(self, optimizer, explicit)
                except Exception:  # noqa: BLE001 - a setup record never stops the user's step
                    continue
        return out

    return unscale_


def _wrapped_scale(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def scale(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "_enabled", True) and not getattr(_inside, "scale", False):
            _inside.scale = True
            try:
                for callback in _scale_listeners.callbacks():
                    try:
                        callback(self)
                    except Exception:  # noqa: BLE001 - a setup record never stops the step
                        continue
            finally:
                _inside.scale = False
        return original(self, *args, **kwargs)

    return scale


_WRAPS = {"update": _wrapped_update, "unscale_": _wrapped_unscale, "scale": _wrapped_scale}
