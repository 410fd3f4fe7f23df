"""``optimizer.step(closure)``: the forward and backward a closure runs are recorded.

LBFGS, Lightning's automatic optimization and any optimizer given a closure evaluate the model
inside ``optimizer.step``, while the op mode is off the dispatch stack (the optimizer's own ops
are not records). The Dumper hands the optimizer the closure wrapped (`recording_closure`):
the wrapper pushes the op mode while the closure runs, so its ops are recorded and belong to
the step that this optimizer step ends, one ``call`` per evaluation. The caller sees the
closure's return value and exceptions unchanged.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

from tracer.capture._op_mode import OpMode
from tracer.capture._recorder import Recorder

_takes_closure_first: dict[type, bool] = {}


def recording_closure(optimizer: Any, args: tuple, kwargs: dict, mode: OpMode,
                      recorder: Recorder) -> tuple[tuple, dict] | None:
    """The (args, kwargs) of an ``optimizer.step`` call with its closure wrapped so that it
    runs with `mode` pushed while `recorder` captures, or None when the call passes no
    closure (the optimizer step then runs with the arguments it was given)."""

    def wrap(closure: Any) -> Any:
        def recorded(*a: Any, **kw: Any) -> Any:
            if not recorder.capturing or mode.active:
                return closure(*a, **kw)
            mode.push()
            try:
                return closure(*a, **kw)
            finally:
                mode.pop()

        return functools.wraps(closure)(recorded) if callable(closure) else closure

    return with_closure(optimizer, args, kwargs, wrap)


def with_closure(optimizer: Any, args: tuple, kwargs: dict, wrap: Callable[[Any], Any]
                 ) -> tuple[tuple, dict] | None:
    """The (args, kwargs) of an ``optimizer.step`` call (``args[0]`` the optimizer) with its
    closure replaced by ``wrap(closure)``, or None when the call passes no closure. A
    positional argument counts as the closure only where the optimizer's ``step`` names its
    first parameter ``closure`` (every torch optimizer's), so that an optimizer whose step
    takes something else first is handed exactly what it was given."""
    closure = kwargs.get("closure")
    if closure is not None:
        return args, {**kwargs, "closure": wrap(closure)}
    if len(args) < 2 or args[1] is None:
        return None
    cls = type(optimizer)
    first = _takes_closure_first.get(cls)
    if first is None:
        try:
            names = list(inspect.signature(cls.step).parameters)
        except (TypeError, ValueError):  # a step that cannot be inspected: leave it alone
            names = []
        first = _takes_closure_first[cls] = names[1:2] == ["closure"]
    if not first:
        return None
    return (args[0], wrap(args[1]), *args[2:]), kwargs
