"""Record names (docs/dump-format.md) and the per-step call counters that make them stable.

A name is ``{scope}.{phase}.{call}.{direction}.{index}``: the scope is a module's dotted name
(``<root>`` for the root), ``{module}::{aten.op}`` for op records, or a parameter name for
optimizer records. ``call`` counts how often a scope ran before in the same step and phase, so
two runs of the same code produce the same names in the same order.
"""
from __future__ import annotations

import sys
import types
from collections.abc import Sequence
from typing import Any, Literal

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


KERNEL_OP = "kernel."
"""How the op of an Inductor kernel's output records begins: ``kernel.{kernel name}``
(tracer.capture._inductor_kernels)."""


def op_name(func: object) -> str:
    """``aten.mm`` for the overload ``aten.mm.default``: the overload packet's qualified name."""
    packet = getattr(func, "overloadpacket", None)
    if packet is not None:
        return f"{packet._qualified_op_name.split('::')[0]}.{packet.__name__}"
    return str(func)


def compiled_inner(module: object) -> object | None:
    """The module that a torch.compile wrapper (``OptimizedModule``, what ``torch.compile(m)``
    returns) runs, or None for any other module. Records are named as if the wrapper were not
    there, so a compiled run and an eager run of the same model have the same record names."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # no wrapper exists before it loads
    wrapper = getattr(eval_frame, "OptimizedModule", None)
    if wrapper is None or not isinstance(module, wrapper):
        return None
    return module._modules.get("_orig_mod")  # type: ignore[attr-defined]


# (module that defines the wrapper class, class name, attribute holding the wrapped module)
_WRAPPERS = (
    ("torch.nn.parallel.distributed", "DistributedDataParallel", "module"),
    ("torch.nn.parallel.data_parallel", "DataParallel", "module"),
    ("torch.distributed.fsdp.fully_sharded_data_parallel", "FullyShardedDataParallel",
     "_fsdp_wrapped_module"),
    ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "ActivationWrapper",
     "_checkpoint_wrapped_module"),
)


def wrapper_inner(module: object) -> object | None:
    """The module that a wrapper runs, or None when ``module`` is not a wrapper. Wrappers are
    torch.compile's (`compiled_inner`), DDP's and DataParallel's (``module.``), FSDP's
    (``_fsdp_wrapped_module.``) and activation checkpointing's (``_checkpoint_wrapped_module.``);
    FSDP2 (``fully_shard``) adds no module. Records are named as if the wrapper were not there,
    so a wrapped run and a single-process eager run of the same model have the same names."""
    inner = compiled_inner(module)
    if inner is not None:
        return inner
    for where, cls_name, attr in _WRAPPERS:
        cls = getattr(sys.modules.get(where), cls_name, None)  # none exists before it loads
        if cls is not None and isinstance(module, cls):
            return module._modules.get(attr)  # type: ignore[attr-defined]
    return None


def module_names(model: object, root_name: str = ROOT,
                 wrappers: dict[object, str] | None = None,
                 aliases: dict[object, list[str]] | None = None) -> dict[object, str]:
    """Map each submodule object of ``model`` to its dotted name; the model itself is ``root_name``.

    The names and their order are ``named_modules()``'s, except that a wrapper gets no name and
    the module it wraps takes the wrapper's (``block`` rather than ``block._orig_mod`` or
    ``module.block``, see `wrapper_inner`); when ``wrappers`` is given, each wrapper is added
    to it with that name (FSDP keeps its flat parameters on the wrapper). A module reachable
    under two names (shared submodules) keeps the first one, like torch does; ``aliases``, when
    given, gets every name of each module, the first one first.
    """
    names: dict[object, str] = {}

    def walk(module: Any, name: str) -> None:
        while (inner := wrapper_inner(module)) is not None:
            if wrappers is not None:
                wrappers.setdefault(module, name)
            module = inner
        if aliases is not None:
            aliases.setdefault(module, []).append(name)
        if module in names:
            return
        names[module] = name
        for child_name, child in module._modules.items():
            if child is not None:
                walk(child, child_name if name == ROOT else f"{name}.{child_name}")

    walk(model, root_name)
    return names


_MAX_CALLS = 1 << 16


def root_name(k: int) -> str:
    """The name of the k-th root: ``<root>``, then ``<root1>``, ``<root2>``, ..."""
    return ROOT if k == 0 else f"<root{k}>"


def _child_path(name: str, child: str) -> str:
    return child if name == ROOT else f"{name}.{child}"


def _below(name: str, caller: str) -> bool:
    """True when the dotted ``name`` lies in the tree of the module named ``caller``."""
    if caller == ROOT:
        return name != ROOT and not name.startswith("<")
    return name.startswith(caller) and name[len(caller):len(caller) + 1] == "."


def scope_label(module: object) -> str:
    """What an anonymous module is, for its name: the function it wraps where it wraps one (a
    hub-kernel wrapper around ``apply_rotary_pos_emb`` is named after that function), else its
    class's qualified name, without the ``<locals>`` of a class made inside a function."""
    cls = type(module)
    forward = getattr(cls, "forward", None)
    if "<locals>" in cls.__qualname__:
        for cell in getattr(forward, "__closure__", None) or ():
            try:
                target = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(target, types.FunctionType):
                return target.__qualname__.replace("<locals>.", "")
    return cls.__qualname__.replace("<locals>.", "")


