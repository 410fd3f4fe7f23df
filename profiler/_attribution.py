"""Which module an op's time belongs to, and the module table built from that.

A module call is a range in the trace: Sleuth's own (`sleuth.module::{dotted name}`, written by
profiler._modules with the tracer's names) or, without them, with_stack's `nn.Module: Class_N`
events, never both. A forward op belongs to the innermost module range around it; a backward op
to the module of the forward op whose autograd node it runs in, tied by the node's Sequence
number, so backward time is attributed without backward hooks. Device time follows the host
event that launched it.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from profiler._trace import _Ev

MODULE_PREFIX = "sleuth.module::"
_BACKWARD_EVAL = "autograd::engine::evaluate_function: "


def _sleuth_module_name(ev: _Ev) -> str | None:
    if ev.name.startswith(MODULE_PREFIX):
        return ev.name[len(MODULE_PREFIX):]
    return None


def _stack_module_name(ev: _Ev) -> str | None:
    # with_stack's Python tracer marks module calls as "nn.Module: Linear_0" (class names only)
    if ev.cat == "python_function" and ev.name.startswith("nn.Module: "):
        return ev.name[len("nn.Module: "):]
    return None


def _module_rows(host: list[_Ev], module_name: Callable[[_Ev], str | None],
                 by_ext: dict[int, float], meta: dict[str, Any]
                 ) -> tuple[dict[str, dict[str, Any]], dict[Any, str], list[_Ev]]:
    """The module table of one window's host events: its rows by module name, the forward
    ops' Sequence numbers with the module each ran in, and the module ranges. `module_name`
    names a module range (None for any other event); `by_ext`: device microseconds per
    launching host event (by id)."""
    module_types: dict[str, str] = meta.get("module_types") or {}
    module_sources: dict[str, str] = meta.get("module_sources") or {}
    mods: dict[str, dict[str, Any]] = {}

    def mod_row(name: str) -> dict[str, Any]:
        row = mods.get(name)
        if row is None:
            row = mods[name] = {"module": name, "type": module_types.get(name, ""),
                                "source": str(module_sources.get(name, "")), "calls": 0,
                                "forward_total_us": 0.0, "forward_self_us": 0.0,
                                "backward_self_us": 0.0, "backward_total_us": 0.0,
                                "forward_device_us": 0.0, "backward_device_us": 0.0}
        return row

    seq_to_module: dict[Any, str] = {}
    module_ranges = [ev for ev in host if module_name(ev) is not None]
    for ev in module_ranges:
        name = module_name(ev)
        row = mod_row(name)
        row["calls"] += 1
        row["forward_total_us"] += ev.dur
        inner = 0.0
        stack = list(ev.children)
        while stack:  # the self time excludes nested module ranges, at any depth of ops
            c = stack.pop()
            if module_name(c) is not None:
                inner += c.dur
            else:
                stack.extend(c.children)
        row["forward_self_us"] += max(0.0, ev.dur - inner)
        if by_ext:
            row["forward_device_us"] += _subtree_device(ev, by_ext)
    if module_ranges:
        # A forward op belongs to the innermost module range around it; its Sequence number
        # ties it to the autograd node that runs its backward.
        for ev in host:
            if ev.cat != "cpu_op" or "Sequence number" not in ev.args:
                continue
            if ev.name.startswith(_BACKWARD_EVAL) or ev.name.endswith(("Backward0", "Backward1")):
                continue
            p = ev.parent
            while p is not None and module_name(p) is None:
                p = p.parent
            if p is not None:
                seq_to_module.setdefault(ev.args["Sequence number"], module_name(p))
        has_eval = any(ev.name.startswith(_BACKWARD_EVAL) for ev in host)
        for ev in host:
            if has_eval:
                if not ev.name.startswith(_BACKWARD_EVAL):
                    continue
            elif not ev.name.endswith(("Backward0", "Backward1")):
                continue
            owner = seq_to_module.get(ev.args.get("Sequence number"))
            if owner is not None:
                mods[owner]["backward_self_us"] += ev.dur
                if by_ext:
                    mods[owner]["backward_device_us"] += _subtree_device(ev, by_ext)
        for name, row in mods.items():
            row["backward_total_us"] = sum(r["backward_self_us"] for n, r in mods.items()
                                           if _is_within(n, name))
    return mods, seq_to_module, module_ranges


def _is_node(ev: _Ev) -> bool:
    return ev.name.startswith(_BACKWARD_EVAL) or ev.name.endswith(("Backward0", "Backward1"))


def _node_seq(ev: _Ev, memo: dict[int, Any] | None = None) -> Any:
    """The Sequence number of the autograd node an op runs in (itself or an enclosing
    `evaluate_function: XBackward0` / `XBackward0` event), None for a forward op: also one
    that a node runs (a checkpoint's recompute), which makes nodes of its own and so carries
    a Sequence number itself."""
    chain, p, found = [], ev, None
    while p is not None:
        if memo is not None and id(p) in memo:
            found = memo[id(p)]
            break
        if "Sequence number" in p.args:
            found = p.args["Sequence number"] if _is_node(p) else None
            break
        chain.append(p)
        p = p.parent
    if memo is not None:
        for e in chain:
            memo[id(e)] = found
    return found


def _op_module(ev: _Ev, module_name: Any, seq_to_module: dict[Any, str],
               memo: dict[int, str]) -> str:
    """The module an op ran in: the innermost module range around it (forward), or the module
    of the forward op whose autograd node it runs in (backward: the node's Sequence number);
    "" outside every module (the optimizer, the loop's own ops)."""
    chain, p, found = [], ev, ""
    while p is not None:
        if id(p) in memo:
            found = memo[id(p)]
            break
        name = module_name(p)
        if name is not None:
            found = name
            break
        if ((p.name.startswith(_BACKWARD_EVAL) or p.name.endswith(("Backward0", "Backward1")))
                and "Sequence number" in p.args):
            found = seq_to_module.get(p.args["Sequence number"], "")
            break
        chain.append(p)
        p = p.parent
    for e in chain:
        memo[id(e)] = found
    return found


def _is_within(name: str, scope: str) -> bool:
    """Whether module `name` is `scope` or inside it (the root's children carry no prefix)."""
    if name == scope:
        return True
    if scope == "<root>":
        return not name.startswith("<")
    return name.startswith(scope + ".")


def _subtree_device(ev: _Ev, by_ext: dict[int, float]) -> float:
    """Device time of the kernels launched by `ev` or any host event nested in it."""
    total, stack = 0.0, [ev]
    while stack:
        e = stack.pop()
        total += by_ext.get(id(e), 0.0)
        stack.extend(e.children)
    return total
