"""Compiled regions while a step is dumped: what each graph torch.compile made takes and gives.

torch.compile turns a frame (a module's forward, a function) into one or more graphs, and the
backend (Inductor, ``aot_eager``, ...) turns each graph into a function. The frame's rewritten
bytecode calls that function as plain Python, so a thin `Region` put around it when the graph is
compiled sees, while a dumped step runs compiled, the region's inputs and outputs, and, through
tensor hooks on them, its gradients in backward. Nothing inside the region changes: its kernels
are the ones an undumped step runs, so a fault only the compiled code has is in the records.

torch has no hook for a compiled graph. `OutputGraph.call_user_compiler` (the one call through
which dynamo hands a graph to any backend) is wrapped when the first Dumper listens, or the
moment ``torch._dynamo`` is imported after that (`_AfterImport`), and stays wrapped: graphs
compiled before it run unwrapped and are not recorded, which `tell_unwatched` says once. Graphs of ``torch.export`` are
never wrapped. A `Region` outlives the Dumper that saw it compiled; with no listener it calls
through at the cost of one Python call per region call.

Compilation itself is announced to the listeners (`on_compile`): the module hooks must not be
there while dynamo traces, or the graph would break at every module (tracer.capture._module_hooks).
"""
from __future__ import annotations

import importlib.abc
import inspect
import importlib.util
import sys
import threading
import weakref
from typing import Any, Callable

from sleuth.common import INTERNAL, frame_kind, short_path, warn
from tracer.capture._listeners import Listeners

_TARGET = "torch._dynamo.output_graph"
_original: Callable[..., Any] | None = None
_lock = threading.Lock()
compiled_before: list[str] = []
"""Frames dynamo compiled before the first Dumper listened (their graphs are not wrapped)."""


