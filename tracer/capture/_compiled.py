"""torch.compile under the dump config's ``"compiled": "eager"``: a dumped step runs eagerly,
and the user is told so once.

In that mode a dump records the eager model's modules and ops where the compiled code would
show neither. Left alone, what a dumped step records would depend on when torch.compile first
traced the model: a graph traced before the step ignores the tracer's module hooks (records
silently missing; torch does not guard on global hooks), one traced during it breaks the graph
at every hook. So while a dumped step runs the compiler's stance is ``force_eager``
(`torch.compiler.set_stance`): every dumped step records the eager model, named and ordered as
an eager run's, and steps not dumped run the graphs compiled without the tracer's hooks, with
no graph break of the tracer's. The prior stance comes back when the step ends. The default
mode, which runs the compiled code, is tracer.capture._regions.
"""
from __future__ import annotations

import sys
from typing import Any

import torch

from sleuth.common import warn

EAGER_NOTE = ("dumped steps run torch.compile'd code eagerly (the dump records "
              "the eager model's modules and ops); steps the dump config does not select run "
              "compiled: select only the steps you need with \"steps\"")
"""The one line that says what a dump does to compilation, and what to choose instead."""

_told = False


def compiled_module(module: torch.nn.Module) -> bool:
    """True for the wrapper `torch.compile(module)` returns."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    wrapper = getattr(eval_frame, "OptimizedModule", None)
    return wrapper is not None and isinstance(module, wrapper)


def tell_once(stacklevel: int = 3) -> None:
    """Warn once per process that dumped steps run compiled code eagerly (EAGER_NOTE)."""
    global _told
    if not _told:
        _told = True
        warn(EAGER_NOTE, stacklevel=stacklevel)


def _compiled_anything() -> bool:
    utils = sys.modules.get("torch._dynamo.utils")
    counters = getattr(utils, "counters", None)
    return bool(counters and counters["frames"]["ok"])


class EagerWhileDumped:
    """Holds torch.compile's stance at ``force_eager`` from `enter` to `leave`."""

    def __init__(self) -> None:
        self._stance: Any = None  # torch's set_stance object, which restores the prior stance

    def enter(self, step: int) -> None:
        """Make the dumped step `step` run eagerly; a no-op until torch.compile is loaded."""
        if self._stance is not None or "torch._dynamo" not in sys.modules:
            return
        set_stance = getattr(getattr(torch, "compiler", None), "set_stance", None)
        if set_stance is None:  # a torch without stances: compiled code may run unrecorded
            return
        if _compiled_anything():
            tell_once(stacklevel=5)
        try:
            self._stance = set_stance("force_eager")
        except RuntimeError as e:  # the step began inside a compiled region
            warn(f"step {step} is dumped but could not be made to run eagerly ({e}); code "
                 f"compiled by torch.compile that runs in it is not recorded", stacklevel=5)

    def leave(self) -> None:
        """Give torch.compile its prior stance back."""
        stance = self._stance
        if stance is None:
            return
        try:
            stance.__exit__(None, None, None)
        except RuntimeError as e:  # the step ended inside a compiled region: retried at the next
            warn(f"torch.compile's stance could not be restored after a dumped step ({e}); "
                 f"it is tried again when the next step ends", stacklevel=4)
            return
        self._stance = None
