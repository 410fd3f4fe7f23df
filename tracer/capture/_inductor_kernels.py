"""Inductor's generated kernels while a step is dumped: each kernel's outputs, and the graph
nodes it fused.

Inductor fuses a region's ops into kernels (C++ on CPU, Triton on a GPU) that dispatch no op,
so neither the op mode nor the region's records see inside them. The generated wrapper module
calls each kernel through a global of its own name (``cpp_fused_gelu_0(buf0, arg1_1)``,
``triton_poi_fused_add_0.run(...)``), looked up at every call. So in a dumped step each
kernel global of the modules Inductor generated is swapped for a `_Recorded` that calls the
kernel and then hands its outputs to the tracer (`swap`); the step's end puts the kernels
back. The kernels themselves are the ones an undumped step runs, and an undumped step runs
the module as Inductor made it.

Which graph nodes a kernel fused is known only while Inductor generates code: it tells its
provenance tracing each kernel with the scheduler nodes inside (`_capture`, the call torch
makes for every C++ and Triton kernel, whatever the tracing level), and each scheduler node
keeps the FX nodes it came from, with their module stack and stack trace. A graph Inductor
takes from its caches was generated elsewhere, so while a Dumper records kernels (`watch`)
the graph caches are off from the first graph dynamo compiles (`prepare`): the code generated
is the one the cache would hold. Where torch lacks these calls, `prepare` says so once and
kernels are not recorded.
"""
from __future__ import annotations

import ast
import re
import sys
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable

from sleuth.common import warn

_PYBINDING = re.compile(r"^(\w+) = async_compile\.cpp_pybinding\((\[[^\]]*\])", re.M)


@dataclass(frozen=True)
class Fused:
    """One graph node a kernel fused: its aten op, its name in the graph Inductor compiled,
    its ``nn_module_stack`` paths (innermost first) and its user ``file:line`` ("" unknown)."""

    op: str
    node: str
    paths: tuple[str, ...]
    source: str


@dataclass(frozen=True)
class Kernel:
    """A generated kernel: its name, the nodes it fused in graph order, and the positions of
    its arguments it writes (None: read from the kernel object when it runs, Triton's)."""

    name: str
    nodes: tuple[Fused, ...]
    outputs: tuple[int, ...] | None


class Generated:
    """One module Inductor generated (a region's forward or backward graph): its kernels, its
    phase, and the dynamo compile it belongs to (`compile_id`, shared by the forward and the
    backward Inductor compiles later)."""

    def __init__(self, module: Any, kernels: dict[str, Kernel], phase: str,
                 compile_id: str) -> None:
        self.module = weakref.ref(module)
        self.kernels, self.phase, self.compile_id = kernels, phase, compile_id


_lock = threading.Lock()
_generated: list[Generated] = []
# GraphLowering -> the kernels generated for it so far, and its FX nodes' positions; weak, so
# that a graph generated without being loaded as a module (AOT Inductor) leaves nothing
_pending: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_orders: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_watchers = 0
_patched = False
_unsupported = ""
_told = False
_saved_caches: dict[tuple[Any, str], Any] = {}
_swapped: Callable[[Generated, Kernel, list], None] | None = None
_regions: dict[str, Any] = {}  # dynamo compile id -> weak reference to the region it made


def compile_id() -> str:
    """The id of the dynamo compile running now ("" outside one): the same for a region's
    forward and its backward, which AOTAutograd compiles under the saved compile context."""
    guards = sys.modules.get("torch._guards")
    context = getattr(guards, "CompileContext", None)
    try:
        found = context.current_compile_id() if context is not None else None
    except Exception:  # noqa: BLE001 - no compile context: not a dynamo compile
        return ""
    return "" if found is None else str(found)


def watch() -> None:
    """A Dumper that records kernels listens (`prepare` does the work when a graph compiles,
    so a run that never compiles never imports Inductor for it)."""
    global _watchers
    with _lock:
        _watchers += 1


def unwatch() -> None:
    """One such Dumper left; with the last, Inductor's caches are as they were."""
    global _watchers
    with _lock:
        if _watchers <= 0:
            return
        _watchers -= 1
        if _watchers == 0 and _saved_caches:
            _caches(True)


def prepare() -> None:
    """Dynamo is about to hand a graph to its backend while kernels are watched: have
    Inductor generate code where kernels' origins are seen, and its graph caches off; where
    this torch offers no way to see them, say so once."""
    with _lock:
        if not _watchers:
            return
        if not _patch():
            _tell()
            return
        if not _saved_caches:
            _caches(False)


