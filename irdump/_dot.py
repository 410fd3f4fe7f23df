"""Graphviz writer: `Graph -> str` (DOT) and DOT -> SVG through the real `dot` binary.

Modules become nested clusters (by dotted-name prefix), op nodes show the op, name and output
shapes, edges carry the tensor shape they move. Colours come from a hash of the op name, so
the same op has the same colour in every graph and every process. `depth=N` keeps N levels of
module clusters and draws every module at level N+1 (with all it contains) as one node (level 1
is a child of the root: `layers`, level 2 `layers.0`, ...); a graph with
more than `max_nodes` visible nodes collapses itself to the deepest level that fits, and says so
in its title.
"""
from __future__ import annotations

import colorsys
import hashlib
from collections import defaultdict

from irdump._errors import RenderError
from irdump._graph import FORMAT_VERSION, Graph, Node

DEFAULT_MAX_NODES = 500  # dot needs seconds beyond this, and nobody reads it


def op_color(op: str) -> str:
    """A light fill colour derived from the op name only."""
    h = int.from_bytes(hashlib.md5(op.encode()).digest()[:2], "big") / 65535
    r, g, b = colorsys.hsv_to_rgb(h, 0.35, 0.97)
    return f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}"


def _q(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return '"' + escaped + '"'


def _depth(module: str) -> int:
    return 0 if module in ("<root>", "<none>") else module.count(".") + 1


def _ancestor(module: str, depth: int) -> str:
    return module if _depth(module) <= depth else ".".join(module.split(".")[:depth])


def _shape(node: Node) -> str:
    return ", ".join("[" + ",".join(str(s) for s in t.shape) + "]" for t in node.output_types)


def auto_depth(graph: Graph, max_nodes: int) -> int | None:
    """The deepest collapse level whose visible node count fits `max_nodes` (None: no need)."""
    if len(graph.nodes) <= max_nodes:
        return None
    deepest = max((_depth(n.module) for n in graph.nodes), default=0)
    for d in range(deepest - 1, -1, -1):
        visible = {(_ancestor(n.module, d + 1) if _depth(n.module) > d else n.index)
                   for n in graph.nodes}
        if len(visible) <= max_nodes:
            return d
    return 0


def to_dot(graph: Graph, depth: int | None = None, max_nodes: int = DEFAULT_MAX_NODES) -> str:
    """The `.dot` text of `graph`; `depth` collapses deeper modules (see the module doc)."""
    note = ""
    if depth is None:
        depth = auto_depth(graph, max_nodes)
        if depth is not None:
            note = (f"\n(collapsed to module depth {depth} automatically: "
                    f"{len(graph.nodes)} nodes > {max_nodes}; pass depth= to choose)")
    types = dict(graph.modules)
    module_index = {name: i for i, (name, _) in enumerate(graph.modules)}
    # visible id of each node, and the member count of each collapsed module
    vis: dict[int, str] = {}
    collapsed: dict[str, list[Node]] = defaultdict(list)
    for n in graph.nodes:
        if depth is not None and _depth(n.module) > depth:
            anc = _ancestor(n.module, depth + 1)
            vis[n.index] = f"m{module_index.get(anc, len(module_index))}"
            collapsed[anc].append(n)
        else:
            vis[n.index] = f"n{n.index}"
    # which cluster each visible item lives in: a node in its module, a collapsed module in
    # its parent
    members: dict[str, list[str]] = defaultdict(list)
    lines_of: dict[str, str] = {}
    for n in graph.nodes:
        if vis[n.index].startswith("n"):
            if n.kind == "op":
                label = f"{n.op}\n{n.name}\n{_shape(n)}"
            else:
                label = f"{n.name}\n{_shape(n) or n.op}"
            shape = "box" if n.kind == "op" else "ellipse"
            lines_of[vis[n.index]] = (f"{vis[n.index]} [label={_q(label)}, shape={shape}, "
                                      f"fillcolor={_q(op_color(n.op))}];")
            members[n.module].append(vis[n.index])
    for anc, inner in collapsed.items():
        vid = vis[inner[0].index]
        label = f"{anc} ({types.get(anc, '?')})\n{len(inner)} nodes"
        lines_of[vid] = f"{vid} [label={_q(label)}, shape=box3d, fillcolor=\"#e8e8e8\"];"
        parent = anc.rsplit(".", 1)[0] if "." in anc else "<root>"
        members[parent].append(vid)
    out = [f"// sleuth-ir format_version={FORMAT_VERSION}",
           f"digraph {_q(graph.stage)} {{",
           f"  graph [label={_q(f'{graph.entry} {graph.stage} ({graph.method}){note}')}, "
           f"labelloc=t, fontname=Helvetica, rankdir=TB, "
           f"comment={_q(f'sleuth-ir format_version={FORMAT_VERSION}')}];",
           "  node [style=\"rounded,filled\", fontname=Helvetica, fontsize=10];",
           "  edge [fontname=Helvetica, fontsize=8];"]
    out += _clusters(members, lines_of, types, module_index)
    seen: set[tuple[str, str]] = set()
    by_ref = {}
    for n in graph.nodes:
        for i, t in enumerate(n.output_types):
            by_ref[n.name if len(n.output_types) <= 1 else f"{n.name}#{i}"] = (n.index, t)
    for n in graph.nodes:
        for ref in n.operands:
            src = by_ref.get(ref)
            if src is None:
                continue  # parameters and constants are listed in the .ir header
            a, b = vis[src[0]], vis[n.index]
            if a == b or (a, b) in seen:
                continue
            seen.add((a, b))
            label = "[" + ",".join(str(s) for s in src[1].shape) + "]"
            out.append(f"  {a} -> {b} [label={_q(label)}];")
    out.append("}")
    return "\n".join(out) + "\n"


def _clusters(members: dict[str, list[str]], lines_of: dict[str, str], types: dict[str, str],
              module_index: dict[str, int]) -> list[str]:
    """Nest clusters by dotted-name prefix; `<root>` and `<none>` items stay top level."""
    children: dict[str, list[str]] = defaultdict(list)
    needed = {m for m in members if m not in ("<root>", "<none>")}
    for m in sorted(needed):
        parts = m.split(".")
        for k in range(1, len(parts)):
            needed.add(".".join(parts[:k]))
    for m in sorted(needed, key=lambda x: (module_index.get(x, 1 << 30), x)):
        parent = m.rsplit(".", 1)[0] if "." in m else "<root>"
        children[parent].append(m)

    def emit(module: str, indent: str) -> list[str]:
        lines = [indent + lines_of[v] for v in members.get(module, ())]
        for child in children.get(module, ()):
            label = f"{child} ({types.get(child, '?')})"
            lines.append(f"{indent}subgraph cluster_{module_index.get(child, 'x')} {{")
            lines.append(f"{indent}  label={_q(label)}; style=rounded; color=gray50;")
            lines += emit(child, indent + "  ")
            lines.append(f"{indent}}}")
        return lines

    return emit("<root>", "  ") + ["  " + lines_of[v] for v in members.get("<none>", ())]


def render_svg(dot_text: str) -> str:
    """Render DOT text to SVG with Graphviz `dot`.

    Raises RenderError when `dot` is missing (install Graphviz) or rejects the input.
    """
    import subprocess

    import graphviz

    try:
        return graphviz.pipe("dot", "svg", dot_text.encode()).decode()
    except graphviz.ExecutableNotFound as e:
        raise RenderError("Graphviz `dot` was not found on PATH; install Graphviz "
                          "(apt-get install graphviz, brew install graphviz, conda install "
                          "graphviz) or save without the 'svg' format") from e
    except (graphviz.CalledProcessError, subprocess.CalledProcessError) as e:
        raise RenderError(f"dot failed to render the graph: {e}") from e
