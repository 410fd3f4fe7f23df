"""Text writers: `Graph -> str` for the `.ir` (execution order) and `.sorted.ir` formats.

Both share one header and one node line format (docs/ir-format.md), so `read_ir` parses either.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Literal

from irdump._graph import FORMAT_VERSION, Graph, Node

SortMode = Literal["module", "op"]
SORT_MODES: tuple[str, ...] = ("module", "op")


def header(graph: Graph) -> list[str]:
    """The `#` header lines shared by both text formats."""
    n_ops = sum(1 for n in graph.nodes if n.kind == "op")
    numel = 0
    for p in graph.params:
        size = 1
        for s in p.type.shape:
            size *= s if isinstance(s, int) else 0
        numel += size
    lines = [
        f"# sleuth-ir format_version={FORMAT_VERSION}",
        f"# entry: {graph.entry}",
        f"# stage: {graph.stage}",
        f"# capture: {graph.method}",
        f"# nodes: {len(graph.nodes)} ({n_ops} ops)",
        f"# parameters: {len(graph.params)} ({numel:,} elements)",
    ]
    lines += [f"#   {p.kind} {p.name}: {p.type}" for p in graph.params]
    lines += [f"# note: {note}" for note in graph.notes]
    return lines


def node_line(node: Node) -> str:
    """`INDEX  NAME = OP(%OPERANDS) {ATTRS} : (IN TYPES) -> (OUT TYPES)  @MODULE  # SOURCE`."""
    operands = ", ".join(f"%{o}" for o in node.operands)
    attrs = list(node.attrs)
    if node.forward:
        attrs.append(("forward", node.forward))
    attr_text = " {" + ", ".join(f"{k}={v}" for k, v in attrs) + "}" if attrs else ""
    ins = ", ".join(str(t) for t in node.input_types)
    outs = ", ".join(str(t) for t in node.output_types)
    line = (f"{node.index:>4}  {node.name} = {node.op}({operands}){attr_text}"
            f" : ({ins}) -> ({outs})  @{node.module}")
    if node.source:
        line += f"  # {node.source}"
    return line


def to_ir(graph: Graph) -> str:
    """The `.ir` text: header, then one numbered line per node in execution order."""
    return "\n".join(header(graph) + [""] + [node_line(n) for n in graph.nodes]) + "\n"


def to_sorted_ir(graph: Graph, mode: SortMode = "module") -> str:
    """The `.sorted.ir` text: the same node lines grouped, then `# Order:` (execution order).

    mode `module`: one group per module, groups in the order each module first ran an op,
    nodes in execution order inside a group. mode `op`: one group per op, ops sorted by name.
    """
    if mode not in SORT_MODES:
        from irdump._errors import IrDumpError

        raise IrDumpError(f"unknown sort mode {mode!r}; use one of {', '.join(SORT_MODES)}")
    groups: dict[str, list[Node]] = defaultdict(list)
    for n in graph.nodes:
        groups[n.module if mode == "module" else n.op].append(n)
    keys = list(groups) if mode == "module" else sorted(groups)
    types = dict(graph.modules)
    lines = header(graph) + [f"# sort: {mode}"]
    for key in keys:
        label = f"{key} ({types[key]})" if mode == "module" and key in types else key
        lines += ["", f"# {mode} {label}"] + [node_line(n) for n in groups[key]]
    lines += ["", "# Order: " + " ".join(str(n.index) for n in graph.nodes)]
    return "\n".join(lines) + "\n"
