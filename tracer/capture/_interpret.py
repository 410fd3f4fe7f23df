"""The interpreter mode for torch.compile ("compiled": "interpret"): each compiled graph, after
AOTAutograd, run node by node in a dumped step, every aten node an op record.

A compiled region fuses its ops into kernels that no dispatch mode sees one by one. When a
Dumper asks for this mode, each graph dynamo compiles is also handed to AOTAutograd with
compilers that keep its forward and backward graphs as they are (`interpretable`, no
decomposition: the aten ops eager runs); in a dumped step the region runs those graphs through
`Interpreter`, which makes each call_function node's inputs and outputs op records
``{module}::{aten op}.{phase}.{call}...``, named as an eager run's op records are, with the
module from the node's ``nn_module_stack`` (``fwd_nn_module_stack`` in backward) under the
region's module and the source line from the node's stack trace. So a graph-level fault (a
constant baked in when the graph was traced, a branch only the compiled code takes) is named at
its op and line, with the compiled graph's semantics. Steps not dumped run the backend's code.
"""
from __future__ import annotations

import re
from typing import Any, Callable

import torch
import torch.fx

from sleuth.common import INTERNAL, frame_kind, short_path
from tracer.capture._naming import NONE, ROOT, op_name, op_scope

_FILE_LINE = re.compile(r'File "([^"]+)", line (\d+)')
_INDEX = re.compile(r"\[(\d+)\]")
_KEY = re.compile(r"""\._modules\[['"]([^'"]+)['"]\]""")


class Graph:
    """One of a region's graphs after AOTAutograd (`phase` "forward" or "backward"), called by
    AOTAutograd's runtime with its flat inputs: run by `runner` where one is set (a dumped
    step's interpreter), else by the graph module itself."""

    _boxed_call = True  # AOTAutograd hands the inputs as one list

    def __init__(self, gm: torch.fx.GraphModule, phase: str, region: Any) -> None:
        self.gm, self.phase, self.region = gm, phase, region

    def __call__(self, args: list) -> Any:
        runner = self.region.runner
        inputs = list(args)
        args.clear()  # the boxed convention: the callee lets go of its inputs
        if runner is None:
            return self.gm(*inputs)
        return runner(self, inputs)


def interpretable(gm: Any, example_inputs: Any, region: Any) -> Callable[..., Any]:
    """`gm` (dynamo's graph) through AOTAutograd, its forward and backward graphs kept as
    `Graph`s of `region`: what a dumped step of the interpreter mode runs."""
    from torch._functorch.aot_autograd import aot_module_simplified

    def keep(phase: str) -> Callable[..., Any]:
        return lambda graph, _inputs: Graph(graph, phase, region)

    return aot_module_simplified(gm, example_inputs, fw_compiler=keep("forward"),
                                 bw_compiler=keep("backward"))


_STEP = re.compile(r"""\.(\w+)|\[(\d+)\]|\[['"]([^'"]+)['"]\]""")


def module_stack_paths(node: torch.fx.Node, phase: str) -> list[str]:
    """The ``nn_module_stack`` entries of `node` (``fwd_nn_module_stack`` in backward),
    innermost first: dynamo's paths to the modules from the frame's locals,
    ``L['self'].layers[0]``; [] where the node was made by the frame's own code."""
    stack = node.meta.get("nn_module_stack" if phase == "forward" else "fwd_nn_module_stack") \
        or node.meta.get("nn_module_stack") or {}
    return [str(entry[0]) for entry in reversed(list(stack.values()))]


def resolve(path: str, roots: dict[str, Any], globals_: dict[str, Any] | None = None) -> Any:
    """The object `path` (``L['self'].model.layers[1]``, ``G['model'].mlp``) names, from the
    frame's locals that hold modules (`roots`) or its globals (`globals_`); None where a step
    does not resolve."""
    match = re.match(r"""([LG])\[['"]([^'"]+)['"]\]""", path)
    scope = (roots if match.group(1) == "L" else globals_ or {}) if match else {}
    if match is None or match.group(2) not in scope:
        return None
    obj = scope[match.group(2)]
    rest = path[match.end():]
    pos = 0
    while pos < len(rest):
        step = _STEP.match(rest, pos)
        if step is None:
            return None
        attr, index, key = step.groups()
        try:
            if attr is not None:
                obj = getattr(obj, attr)
            elif index is not None:
                obj = obj[int(index)]
            else:
                obj = obj[key] if isinstance(obj, dict) else getattr(obj, key)
        except (AttributeError, IndexError, KeyError, TypeError):
            return None
        pos = step.end()
    return obj


def module_path(owner: str, path: str) -> str:
    """`path` as a dotted name under `owner`, where the module it names is not one the model
    names: ``L['self'].layers[0].attn`` -> ``{owner}.layers.0.attn`` (a global's path, ``G[...]``,
    likewise)."""
    if not path or not path.startswith(("L[", "G[")):
        return owner
    if "__self__" in path:  # through a saved bound method: no dotted name says where
        return owner
    path = path[path.index("]") + 1:]
    path = _INDEX.sub(r".\1", _KEY.sub(r".\1", path)).strip(".")
    if not path:
        return owner
    return path if owner in (ROOT, NONE) else f"{owner}.{path}"


_sources: dict[str, str] = {}


def node_source(node: torch.fx.Node, fallback: str) -> str:
    """The user's ``file:line`` in the node's stack trace: its innermost frame outside torch,
    the standard library and Sleuth; `fallback` where the node has none."""
    trace = node.meta.get("stack_trace")
    if not trace:
        return fallback
    found = _sources.get(trace)
    if found is None:
        found = fallback
        for path, line in reversed(_FILE_LINE.findall(trace)):
            if frame_kind(path) != INTERNAL:
                found = f"{short_path(path)}:{line}"
                break
        _sources[trace] = found
    return found


class Interpreter(torch.fx.Interpreter):
    """Runs one `Graph` in a dumped step: for each aten node, `before(node, args, kwargs)` (its
    input records, before the op can write them) returns a plan or None, the op runs inside
    `quiet` (so the op mode and the module hooks pass its ops by: they are this interpreter's
    records), and `after(plan, output)` makes its output records."""

    def __init__(self, gm: torch.fx.GraphModule, before: Callable[..., Any],
                 after: Callable[..., None], quiet: Callable[[Callable[[], Any]], Any]) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self._before, self._after, self._quiet = before, after, quiet

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        plan = self._before(n, args, kwargs)
        out = self._quiet(lambda: n.target(*args, **kwargs))
        if plan is not None:
            self._after(plan, out)
        return out


def op_of(node: torch.fx.Node) -> str:
    return op_name(node.target)


def scope_of(module: str, node: torch.fx.Node) -> str:
    return op_scope(module, op_of(node))
