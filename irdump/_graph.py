"""The neutral graph model every capture produces and every writer consumes.

A `Graph` is a flat list of `Node`s in execution order plus the parameters it reads. Values are
referred to by name: a node's result is its name (`name#i` for output `i` of a node with several
outputs), a parameter or buffer by its dotted name, a user input by its record name
`<root>.forward.0.input.{i}`. Nothing here holds tensors, ids or addresses, so two captures of
the same model are equal and the writers are pure `Graph -> str` functions.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FORMAT_VERSION = "1.0"

NodeKind = Literal["input", "op", "output"]
CaptureMethod = Literal["torch.export", "torch.export+decompositions", "dispatch", "autograd"]


@dataclass(frozen=True)
class TensorType:
    """Dtype and shape of one tensor value."""

    dtype: str
    """Torch dtype without the `torch.` prefix (`float32`), or a Python type name (`int`)."""
    shape: tuple[int | str, ...] = ()
    """Sizes; a symbolic size is kept as its string."""

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(str(s) for s in self.shape)}]"


@dataclass(frozen=True)
class Param:
    """A parameter, buffer or constant the graph reads."""

    name: str
    """Dotted name from `named_parameters()` / `named_buffers()`."""
    type: TensorType
    """Its dtype and shape."""
    kind: Literal["parameter", "buffer", "constant"] = "parameter"
    """Where it comes from."""


@dataclass(frozen=True)
class Node:
    """One graph node: a user input, an op call, or the graph output."""

    index: int
    """Position in execution order, 0-based."""
    name: str
    """Record-style name, e.g. `fc1::aten.addmm.forward.0` (see docs/ir-format.md)."""
    op: str
    """`aten.addmm`, an autograd node class (`AddmmBackward0`), `input` or `output`."""
    kind: NodeKind = "op"
    """What the node is."""
    operands: tuple[str, ...] = ()
    """Names of the values it reads, in argument order."""
    attrs: tuple[tuple[str, str], ...] = ()
    """Non-tensor arguments as (name, printed value), in argument order."""
    input_types: tuple[TensorType, ...] = ()
    """Types of the operands, in order."""
    output_types: tuple[TensorType, ...] = ()
    """Types of the results, in order."""
    module: str = "<root>"
    """Dotted name of the innermost module that ran it (`<root>`, or `<none>` outside the model)."""
    source: str = ""
    """`path:LINE` of the innermost user frame, path relative to the cwd or site-packages."""
    forward: str = ""
    """For backward nodes: the name of the forward node this gradient node came from."""


@dataclass(frozen=True)
class Graph:
    """A captured graph of one stage."""

    entry: str
    """Class name of the captured module."""
    stage: str
    """`forward`, `forward_aten_decomposed`, `backward` or `forward_eager`."""
    method: CaptureMethod
    """How it was captured."""
    params: tuple[Param, ...] = ()
    """Parameters, buffers and constants read by the graph, in the order the model lists them."""
    nodes: tuple[Node, ...] = ()
    """Nodes in execution order; `nodes[i].index == i`."""
    modules: tuple[tuple[str, str], ...] = ()
    """(dotted name, class name) of every module that appears in the graph's scopes, in
    `named_modules()` order; the root is `<root>`."""
    notes: tuple[str, ...] = field(default=())
    """Free-form lines for the header (why a fallback was used, ...)."""

    def __post_init__(self) -> None:
        assert all(n.index == i for i, n in enumerate(self.nodes)), "nodes must be numbered 0.."

    @property
    def op_nodes(self) -> tuple[Node, ...]:
        """Only the op nodes (no inputs or output)."""
        return tuple(n for n in self.nodes if n.kind == "op")


def value_ref(name: str, index: int, n_outputs: int) -> str:
    """The name by which output `index` of a node with `n_outputs` outputs is referred to."""
    return name if n_outputs <= 1 and index == 0 else f"{name}#{index}"


def format_attr(value: object) -> str:
    """Print a non-tensor argument stably (no addresses, sorted containers)."""
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(format_attr(v) for v in value) + "]"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (bool, int, str)) or value is None:
        return repr(value) if isinstance(value, str) else str(value)
    name = getattr(value, "__name__", None)
    if name is not None:
        return str(name)
    text = str(value)
    if " at 0x" in text:  # an object repr with an address would make files differ per process
        text = type(value).__name__
    return text.replace("torch.", "")