def _tell() -> None:
    global _told
    if not _told:
        _told = True
        warn(f"Inductor's generated kernels are not recorded with this torch ({_unsupported}): "
             f"the dump records each compiled region's inputs and outputs")


def _caches(restore: bool) -> None:
    """Inductor's and AOTAutograd's graph caches off while kernels are watched (a cached
    graph skips the code generation that says what each kernel fused), back when none is."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    for config, key in ((inductor_config, "fx_graph_cache"),
                        (functorch_config, "enable_autograd_cache")):
        if not hasattr(config, key):
            continue
        if restore:
            if (config, key) in _saved_caches:
                setattr(config, key, _saved_caches.pop((config, key)))
        else:
            _saved_caches[(config, key)] = getattr(config, key)
            setattr(config, key, False)


def _patch() -> bool:
    """Wrap Inductor's per-kernel provenance call (where torch's code generators import it)
    and its module loading, once; False with `_unsupported` set where they are missing."""
    global _patched, _unsupported
    if _patched:
        return True
    if _unsupported:
        return False
    try:
        import torch._inductor.debug as debug
        import torch._inductor.graph as graph
    except Exception as e:  # noqa: BLE001 - a torch without Inductor
        _unsupported = f"no Inductor: {type(e).__name__}"
        return False
    original = getattr(debug, "set_kernel_post_grad_provenance_tracing", None)
    lowering = getattr(graph, "GraphLowering", None)
    if original is None or not hasattr(lowering, "compile_to_module"):
        _unsupported = "no per-kernel provenance call in torch._inductor"
        return False

    def provenance(*args: Any, **kwargs: Any) -> Any:
        # (node_schedule, kernel_name, is_extern=False); passed on as given
        extern = kwargs.get("is_extern", args[2] if len(args) > 2 else False)
        if _watchers and len(args) >= 2 and not extern:
            try:
                _capture(args[0], args[1])
            except Exception:  # noqa: BLE001 - the user's compile must never fail for the dump
                pass
        return original(*args, **kwargs)

    debug.set_kernel_post_grad_provenance_tracing = provenance
    # the code generators import the call by name: those imported from now on take the
    # wrapper, those imported already are pointed at it
    for where in ("torch._inductor.codegen.cpp", "torch._inductor.codegen.triton"):
        module = sys.modules.get(where)
        if getattr(module, "set_kernel_post_grad_provenance_tracing", None) is original:
            module.set_kernel_post_grad_provenance_tracing = provenance
    to_module = lowering.compile_to_module

    def compile_to_module(self: Any, *args: Any, **kwargs: Any) -> Any:
        module = to_module(self, *args, **kwargs)
        kernels = _pending.pop(self, None)
        _orders.pop(self, None)
        if kernels and _watchers:
            try:
                _register(module, kernels, "backward" if getattr(self, "is_backward", False)
                          else "forward")
            except Exception:  # noqa: BLE001 - the user's compile must never fail for the dump
                pass
        return module

    lowering.compile_to_module = compile_to_module
    _patched = True
    return True


def _capture(node_schedule: Any, kernel_name: str) -> None:
    from torch._inductor.virtualized import V

    from tracer.capture._interpret import module_stack_paths, node_source, op_of

    graph = V.graph
    phase = "backward" if getattr(graph, "is_backward", False) else "forward"
    origins: dict[Any, None] = {}
    for snode in node_schedule:
        get_nodes = getattr(snode, "get_nodes", None)
        for inner in (get_nodes() if callable(get_nodes) else ()):
            ir_node = getattr(inner, "node", None)
            for origin in getattr(ir_node, "origins", ()) or ():
                if getattr(origin, "op", "") == "call_function":
                    origins[origin] = None
    positions = _orders.get(graph)
    if positions is None:
        positions = _orders[graph] = {}
    for origin in origins:
        if origin not in positions:  # the graph's order, counted once per graph
            positions.update((n, i) for i, n in enumerate(origin.graph.nodes))
    nodes = tuple(Fused(op_of(n), n.name, tuple(module_stack_paths(n, phase)),
                        node_source(n, ""))
                  for n in sorted(origins, key=lambda n: positions.get(n, 0))
                  if _is_op(n))
    kernels = _pending.setdefault(graph, {})
    known = kernels.get(kernel_name)  # one kernel's code defined for two schedules
    if known is not None:
        nodes = known.nodes + tuple(n for n in nodes if n not in known.nodes)
    kernels[kernel_name] = Kernel(kernel_name, nodes, None)


def _is_op(node: Any) -> bool:
    import torch

    return isinstance(node.target, torch._ops.OpOverload)


def _register(module: Any, kernels: dict[str, Kernel], phase: str) -> None:
    """Keep a generated module's kernels (C++ kernels' outputs: their pointer arguments that
    are not const, from the module's own source); swap them at once in a dumped step."""
    try:
        with open(module.__file__, encoding="utf-8") as f:
            source = f.read()
    except (OSError, AttributeError, TypeError):
        source = ""
    for name, types in _PYBINDING.findall(source):
        if name in kernels:
            kinds = ast.literal_eval(types)
            outputs = tuple(i for i, t in enumerate(kinds)
                            if str(t).endswith("*") and not str(t).startswith("const "))
            kernels[name] = Kernel(name, kernels[name].nodes, outputs)
    generated = Generated(module, kernels, phase, compile_id())
    with _lock:
        _generated[:] = [g for g in _generated if g.module() is not None]
        _generated.append(generated)
    if _swapped is not None:
        _swap_one(generated, _swapped)