class CallNames:
    """The name of each module call, from the module stack of that call (docs/tracer.md, "Names").

    A module called from a module whose tree holds it takes its dotted name in that tree. One
    called from anywhere else (a shared submodule called by a module that does not own it, a
    hub-kernel wrapper that every decoder layer calls, a module outside the model) is named
    under its caller: ``{caller}.{attribute}`` when the caller holds it as a child, else
    ``{caller}.<{its own name or what it is}>``. So each call site names its records under
    itself, and a fault in layer 1 is never filed under layer 0, where the object first ran.
    Names are cached per (module, caller name): the hot path is one dictionary look-up.
    """

    __slots__ = ("_aliases", "_calls", "roots")

    def __init__(self) -> None:
        self._aliases: dict[object, list[str]] = {}
        self._calls: dict[tuple[object, str | None], str | None] = {}
        self.roots: list[object] = []
        """The models named so far, in the order `add_root` was given them."""

    def add_root(self, model: object) -> dict[object, str]:
        """Name ``model``'s modules under the next root name (`root_name`); returns
        `module_names`' mapping."""
        aliases: dict[object, list[str]] = {}
        names = module_names(model, root_name(len(self.roots)), aliases=aliases)
        self.roots.append(model)
        for module, found in aliases.items():
            self._aliases.setdefault(module, []).extend(found)
        self._calls.clear()
        return names

    def name(self, module: object, caller: Sequence[Any] | None) -> str | None:
        """The name of a call of ``module`` from ``caller`` (a sequence whose first two items
        are the running module and its call name, such as a module-stack entry; None when no
        module runs). None for a wrapper (`wrapper_inner`: its inner module takes the name),
        for a module of no tree called from no module, and for an anonymous module called
        from one of the same name (it adds no scope)."""
        key = (module, caller[1] if caller is not None else None)
        try:
            return self._calls[key]
        except KeyError:
            pass
        aliases = self._aliases.get(module)
        if wrapper_inner(module) is not None:
            name = None
        elif caller is None:
            name = aliases[0] if aliases else None
        else:
            parent, parent_name = caller[0], caller[1]
            name = next((a for a in aliases or () if _below(a, parent_name)), None)
            if name is None:
                attr = next((k for k, child in getattr(parent, "_modules", {}).items()
                             if _unwrapped(child) is module), None)
                if attr is not None:
                    name = _child_path(parent_name, attr)
                else:
                    scope = f".<{aliases[0] if aliases else scope_label(module)}>"
                    # a wrapper of the same function calling its per-model copy (hub kernels
                    # do) adds no scope: its ops are its caller's
                    name = None if parent_name.endswith(scope) else parent_name + scope
        if len(self._calls) >= _MAX_CALLS:
            # modules built anew in every forward would each stay cached (and alive) for good
            self._calls.clear()
        self._calls[key] = name
        return name


def _unwrapped(module: object) -> object:
    while (inner := wrapper_inner(module)) is not None:
        module = inner
    return module


class CallCounter:
    """Counts calls per (scope, phase) within one step; ``reset()`` at each step start."""

    __slots__ = ("_counts",)

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str], int] = {}

    def next(self, scope: str, phase: str) -> int:
        """Return the call number for this run of ``scope`` and count it."""
        return self.count((scope, phase))

    def count(self, key: tuple[str, str]) -> int:
        """`next` for the key ``(scope, phase)`` built once by the caller (an op site keeps
        its own), instead of a tuple a call."""
        counts = self._counts
        n = counts.get(key, 0)
        counts[key] = n + 1
        return n

    def peek(self, scope: str, phase: str) -> int:
        """How many calls of ``scope`` in ``phase`` were counted so far, without counting."""
        return self._counts.get((scope, phase), 0)

    def reset(self) -> None:
        self._counts.clear()
