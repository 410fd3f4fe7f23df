"""Record names (docs/dump-format.md) and the per-step call counters that make them stable.

A name is ``{scope}.{phase}.{call}.{direction}.{index}``: the scope is a module's dotted name
(``<root>`` for the root), ``{module}::{aten.op}`` for op records, or a parameter name for
optimizer records. ``call`` counts how often a scope ran before in the same step and phase, so
two runs of the same code produce the same names in the same order.
"""
from __future__ import annotations

from typing import Literal

ROOT = "<root>"
NONE = "<none>"
OPTIMIZER = "<optimizer>"

Phase = Literal["forward", "backward", "optimizer"]
Direction = Literal["input", "output", "param", "grad", "update"]


def record_name(scope: str, phase: str, call: int, direction: str, index: int) -> str:
    """The record name of one tensor, exactly as docs/dump-format.md spells it."""
    return f"{scope}.{phase}.{call}.{direction}.{index}"


def op_scope(module: str, op: str) -> str:
    """The scope of an op record: the op's aten name inside the module that ran it."""
    return f"{module}::{op}"


def op_name(func: object) -> str:
    """``aten.mm`` for the overload ``aten.mm.default``: the overload packet's qualified name."""
    packet = getattr(func, "overloadpacket", None)
    if packet is not None:
        return f"{packet._qualified_op_name.split('::')[0]}.{packet.__name__}"
    return str(func)


def module_names(model: object, root_name: str = ROOT) -> dict[object, str]:
    """Map each submodule object of ``model`` to its dotted name; the model itself is ``root_name``.

    A module reachable under two names (shared submodules) keeps the first name that
    ``named_modules()`` yields, like torch does.
    """
    names: dict[object, str] = {}
    for name, module in model.named_modules():  # type: ignore[attr-defined]
        if module in names:
            continue
        if not name:
            names[module] = root_name
        elif root_name == ROOT:
            names[module] = name
        else:
            names[module] = f"{root_name}.{name}"
    return names


class CallCounter:
    """Counts calls per (scope, phase) within one step; ``reset()`` at each step start."""

    __slots__ = ("_counts",)

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str], int] = {}

    def next(self, scope: str, phase: str) -> int:
        """Return the call number for this run of ``scope`` and count it."""
        key = (scope, phase)
        n = self._counts.get(key, 0)
        self._counts[key] = n + 1
        return n

    def peek(self, scope: str, phase: str) -> int:
        """How many calls of ``scope`` in ``phase`` were counted so far, without counting."""
        return self._counts.get((scope, phase), 0)

    def reset(self) -> None:
        self._counts.clear()