class Region:
    """One compiled graph's function, and what its records are named after.

    `owner`: a weak reference to the module whose method the compiled frame is (None for a
    plain function, and for the module a ``torch.compile(module)`` wrapper runs, which is the
    running module then); `op`: ``compiled`` for a module's forward, else
    ``compiled.{frame's function name}`` (a frame resumed after a graph break is dynamo's
    ``torch_dynamo_resume_in_{function}_at_{line}``, stable across runs);
    `source`: the frame's ``file:line``; `data`: positions of the graph's inputs that are not
    the owner's parameters or buffers (those are the parameter records' and the setup's)."""

    __slots__ = ("__weakref__", "compiled", "data", "globals", "interpreted", "modules", "op",
                 "owner", "runner", "source")

    def __init__(self, compiled: Callable[..., Any], owner: Any, op: str, source: str,
                 data: tuple[int, ...]) -> None:
        self.compiled = compiled
        self.owner = owner
        self.op = op
        self.source = source
        self.data = data
        self.interpreted: Callable[..., Any] | None = None
        """The graph through AOTAutograd, run node by node (tracer.capture._interpret), made
        where a listener wanted the interpreter mode when the graph was compiled."""
        self.runner: Callable[..., Any] | None = None
        """What runs `interpreted`'s graphs in a dumped step (set while it runs)."""
        self.modules: dict[str, Any] = {}
        """The frame's locals that hold modules (a tuple of ``*args`` keeps its modules, None
        elsewhere), by name: where a graph node's ``nn_module_stack`` path starts."""
        self.globals: dict[str, Any] = {}
        """The frame's globals, where a path that starts ``G[...]`` starts: a model a compiled
        step function reaches as a global, a module's forward replaced by a function that
        calls the saved original."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not _listeners:
            return self.compiled(*args, **kwargs)
        hooks = _listeners.callbacks()
        run = self.compiled
        for hook in hooks:  # each listener wraps the call; the first listener is outermost
            run = _bind(hook, self, run)
        return run(*args, **kwargs)

    def owner_module(self) -> Any:
        return self.owner() if self.owner is not None else None


def _bind(hook: Callable[..., Any], region: Region, run: Callable[..., Any]
          ) -> Callable[..., Any]:
    return lambda *args, **kwargs: hook(region, run, args, kwargs)


def _data_positions(gm: Any) -> tuple[int, ...]:
    """Positions of `gm`'s placeholders that are not a module's parameter or buffer."""
    out = []
    for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        source = getattr(node, "_dynamo_source", None)
        name = getattr(source, "name", "")
        name = name() if callable(name) else str(name)  # a method in older torch
        if "_parameters[" in name or "_buffers[" in name:
            continue
        out.append(i)
    return tuple(out)


def _region_of(output_graph: Any, gm: Any, compiled: Callable[..., Any]) -> Region:
    import torch

    tx = output_graph.root_tx
    code = tx.f_code
    if frame_kind(code.co_filename) == INTERNAL:
        # torch.compile(module)'s own frame around the module's call (dynamo's `wrap_inline`):
        # the region is the module's forward, run from the wrapper's call, whose module and
        # line the module stack holds while it runs
        return Region(compiled, None, "compiled", "", _data_positions(gm))
    owner = _first_argument(code, tx.f_locals)
    ref = weakref.ref(owner) if isinstance(owner, torch.nn.Module) else None
    forwards = _forward_codes(type(owner)) if ref is not None else []
    op = "compiled" if code in forwards else f"compiled.{code.co_name}"
    # a forward under decorators: its line is the model's, not the outermost wrapper's
    where = forwards[-1] if code in forwards else code
    source = f"{short_path(where.co_filename)}:{where.co_firstlineno}"
    region = Region(compiled, ref, op, source, _data_positions(gm))
    if isinstance(tx.f_globals, dict):
        region.globals = tx.f_globals
    if isinstance(tx.f_locals, dict):
        for name, value in tx.f_locals.items():
            if isinstance(value, torch.nn.Module):
                region.modules[name] = value
            elif isinstance(value, tuple) and any(isinstance(v, torch.nn.Module) for v in value):
                region.modules[name] = tuple(v if isinstance(v, torch.nn.Module) else None
                                             for v in value)
    return region


def _first_argument(code: Any, f_locals: Any) -> Any:
    """A method's first argument, whatever it is called: its `self`, or the first of its
    ``*args`` (a decorator's wrapper, as Hugging Face puts around a model's forward)."""
    if not isinstance(f_locals, dict) or not code.co_varnames:
        return None
    if code.co_argcount:
        return f_locals.get(code.co_varnames[0])
    if code.co_flags & inspect.CO_VARARGS:
        args = f_locals.get(code.co_varnames[code.co_kwonlyargcount])
        return args[0] if isinstance(args, tuple) and args else None
    return None


def _forward_codes(cls: type) -> list[Any]:
    """The code of `cls.forward` and of every function it wraps (``__wrapped__``: a Hugging
    Face model's forward under its decorators is compiled from the outermost wrapper),
    outermost first: the last is the model's own forward."""
    out = []
    fn = getattr(cls, "forward", None)
    for _ in range(16):
        code = getattr(fn, "__code__", None)
        if code is None:
            break
        out.append(code)
        fn = getattr(fn, "__wrapped__", None)
    return out


def _call_user_compiler(self: Any, gm: Any, example_inputs: Any) -> Any:
    if kernels_wanted:
        try:
            from tracer.capture._inductor_kernels import prepare

            prepare()
        except Exception:  # noqa: BLE001 - the user's compile must never fail for the dump
            pass
    compiled = _original(self, gm, example_inputs)  # type: ignore[misc]
    if getattr(self, "export", False) or not callable(compiled):
        return compiled
    try:
        region = _region_of(self, gm, compiled)
    except Exception:  # noqa: BLE001 - the user's compile must never fail for the dump
        return compiled
    if kernels_wanted:
        from tracer.capture._inductor_kernels import note_region

        note_region(region)
    if interpret_wanted:
        try:
            from tracer.capture._interpret import interpretable

            region.interpreted = interpretable(gm, example_inputs, region)
        except Exception as e:  # noqa: BLE001 - the dump's failure, not the compile's
            not_interpreted.append(f"{region.op}: {type(e).__name__}: {e}"[:300])
    return region


def _patch(module: Any) -> None:
    global _original
    with _lock:
        cls = module.OutputGraph
        if _original is None:
            _original = cls.call_user_compiler
            cls.call_user_compiler = _call_user_compiler
    announce_compiles()


def announce_compiles() -> None:
    """Have dynamo tell the listeners when it compiles; again after ``torch._dynamo.reset()``,
    which clears its callbacks. Called as each dumped step begins."""
    callback = sys.modules.get("torch._dynamo.callback")
    handler = getattr(callback, "callback_handler", None)
    if handler is None or not _listeners:
        return
    with _lock:
        if _compile_started not in handler.start_callbacks:
            handler.register_start_callback(_compile_started)
        if _compile_ended not in handler.end_callbacks:
            handler.register_end_callback(_compile_ended)


def _unpatch() -> None:
    """The last listener left: the wrapping of dynamo's compiler call stays (graphs compiled
    meanwhile would otherwise run unrecorded under the next Dumper), only the import watch
    goes."""
    _AfterImport.remove()


class _AfterImport(importlib.abc.MetaPathFinder):
    """Wraps dynamo's compiler call the moment ``torch._dynamo.output_graph`` is imported."""

    _installed: _AfterImport | None = None

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != _TARGET:
            return None
        _AfterImport.remove()
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            if _listeners:
                _patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec

    @classmethod
    def install(cls) -> None:
        if cls._installed is None:
            cls._installed = cls()
            sys.meta_path.insert(0, cls._installed)

    @classmethod
    def remove(cls) -> None:
        finder, cls._installed = cls._installed, None
        if finder is not None and finder in sys.meta_path:
            sys.meta_path.remove(finder)


def _wrap() -> None:
    module = sys.modules.get(_TARGET)
    if module is None:
        _AfterImport.install()
        return
    if _original is None:
        utils = sys.modules.get("torch._dynamo.utils")
        counters = getattr(utils, "counters", None)
        if counters and counters["stats"]["unique_graphs"] and not compiled_before:
            compiled_before.append(f"{counters['stats']['unique_graphs']} graph(s)")
    _patch(module)


_listeners = Listeners(_wrap, _unpatch)
interpret_wanted = 0
"""How many listening Dumpers want the interpreter mode: graphs compiled meanwhile are also
made interpretable."""
kernels_wanted = 0
"""How many listening Dumpers record Inductor's kernels (tracer.capture._inductor_kernels)."""
not_interpreted: list[str] = []
"""Graphs that could not be made interpretable, and why."""
_compile_listeners: list[Callable[[bool], None]] = []


def _compile_started(_args: Any) -> None:
    for listener in list(_compile_listeners):
        listener(True)


def _compile_ended(_args: Any) -> None:
    for listener in list(_compile_listeners):
        listener(False)


class _Both:
    """The handle of `on_region`: removes the region hook and the compile listener."""

    def __init__(self, handle: Any, compiling: Callable[[bool], None], interpret: bool,
                 kernels: bool) -> None:
        self._handle, self._compiling, self._interpret = handle, compiling, interpret
        self._kernels = kernels

    def remove(self) -> None:
        global interpret_wanted, kernels_wanted
        if self._interpret:
            self._interpret = False
            interpret_wanted -= 1
        if self._kernels:
            from tracer.capture import _inductor_kernels

            self._kernels = False
            kernels_wanted -= 1
            _inductor_kernels.unwatch()
        self._handle.remove()
        if self._compiling in _compile_listeners:
            _compile_listeners.remove(self._compiling)


def on_region(hook: Callable[[Region, Callable[..., Any], tuple, dict], Any],
              compiling: Callable[[bool], None], interpret: bool = False,
              kernels: bool = False) -> _Both:
    """Have `hook(region, run, args, kwargs)` run each compiled region's call (it must call
    ``run(*args, **kwargs)`` and return its result), and `compiling(True)`/`compiling(False)`
    called as dynamo starts and ends compiling a frame; `kernels`: Inductor generates code so
    that its kernels can be recorded (tracer.capture._inductor_kernels; where this torch
    cannot, said once as a graph compiles). Returns a handle whose `remove` undoes it all."""
    global interpret_wanted, kernels_wanted
    _compile_listeners.append(compiling)
    if interpret:
        interpret_wanted += 1
    if kernels:
        from tracer.capture._inductor_kernels import watch

        watch()
        kernels_wanted += 1
    return _Both(_listeners.add(hook), compiling, interpret, kernels)


_told_unwatched = False


def tell_unwatched() -> None:
    """Warn once per process where graphs were compiled before a Dumper listened: they run
    unwrapped, and no dumped step records them."""
    global _told_unwatched
    if compiled_before and not _told_unwatched:
        _told_unwatched = True
        warn(f"{compiled_before[0]} compiled by torch.compile before the dump attached are not "
             f"recorded as compiled regions; create the Dumper before the first compiled call "
             f"(the zero-code attach does)", stacklevel=4)


def compile_summary() -> dict[str, Any] | None:
    """What torch.compile did in this process so far: graphs compiled, graph breaks and
    guard failures that made a frame recompile, each counted and with its reasons (the first
    few, one line each); None where torch.compile never loaded."""
    utils = sys.modules.get("torch._dynamo.utils")
    counters = getattr(utils, "counters", None)
    if counters is None:
        return None
    failures = getattr(utils, "guard_failures", None) or {}
    breaks = counters["graph_break"]
    recompiles = [(getattr(code, "co_name", str(code)), reason)
                  for code, reasons in failures.items() for reason in reasons]
    return {"graphs": int(counters["stats"]["unique_graphs"]),
            "breaks": int(sum(breaks.values())),
            "break_reasons": [_line(r) for r in list(breaks)[:_REASONS]],
            "recompiles": len(recompiles),
            "recompile_reasons": [f"{name}: {_line(r)}" for name, r in recompiles[:_REASONS]]}


_REASONS = 8


def _line(reason: Any) -> str:
    text = " ".join(str(reason).split())
    return text if len(text) <= 200 else text[:197] + "..."
