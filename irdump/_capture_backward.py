"""Backward capture: the autograd graph of a real loss, walked through `grad_fn.next_functions`.

Each autograd node becomes a Node named `{module}::{NodeClass}.backward.{call}` (e.g.
`fc1::AddmmBackward0.backward.0`), where `module` is the module of the forward op whose output
holds this `grad_fn` (known from the dispatch capture), the owning module of the parameter for
`AccumulateGrad`, or `<none>` for autograd nodes made outside the model (the loss). `forward`
names the forward node it came from. Nodes are listed in the order the autograd engine runs them
on one CPU thread: a node is ready once every node feeding it a gradient has run, and among ready
nodes the one created last in the forward (highest sequence number) runs first.
"""
from __future__ import annotations

import heapq
from collections import defaultdict
from typing import Any

from irdump._graph import Graph, Node, Param, TensorType, value_ref


def capture_backward(roots: Any, forward: Graph, links: dict[Any, tuple[str, int]],
                     param_names: dict[int, str], modules: tuple[tuple[str, str], ...]
                     ) -> Graph:
    """Build the backward Graph of the tensors `roots` (usually the loss).

    `links` maps grad_fn -> (forward node name, output index) as recorded by DispatchCapture;
    `param_names` maps id(parameter) -> its dotted name.
    """
    import torch

    roots = [roots] if isinstance(roots, torch.Tensor) else list(roots)
    fwd = {n.name: n for n in forward.nodes}
    params = {p.name: p for p in forward.params}
    start = [r.grad_fn for r in roots if r.grad_fn is not None]
    # discover the graph and count, for each node, the edges feeding it a gradient
    seen: dict[Any, None] = {}
    indeg: dict[Any, int] = defaultdict(int)
    preds: dict[Any, list[tuple[Any, int]]] = defaultdict(list)
    todo = list(start)
    while todo:
        fn = todo.pop()
        if fn in seen:
            continue
        seen[fn] = None
        for k, (nxt, _input_nr) in enumerate(fn.next_functions):
            if nxt is None:
                continue
            indeg[nxt] += 1
            preds[nxt].append((fn, k))
            todo.append(nxt)
    ready = [(-_seq(fn), i, fn) for i, fn in enumerate(dict.fromkeys(start))]
    heapq.heapify(ready)
    order: list[Any] = []
    tiebreak = len(ready)
    while ready:
        _, _, fn = heapq.heappop(ready)
        order.append(fn)
        for nxt, _ in fn.next_functions:
            if nxt is None:
                continue
            indeg[nxt] -= 1
            if indeg[nxt] == 0:
                tiebreak += 1
                heapq.heappush(ready, (-_seq(nxt), tiebreak, nxt))

    nodes: list[Node] = []
    names: dict[Any, str] = {}
    counts: dict[tuple[str, str], int] = defaultdict(int)
    for i, r in enumerate(roots):
        ttype = TensorType(str(r.dtype).removeprefix("torch."), tuple(r.shape))
        nodes.append(Node(len(nodes), f"<loss>.backward.0.input.{i}", "input", "input",
                          output_types=(ttype,), module="<none>"))
    loss_inputs = {fn: f"<loss>.backward.0.input.{i}" for i, fn in
                   reversed(list(enumerate(r.grad_fn for r in roots)))}
    for fn in order:
        op = type(fn).__name__
        link = links.get(fn)
        fnode = fwd.get(link[0]) if link else None
        attrs: list[tuple[str, str]] = []
        in_types: tuple[TensorType, ...]
        if op == "AccumulateGrad":
            pname = param_names.get(id(fn.variable), "?")
            module = pname.rsplit(".", 1)[0] if "." in pname else "<root>"
            attrs.append(("param", pname))
            in_types = (params[pname].type,) if pname in params else (TensorType("?"),)
            source = ""
        elif fnode is not None:
            module, source = fnode.module, fnode.source
            in_types = (fnode.output_types[link[1]],)
        else:
            module, source, in_types = "<none>", "", ()
        call = counts[(module, op)]
        counts[(module, op)] += 1
        name = f"{module}::{op}.backward.{call}"
        names[fn] = name
        operands = [value_ref(names[p], k, len(p.next_functions))
                    for p, k in preds.get(fn, ()) if p in names]
        if fn in loss_inputs:
            operands.insert(0, loss_inputs[fn])
        outs = tuple(_grad_type(nxt, nr, links, fwd, params, param_names)
                     for nxt, nr in fn.next_functions)
        nodes.append(Node(len(nodes), name, op, "op", operands=tuple(operands),
                          attrs=tuple(attrs), input_types=in_types, output_types=outs,
                          module=module, source=source, forward=fnode.name if fnode else ""))
    used = {a[1] for n in nodes for a in n.attrs if a[0] == "param"}
    return Graph(entry=forward.entry, stage="backward", method="autograd",
                 params=tuple(p for p in forward.params if p.name in used),
                 nodes=tuple(nodes), modules=modules)


def _seq(fn: Any) -> int:
    try:
        return int(fn._sequence_nr())
    except (AttributeError, RuntimeError):
        return -1


def _grad_type(nxt: Any, input_nr: int, links: dict, fwd: dict[str, Node],
               params: dict[str, Param], param_names: dict[int, str]) -> TensorType:
    """The gradient flowing to `nxt` has the shape of the tensor `nxt` made in the forward."""
    if nxt is None:
        return TensorType("none")
    if type(nxt).__name__ == "AccumulateGrad":
        p = params.get(param_names.get(id(nxt.variable), ""))
        return p.type if p else TensorType("?")
    link = links.get(nxt)
    node = fwd.get(link[0]) if link else None
    if node is None or link[1] >= len(node.output_types):
        return TensorType("?")
    return node.output_types[link[1]]
