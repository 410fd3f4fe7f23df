"""FLOPs of a profiled window, counted from the shapes the trace recorded.

torch's `FlopCounterMode` would count while the step runs, but it is a dispatch mode that
decomposes some ops into others (`aten.silu_backward` into `sigmoid` and `mul`), so a counted
step would not compute the same bits as an uncounted one. Here nothing runs during training:
after a window is saved, each matmul-like op of the trace (`record_shapes=True` gives its
"Input Dims" and "Concrete Inputs") is priced with torch's own formulas
(`torch.utils.flop_counter.flop_registry`) from those shapes, and, where a formula needs the
output's shape too (convolutions), from a re-run of the op on meta tensors. An op nested in another
counted op (`aten::convolution` around `aten::_convolution`, an op dispatched through a Python
dispatch mode inside its own outer record) is counted once, and a tool's own work
(`sleuth.tool::` ranges) is not counted.
"""
from __future__ import annotations

import ast
import json
from typing import Any

from profiler._own import TOOL_PREFIX

# CPU attention kernels that flop_registry does not list: priced as their CUDA counterparts
_SDPA_FORWARD = ("aten::_scaled_dot_product_flash_attention_for_cpu",)
_SDPA_BACKWARD = ("aten::_scaled_dot_product_flash_attention_for_cpu_backward",)
_NOT_TENSOR = ("Scalar", "ScalarList", "GenericList", "TensorList", "")


class _Pricer:
    """Prices one op record from its name and recorded inputs; caches by shapes."""

    def __init__(self) -> None:
        import torch
        from torch.utils import flop_counter

        self._torch = torch
        self._fc = flop_counter
        self._registry = {str(k).replace(".", "::", 1): v
                          for k, v in flop_counter.flop_registry.items()}
        self._cache: dict[tuple[str, str], int | None] = {}

    def counts(self, name: str) -> bool:
        return name in self._registry or name in _SDPA_FORWARD or name in _SDPA_BACKWARD

    def flops(self, name: str, args: dict[str, Any]) -> int | None:
        """FLOPs of one call, or None when its inputs were not recorded or cannot be priced."""
        dims = args.get("Input Dims")
        if dims is None:
            return None
        key = (name, json.dumps([dims, args.get("Input type"), args.get("Concrete Inputs")]))
        if key not in self._cache:
            try:
                self._cache[key] = self._price(name, dims, args)
            except Exception:  # noqa: BLE001 - an op torch cannot re-run on meta is not priced
                self._cache[key] = None
        return self._cache[key]

    def _price(self, name: str, dims: list, args: dict[str, Any]) -> int:
        types = args.get("Input type") or [""] * len(dims)
        concrete = args.get("Concrete Inputs") or [""] * len(dims)
        values = [self._value(d, t, c) for d, t, c in zip(dims, types, concrete)]
        if name in _SDPA_FORWARD:
            q, k, v = (tuple(x.shape) for x in values[:3])
            return int(self._fc.sdpa_flop_count(q, k, v))
        if name in _SDPA_BACKWARD:
            g, q, k, v = (tuple(x.shape) for x in values[:4])
            return int(self._fc.sdpa_backward_flop_count(g, q, k, v))
        namespace, op = name.split("::", 1)
        packet = getattr(getattr(self._torch.ops, namespace), op)
        args, kwargs = _split(packet, values)
        formula = self._registry[name]
        try:  # most formulas read the inputs' shapes only
            return int(formula(*args, out_val=None, **kwargs))
        except (TypeError, AttributeError, IndexError):
            pass
        # a convolution's needs its output's shape: re-run it on meta tensors, which is kept
        # for these few ops because its first call in a process imports torch's meta kernels
        out = packet(*args, **kwargs)
        return int(formula(*args, out_val=out, **kwargs))

    def _value(self, dims: Any, typ: str, concrete: str) -> Any:
        if typ not in _NOT_TENSOR and not concrete and isinstance(dims, list):
            return self._torch.empty(dims, device="meta")
        if not concrete:
            return None
        return ast.literal_eval(concrete)


def _split(packet: Any, values: list) -> tuple[list, dict[str, Any]]:
    """The trace lists every argument in schema order; keyword-only ones (addmm's `beta`,
    `alpha`) must be passed by name. The overload is the one with that many arguments."""
    for overload in packet.overloads():
        schema = getattr(packet, overload)._schema
        if len(schema.arguments) == len(values):
            args = [v for a, v in zip(schema.arguments, values) if not a.kwarg_only]
            kwargs = {a.name: v for a, v in zip(schema.arguments, values)
                      if a.kwarg_only and v is not None}
            return args, kwargs
    return values, {}


def count_flops(trace: dict[str, Any], steps: list[int]) -> dict[str, Any]:
    """FLOPs per step of the steps `steps` of one window's trace.

    Returns {"flops_per_step", "flop_counts" (per op name, "aten.mm" style, per step),
    "flops_unpriced" (calls of matmul-like ops that could not be priced), "flop_source"}, or
    {} when the trace recorded no input shapes (the collector's `record_shapes=False`).
    """
    from profiler._trace import _STEP_RE, _Ev, _nest

    host = [_Ev(e) for e in trace.get("traceEvents", [])
            if isinstance(e, dict) and e.get("ph") == "X"]
    _nest(host)
    wanted = set(steps)
    spans = [(ev.ts, ev.end) for ev in host
             if (m := _STEP_RE.match(ev.name)) and int(m.group(1)) in wanted]
    if not spans or not any("Input Dims" in ev.args for ev in host if ev.cat == "cpu_op"):
        return {}
    pricer = _Pricer()
    per_op: dict[str, int] = {}
    unpriced = 0
    counted: set[int] = set()
    for ev in sorted(host, key=lambda e: (e.ts, -e.dur)):
        if ev.cat != "cpu_op" or not pricer.counts(ev.name):
            continue
        if not any(s0 <= ev.ts < s1 for s0, s1 in spans) or _inside_counted(ev, counted):
            continue
        counted.add(id(ev))
        n = pricer.flops(ev.name, ev.args)
        if n is None:
            unpriced += 1
            continue
        key = ev.name.replace("::", ".", 1)
        per_op[key] = per_op.get(key, 0) + n
    n_steps = len(spans)
    flop_counts = {k: v // n_steps for k, v in sorted(per_op.items())}
    return {"flops_per_step": sum(per_op.values()) // n_steps, "flop_counts": flop_counts,
            "flops_unpriced": unpriced, "flop_source": "trace shapes"}


def _inside_counted(ev: Any, counted: set[int]) -> bool:
    """True when an enclosing event was counted already or is a tool's own work."""
    p = ev.parent
    while p is not None:
        if id(p) in counted or p.name.startswith(TOOL_PREFIX):
            return True
        p = p.parent
    return False
