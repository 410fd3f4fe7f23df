"""Forward capture from one real call through a TorchDispatchMode.

Every aten op that eager PyTorch dispatches is recorded with its tensor operands (matched by
tensor identity to the op, parameter or input that made them), non-tensor arguments, output
dtypes and shapes, the innermost running module (forward pre/post hooks on every submodule) and
the user's source line. Names follow the tracer's op records exactly:
`{module}::{aten.op}.forward.{call}`. While recording, each op output's `grad_fn` is noted so the
backward capture (`_capture_backward`) can link autograd nodes to the forward op that made them.
Works on any model, including data-dependent control flow that torch.export rejects.
"""
from __future__ import annotations

import weakref
from collections import defaultdict
from typing import Any

from irdump._graph import Graph, Node, Param, TensorType, format_attr, value_ref
from irdump._source import user_frame_location


def _tensor_type(t: Any) -> TensorType:
    return TensorType(str(t.dtype).removeprefix("torch."), tuple(int(s) for s in t.shape))


class DispatchCapture:
    """Records one call of `model`. Use `start()`, run the model, then `stop(output)`.

    `start` installs hooks and the dispatch mode; `stop` removes them (call it in `finally`).
    After `stop`, `graph` holds the forward Graph and `grad_fn_links` maps each autograd node
    made during the call to (forward node name, output index).
    """

    def __init__(self, model: Any, args: tuple, kwargs: dict, stage: str = "forward_eager",
                 root_pushed: bool = False) -> None:
        from torch.utils.weak import WeakIdKeyDictionary

        self.model = model
        self.stage = stage
        self.graph: Graph | None = None
        self.grad_fn_links: dict[Any, tuple[str, int]] = {}
        self._refs: Any = WeakIdKeyDictionary()    # tensor -> value name
        self._types: dict[str, TensorType] = {}
        self._nodes: list[Node] = []
        self._params: list[Param] = []
        self._counts: dict[tuple[str, str], int] = defaultdict(int)
        # (module, call name) of every running module, innermost last
        self._stack: list[tuple[Any, str]] = [(model, "<root>")] if root_pushed else []
        self._pending: list[tuple[Any, str, int]] = []  # outputs whose grad_fn is set later
        self._handles: list[Any] = []
        self._mode: Any = None
        self._n_const = 0
        self._root_pushed = root_pushed
        for name, p in model.named_parameters():
            self._add_param(p, name, "parameter")
        for name, b in model.named_buffers():
            self._add_param(b, name, "buffer")
        self._declare_inputs(args, kwargs)

    def _add_param(self, t: Any, name: str, kind: str) -> None:
        if t in self._refs:
            return
        self._refs[t] = name
        self._types[name] = _tensor_type(t)
        self._params.append(Param(name, self._types[name], kind))  # type: ignore[arg-type]

    def _declare_inputs(self, args: tuple, kwargs: dict) -> None:
        import torch
        from torch.utils._pytree import tree_leaves

        i = 0
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor):
                name = f"<root>.forward.0.input.{i}"
                i += 1
                self._refs[leaf] = name
                self._types[name] = _tensor_type(leaf)
                self._nodes.append(Node(len(self._nodes), name, "input", "input",
                                        output_types=(self._types[name],)))

    # -- hooks ---------------------------------------------------------------------------------
    def start(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        capture = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
                kwargs = kwargs or {}
                capture._flush_pending()
                out = func(*args, **kwargs)
                capture._record(func, args, kwargs, out)
                return out

        from torch.nn.modules.module import (register_module_forward_hook,
                                             register_module_forward_pre_hook)

        from tracer.capture import CallNames

        self._names = CallNames()  # the tracer's names, so a node names its record
        self._names.add_root(self.model)
        self._handles += [register_module_forward_pre_hook(self._push),
                          register_module_forward_hook(self._pop, always_call=True)]
        self._mode = _Mode()
        self._mode.__enter__()

    def _push(self, module: Any, _args: Any) -> None:
        stack = self._stack
        if stack and stack[-1][0] is module:
            return  # the root, pushed by the caller of this capture
        name = self._names.name(module, stack[-1] if stack else None)
        if name is not None:
            stack.append((module, name))

    def _pop(self, module: Any, _args: Any, _output: Any) -> None:
        # returns None: a forward hook's return value would replace the module's output
        stack = self._stack
        if stack and stack[-1][0] is module and not (self._root_pushed and len(stack) == 1):
            stack.pop()

    def stop(self, output: Any = None) -> Graph:
        """Remove the mode and hooks; build the Graph (output node from `output`)."""
        try:
            if self._mode is not None:
                self._mode.__exit__(None, None, None)
                self._mode = None
        finally:
            for h in self._handles:
                h.remove()
            self._handles.clear()
        self._flush_pending()
        self._add_output(output)
        from irdump._capture_export import module_table

        self.graph = Graph(entry=type(self.model).__name__, stage=self.stage, method="dispatch",
                           params=tuple(self._params), nodes=tuple(self._nodes),
                           modules=module_table(self.model))
        return self.graph

    # -- recording -----------------------------------------------------------------------------
    def _operand(self, t: Any) -> str:
        name = self._refs.get(t)
        if name is None:  # a tensor made outside the graph (a constant captured by the code)
            name = f"<const>.{self._n_const}"
            self._n_const += 1
            self._refs[t] = name
            self._types[name] = _tensor_type(t)
            self._params.append(Param(name, self._types[name], "constant"))
        return name

    def _record(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        import torch

        op = str(func.overloadpacket)
        module = self._stack[-1][1] if self._stack else "<none>"
        call = self._counts[(module, op)]
        self._counts[(module, op)] += 1
        name = f"{module}::{op}.forward.{call}"
        schema_args = func._schema.arguments
        items = [(schema_args[i].name if i < len(schema_args) else f"arg{i}", a)
                 for i, a in enumerate(args)] + sorted(kwargs.items())
        operands: list[str] = []
        attrs: list[tuple[str, str]] = []
        for key, a in items:
            if isinstance(a, torch.Tensor):
                operands.append(self._operand(a))
            elif isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a):
                operands.extend(self._operand(x) for x in a if isinstance(x, torch.Tensor))
            else:
                attrs.append((key, format_attr(a)))
        outs = out if isinstance(out, (list, tuple)) else (out,)
        out_types = tuple(_tensor_type(o) if isinstance(o, torch.Tensor)
                          else TensorType(type(o).__name__) for o in outs)
        for i, o in enumerate(outs):
            if isinstance(o, torch.Tensor):
                ref = value_ref(name, i, len(outs))
                self._refs[o] = ref
                self._types[ref] = out_types[i]
                # weakly: a mode that keeps an op's output alive past its return makes torch hand
                # the caller a detached alias (an extra aten.detach every other mode records)
                self._pending.append((weakref.ref(o), name, i))
        self._nodes.append(Node(
            len(self._nodes), name, op, "op", operands=tuple(operands), attrs=tuple(attrs),
            input_types=tuple(self._types[r] for r in operands), output_types=out_types,
            module=module, source=user_frame_location(2)))

    def _flush_pending(self) -> None:
        # autograd sets grad_fn after the dispatch returns, so read it at the next op
        for ref, name, i in self._pending:
            t = ref()
            fn = t.grad_fn if t is not None else None
            if fn is not None and fn not in self.grad_fn_links:
                self.grad_fn_links[fn] = (name, i)
        self._pending.clear()

    def _add_output(self, output: Any) -> None:
        import torch
        from torch.utils._pytree import tree_leaves

        if output is None:
            return
        operands = tuple(self._operand(t) for t in tree_leaves(output)
                         if isinstance(t, torch.Tensor))
        self._nodes.append(Node(len(self._nodes), "<root>.forward.0.output", "output", "output",
                                operands=operands,
                                input_types=tuple(self._types[r] for r in operands)))


def capture_dispatch(model: Any, args: tuple, kwargs: dict, stage: str = "forward_eager"
                     ) -> tuple[DispatchCapture, Any]:
    """Run `model(*args, **kwargs)` once under the recording mode; return (capture, output)."""
    capture = DispatchCapture(model, args, kwargs, stage)
    capture.start()
    output = None
    try:
        output = model(*args, **kwargs)
    finally:
        capture.stop(output)
    return capture, output
