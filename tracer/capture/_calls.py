"""What re-running an op call needs, as JSON: its overload and its arguments, with each tensor
argument named by its input record.

Op-level dumps in tensor or full mode keep every op's input tensors as records
`{module}::{op}.{phase}.{call}.input.{i}`. With the call's spec beside them (the step file's
/calls table) the op can be run again on those inputs, or on another run's, in another dtype:
`tracer.analysis.replay` does, and `sleuth explain` uses it to tell an op that changes the
result on identical inputs from rounding. The spec is plain JSON, never pickle:

    {"op": "aten.addmm.default", "args": [{"input": 0}, {"input": 1}, {"input": 2}],
     "kwargs": {"beta": 1, "alpha": 1}}

Tensors are numbered in the order the op's input records are (`_op_mode._flat`: positional
arguments, one level of lists, then keyword arguments); one that was not on the CPU also names
its device ({"input": 0, "device": "cuda:0"}), where a re-run should happen. Other values:
numbers, booleans, strings and None as they are (a float that JSON cannot hold as
{"float": "nan"}), lists as lists, a dtype as {"dtype": "float32"}, a device as
{"device": "cuda:0"}, a layout and a memory format by name; anything else as
{"opaque": its type}, which makes the call not replayable.
"""
from __future__ import annotations

import json
import math
from typing import Any

import torch

_Tensor = torch.Tensor


def encode_call(func: Any, args: tuple, kwargs: dict) -> str:
    """The JSON spec of one call of the overload `func`."""
    counter = [0]
    spec = {"op": _overload_name(func),
            "args": [_encode(a, counter, True) for a in args],
            # an out= buffer is only written: no input record holds it, and a re-run needs one
            "kwargs": {k: {"opaque": "out= buffer"} if k == "out" else _encode(v, counter, True)
                       for k, v in kwargs.items()}}
    return json.dumps(spec, separators=(",", ":"))


def _overload_name(func: Any) -> str:
    """"aten.addmm.default": namespace, op and overload, what `torch.ops` resolves."""
    schema = getattr(func, "_schema", None)
    if schema is not None:
        ns, _, name = schema.name.partition("::")
        return f"{ns}.{name}.{schema.overload_name or 'default'}"
    return str(func)


def _encode(v: Any, counter: list[int], top: bool) -> Any:
    if isinstance(v, _Tensor):
        counter[0] += 1
        if v.device.type == "cpu":
            return {"input": counter[0] - 1}
        return {"input": counter[0] - 1, "device": str(v.device)}  # where it ran, to re-run there
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else {"float": repr(v)}
    if isinstance(v, (list, tuple)):
        # tensors in lists are input records too (aten.cat), one level deep as `_flat` reads
        return [_encode(x, counter, False) if top or not isinstance(x, _Tensor)
                else {"opaque": "nested tensor list"} for x in v]
    if isinstance(v, torch.dtype):
        return {"dtype": str(v).removeprefix("torch.")}
    if isinstance(v, torch.device):
        return {"device": str(v)}
    if isinstance(v, torch.layout):
        return {"layout": str(v).removeprefix("torch.")}
    if isinstance(v, torch.memory_format):
        return {"memory_format": str(v).removeprefix("torch.")}
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return _encode({torch.SymInt: int, torch.SymFloat: float,
                        torch.SymBool: bool}[type(v)](v), counter, top)
    return {"opaque": type(v).__name__}


def mutates(func: Any) -> bool:
    """True when the op's schema says it writes one of its arguments (in-place, out=)."""
    if "batch_norm" in func.__name__ or "instance_norm" in func.__name__:
        return True  # native_batch_norm updates running statistics its schema does not mark
    try:
        # an optional argument's alias_info reads None from Python even when written
        # (`Tensor(a!)? running_mean` of native_batch_norm): read the schema text instead
        return any(a.alias_info is not None and a.alias_info.is_write or "!" in str(a)
                   for a in func._schema.arguments)
    except AttributeError:  # no schema: assume the worst
        return True