class _Recorded:
    """A kernel global while a step is dumped: runs the kernel, then hands its outputs to
    `ran(generated, kernel, outputs)`. Triton kernels are called through ``.run``."""

    def __init__(self, original: Any, generated: Generated, kernel: Kernel,
                 ran: Callable[[Generated, Kernel, list], None]) -> None:
        self.original, self.generated, self.kernel, self.ran = original, generated, kernel, ran

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.original(*args, **kwargs)
        self._ran(args, self.kernel.outputs)
        return out

    def run(self, *args: Any, **kwargs: Any) -> Any:
        out = self.original.run(*args, **kwargs)
        self._ran(args, _triton_outputs(self.original))
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.original, name)

    def _ran(self, args: tuple, positions: tuple[int, ...] | None) -> None:
        import torch

        if not positions:
            return
        outs = [args[i] for i in positions if i < len(args)
                and isinstance(args[i], torch.Tensor)]
        if outs:
            self.ran(self.generated, self.kernel, outs)


def _triton_outputs(kernel: Any) -> tuple[int, ...] | None:
    """The positions of the arguments a Triton kernel writes: Inductor's own list of the
    names it mutates, among the kernel's argument names."""
    names = getattr(getattr(kernel, "fn", None), "arg_names", None)
    mutated = getattr(kernel, "mutated_arg_names", None) \
        or (getattr(kernel, "inductor_meta", None) or {}).get("mutated_arg_names")
    if not names or not mutated:
        return None
    return tuple(i for i, n in enumerate(names) if n in mutated)


def _swap_one(generated: Generated, ran: Callable[[Generated, Kernel, list], None]) -> None:
    module = generated.module()
    if module is None:
        return
    space = module.__dict__
    for name, kernel in generated.kernels.items():
        current = space.get(name)
        if current is not None and not isinstance(current, _Recorded):
            space[name] = _Recorded(current, generated, kernel, ran)


def swap(ran: Callable[[Generated, Kernel, list], None]) -> None:
    """Have every generated kernel hand its outputs to `ran` until `unswap` (a dumped step)."""
    global _swapped
    with _lock:
        _swapped = ran
        generated = [g for g in _generated if g.module() is not None]
    for g in generated:
        _swap_one(g, ran)


def unswap() -> None:
    """The kernels Inductor generated, as it generated them, in every module."""
    global _swapped
    with _lock:
        _swapped = None
        generated = list(_generated)
    for g in generated:
        module = g.module()
        if module is None:
            continue
        space = module.__dict__
        for name in g.kernels:
            current = space.get(name)
            if isinstance(current, _Recorded):
                space[name] = current.original


def note_region(region: Any) -> None:
    """`region` was made by the dynamo compile running now: the modules Inductor generates
    for it, its backward's later, are its (`region_of`)."""
    key = compile_id()
    with _lock:
        for gone in [k for k, ref in _regions.items() if ref() is None]:
            del _regions[gone]
        _regions[key] = weakref.ref(region)


def region_of(generated: Generated) -> Any:
    """The compiled region whose graph `generated` is, or None."""
    ref = _regions.get(generated.compile_id)
    return ref() if ref is not None else None
