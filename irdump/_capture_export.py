"""Forward capture through `torch.export`: ExportedProgram -> Graph.

Nodes keep export's own aten ops (pre-dispatch ATen, e.g. `aten.linear`; core ATen after
`run_decompositions()`, e.g. `aten.permute` + `aten.addmm`), named with the tracer's scheme
`{module}::{aten.op}.forward.{call}` where `module` is the innermost entry of the node's
`nn_module_stack` meta. Eager dispatch may run different ops for the same code, so these names
only equal the tracer's record names where the op is the same; the `forward_eager` stage
(`_capture_dispatch`) is the reference for record names.
"""
from __future__ import annotations

import contextlib
import io
import logging
import operator
import os
from collections import defaultdict
from typing import Any

from irdump._errors import CaptureError
from irdump._graph import Graph, Node, Param, TensorType, format_attr, value_ref
from irdump._source import stack_trace_location


def tensor_type(value: Any) -> TensorType:
    """TensorType of a (fake) tensor, SymInt or plain Python value."""
    import torch

    if isinstance(value, torch.Tensor):
        shape = tuple(int(s) if isinstance(s, int) or _is_concrete(s) else str(s)
                      for s in value.shape)
        return TensorType(str(value.dtype).removeprefix("torch."), shape)
    return TensorType(type(value).__name__)


def _is_concrete(size: Any) -> bool:
    try:
        int(size)
    except Exception:  # noqa: BLE001 - an unbacked SymInt raises torch-internal errors
        return False
    return True


def module_table(model: Any) -> tuple[tuple[str, str], ...]:
    return tuple((name or "<root>", type(m).__name__) for name, m in model.named_modules())


def export_program(model: Any, args: tuple, kwargs: dict) -> Any:
    """`torch.export.export(model, args, kwargs, strict=False)`, errors as CaptureError.

    A failure is expected (the caller falls back and says so in the header), so export's own
    stderr dump of the partial graph and its log lines are silenced meanwhile.
    """
    import torch

    loggers = [logging.getLogger(n) for n in ("torch.export", "torch._export", "torch.fx",
                                              "torch._dynamo", "torch._subclasses")]
    levels = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.CRITICAL)
        with contextlib.redirect_stderr(io.StringIO()):
            return torch.export.export(model, args, kwargs, strict=False)
    except Exception as e:  # noqa: BLE001 - export raises many unrelated exception types
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        first = first.replace(os.getcwd() + os.sep, "")  # keep headers free of absolute paths
        raise CaptureError(f"torch.export failed: {type(e).__name__}: {first}") from e
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def graph_from_export(program: Any, model: Any, stage: str, method: str) -> Graph:
    """Convert an ExportedProgram into the neutral Graph."""
    from torch.export.graph_signature import InputKind

    sig = program.graph_signature
    kinds = {InputKind.PARAMETER: "parameter", InputKind.BUFFER: "buffer",
             InputKind.CONSTANT_TENSOR: "constant"}
    refs: dict[Any, str] = {}        # fx node -> value name
    multi: dict[Any, str] = {}       # fx node with several outputs -> its node name
    params: list[Param] = []
    nodes: list[Node] = []
    counts: dict[tuple[str, str], int] = defaultdict(int)
    types: dict[str, TensorType] = {}  # value name -> type
    spec_of = {spec.arg.name: spec for spec in sig.input_specs if hasattr(spec.arg, "name")}
    n_user = 0
    for fx in program.graph.nodes:
        val = fx.meta.get("val")
        if fx.op == "placeholder":
            spec = spec_of.get(fx.name)
            if spec is not None and spec.kind in kinds:
                refs[fx] = spec.target
                types[spec.target] = tensor_type(val)
                params.append(Param(spec.target, types[spec.target], kinds[spec.kind]))
                continue
            name = f"<root>.forward.0.input.{n_user}"
            n_user += 1
            refs[fx] = name
            types[name] = tensor_type(val)
            nodes.append(Node(len(nodes), name, "input", "input",
                              output_types=(types[name],), module="<root>"))
        elif fx.op == "call_function" and fx.target is operator.getitem and fx.args[0] in multi:
            refs[fx] = value_ref(multi[fx.args[0]], int(fx.args[1]), 2)
        elif fx.op == "call_function":
            node = _op_node(fx, val, refs, multi, counts, len(nodes), types)
            nodes.append(node)
            for i, t in enumerate(node.output_types):
                types[value_ref(node.name, i, len(node.output_types))] = t
        elif fx.op == "output":
            operands = tuple(refs[a] for a in _flat_nodes(fx.args) if a in refs)
            nodes.append(Node(len(nodes), "<root>.forward.0.output", "output", "output",
                              operands=operands, input_types=_types(types, operands),
                              module="<root>"))
    return Graph(entry=type(model).__name__, stage=stage, method=method,  # type: ignore[arg-type]
                 params=tuple(params), nodes=tuple(nodes), modules=module_table(model))


def _types(types: dict[str, TensorType], refs: Any) -> tuple[TensorType, ...]:
    return tuple(types.get(r, TensorType("?")) for r in refs)


def _op_node(fx: Any, val: Any, refs: dict, multi: dict, counts: dict, index: int,
             types: dict[str, TensorType]) -> Node:
    target = fx.target
    packet = getattr(target, "overloadpacket", None)
    op = str(packet) if packet is not None else getattr(target, "__name__", str(target))
    stack = fx.meta.get("nn_module_stack") or {}
    module = (list(stack.values())[-1][0] if stack else "") or "<root>"
    call = counts[(module, op)]
    counts[(module, op)] += 1
    name = f"{module}::{op}.forward.{call}"
    schema = getattr(target, "_schema", None)
    arg_names = [a.name for a in schema.arguments] if schema is not None else []
    operands: list[str] = []
    attrs: list[tuple[str, str]] = []
    items = [(arg_names[i] if i < len(arg_names) else f"arg{i}", a) for i, a in enumerate(fx.args)]
    items += sorted(fx.kwargs.items())
    for key, arg in items:
        found = [refs[n] for n in _flat_nodes(arg) if n in refs]
        if found:
            operands.extend(found)
        else:
            attrs.append((key, format_attr(arg)))
    if isinstance(val, (tuple, list)):
        outs = tuple(tensor_type(v) for v in val)
        multi[fx] = name
        refs[fx] = name
    else:
        outs = (tensor_type(val),)
        refs[fx] = name
    return Node(index, name, op, "op", operands=tuple(operands), attrs=tuple(attrs),
                input_types=_types(types, operands), output_types=outs, module=module,
                source=stack_trace_location(fx.meta.get("stack_trace")))


def _flat_nodes(arg: Any) -> list[Any]:
    import torch.fx

    if isinstance(arg, torch.fx.Node):
        return [arg]
    if isinstance(arg, (list, tuple)):
        return [n for a in arg for n in _flat_nodes(a)]
    if isinstance(arg, dict):
        return [n for a in arg.values() for n in _flat_nodes(a)]
    return []
