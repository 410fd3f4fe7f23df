"""Module-level capture: global nn.Module hooks, the module stack, and backward tensor hooks.

One `ModuleTracker` per Dumper. It names each module call (`CallNames`: from the module stack
of the call, over `named_modules()` of the model, or of every top-level module that runs when no
model was given), keeps the stack of running modules that
op records are scoped to, records forward inputs and outputs, and hooks the output and input
tensors so their gradients are recorded in backward. The hooks are torch's *global* module
hooks, installed only while a dumped step runs, so an unselected step costs nothing.

Choices (documented in docs/tracer.md):
- Inputs are recorded in the forward pre-hook, before the module can modify them in place;
  keyword inputs come after positional ones in the index order.
- Backward records use tensor hooks: ``backward ... output i`` is the gradient w.r.t. output i,
  ``backward ... input i`` the gradient w.r.t. input tensor i (summed over all its consumers).
  A backward record carries the call number of the forward call it belongs to.
- During activation recomputation (a forward that runs inside backward with grad enabled, as
  torch.utils.checkpoint does) no forward records are written and calls are not counted again.
- For op-level backward scoping, the post-hook tags the autograd nodes the call created
  (``node.metadata``) with the module name; backward ops look up the node that runs them.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import sys
import types
from collections.abc import Sequence
from typing import Any, Callable

import torch
from torch.nn.modules import module as _nn_module

from tracer._errors import ConfigError
from tracer.capture import _graphs
from tracer.capture._compiled import compiled_module, tell_once
from tracer.capture._naming import (KERNEL_OP, NONE, ROOT, CallCounter, CallNames,
                                    compiled_inner, module_names, op_scope, root_name,
                                    wrapper_inner)
from tracer.capture._recorder import Recorder
from tracer.capture._regions import announce_compiles, tell_unwatched
from tracer.capture._source import user_source

_graph_task_id = torch._C._current_graph_task_id
_grad_enabled = torch.is_grad_enabled
_has_torch_function = torch._C._has_torch_function_unary


def _make_fake_check() -> Callable[[], bool]:
    key = getattr(getattr(torch._C, "_TorchDispatchModeKey", None), "FAKE", None)
    if key is None:  # older torch: no mode keys; export then goes unnoticed
        return lambda: False
    get_mode = torch._C._get_dispatch_mode
    return lambda: get_mode(key) is not None


# True while a FakeTensorMode runs: torch.export and torch.compile tracing the model (irdump's
# graph capture, for one). Those calls are not the training step: they neither record nor count.
fake_mode_active = _make_fake_check()
_Tensor = torch.Tensor
TAG = "sleuth_module"
_autograd_profiler = torch.autograd.profiler
_NO_RANGE = contextlib.nullcontext()
TOOL_RANGE = "sleuth.tool::tracer"
"""Profiler range around the tracer's own work (docs/profiler.md): a profile's tables count what
runs inside it as tool time, not the model's, and say the dump was on."""


def tool_range() -> contextlib.AbstractContextManager:
    """A `sleuth.tool::tracer` range while a torch profiler runs, else a shared no-op."""
    if _autograd_profiler._is_profiler_enabled:
        return _autograd_profiler.record_function(TOOL_RANGE)
    return _NO_RANGE
_dynamo_kept_out: bool | None = None


def keep_dynamo_out() -> bool:
    """Put the tracer's package on torch.compile's skip list, so that dynamo never traces its
    frames: a compiled model then calls the tracer's hooks as plain Python (a graph break, as
    any hook that reads tensor memory needs), instead of trying to trace them and warning about
    each builtin they call (`sys._getframe`, the statistics kernel, ...). Imports torch._dynamo
    (~2.6 s here). Done once; False where this torch has no skip list."""
    global _dynamo_kept_out
    if _dynamo_kept_out is None:
        try:
            from torch._dynamo import trace_rules

            trace_rules.add(__name__.partition(".")[0])
            _dynamo_kept_out = True
        except (ImportError, AttributeError, TypeError):
            _dynamo_kept_out = False
    return _dynamo_kept_out


def flatten_tensors(obj: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    """Append the tensors in ``obj`` (tensors, lists, tuples, dicts in insertion order,
    pytree-registered containers and dataclasses) to ``out`` in pytree order (a dataclass's in
    field order); other leaves are skipped."""
    if isinstance(obj, _Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            flatten_tensors(item, out)
    elif isinstance(obj, dict):
        for item in obj.values():
            flatten_tensors(item, out)
    elif obj is None or isinstance(obj, (int, float, bool, str)):
        pass
    else:
        from torch.utils import _pytree

        leaves = _pytree.tree_leaves(obj)
        if not (len(leaves) == 1 and leaves[0] is obj):
            for item in leaves:
                flatten_tensors(item, out)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            # a plain dataclass output (pytree does not know it): its fields in order
            for field in dataclasses.fields(obj):
                flatten_tensors(getattr(obj, field.name), out)
    return out


def hook_grad(t: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> None:
    """`t.register_hook(hook)` for a hook that is never removed: the steps torch's
    `Tensor.register_hook` takes (the tensor's hook dict, known to its autograd node), without
    the `RemovableHandle` it makes and the import it runs each call, which cost more than the
    rest together. The hook is its own key, so it never takes the place of a handle's. A
    tensor whose calls go through `__torch_function__` (a subclass, a mode) takes torch's own
    route."""
    if _has_torch_function(t):
        t.register_hook(hook)
        return
    hooks = t._backward_hooks
    if hooks is None:
        hooks = t._backward_hooks = collections.OrderedDict()
        node = t.grad_fn
        if node is not None:
            node._register_hook_dict(t)
    hooks[hook] = hook


def _call_impl_inner_code() -> types.CodeType | None:
    """The code object of the closure in ``Module._call_impl`` that calls forward pre-hooks.

    Global pre-hooks get no keyword arguments; that frame holds them, so reading its ``kwargs``
    lets inputs be recorded before forward runs. Verified once; None disables the shortcut.
    """
    for const in _nn_module.Module._call_impl.__code__.co_consts:
        if isinstance(const, types.CodeType) and const.co_name == "inner" \
                and "kwargs" in const.co_freevars:
            return const
    return None


class ModuleTracker:
    """Names modules, tracks the running-module stack and records module-level tensors."""

    def __init__(self, dumper: Recorder, model: torch.nn.Module | None) -> None:
        cfg = dumper.config
        self._dumper = dumper
        self._cfg = cfg
        self.fixed = model is not None
        self.names = CallNames()
        self.roots = self.names.roots
        self._wanted: dict[str, bool] = {}
        # (module, name, call, seq, recomputing, source line or None, its _call_impl frame or
        # None) of every running module, innermost last
        self.stack: list[tuple[torch.nn.Module, str, int, int, bool, str | None,
                               types.FrameType | None]] = []
        self.record = cfg.level in ("module", "mix")
        self.tag_graph = cfg.level in ("op", "mix") and cfg.phases in ("backward", "both")
        self.want_in = cfg.io in ("input", "both")
        self.want_out = cfg.io in ("output", "both")
        self.want_fw = cfg.phases in ("forward", "both")
        self.want_bw = cfg.phases in ("backward", "both")
        # torch.compile's regions run compiled in a dumped step (tracer.capture._regions): a
        # compiled module's wrapper takes the name of the module it runs, whose own hooks the
        # compiled code never calls
        self.compiled = cfg.compiled != "eager"
        # "interpret": regions run their graphs node by node (tracer.capture._interpret), at
        # the levels that record ops
        self.interpret = cfg.compiled == "interpret" and cfg.level in ("op", "mix")
        self._interpreting: dict[Any, str] = {}  # region -> its module's name, this step
        # "compiled" in tensor mode: each Inductor kernel's outputs, named after the nodes it
        # fused (tracer.capture._inductor_kernels)
        self.kernels = cfg.compiled == "compiled" and cfg.mode in ("tensor", "full")
        self._region_names: dict[Any, str] = {}  # region -> its module's name, this step
        self._open_regions: list[Any] = []  # the regions whose call runs now, innermost last
        # region -> the module names of its graph nodes, this step (`_node_modules`)
        self._kernel_modules: dict[Any, Callable[[Sequence[str]], str]] = {}
        self.kernels_run: dict[str, dict[str, Any]] = {}
        """What each kernel recorded in this step fused (``{scope}.{phase}`` -> kernel, its
        nodes' ops, modules and lines), for the setup."""
        self.regions_run: dict[str, int] = {}
        """Calls of each compiled region in this step (scope -> calls), for the setup."""
        self.wrapper_ran = False
        """Whether a torch.compile wrapper was called in this step (in any mode), for the
        setup: a run that never called one has no compile section, though dynamo be loaded."""
        self._paused: list[Any] = []
        self._in_region = 0  # module calls inside a compiled region are the backend's own
        self.calls = CallCounter()
        self._recompute_calls = CallCounter()
        # (module, direction, index, call) of the backward records made this step: a
        # recomputed forward (activation checkpointing) hooks the input its first forward
        # hooked (non-reentrant) or a detached copy of it (reentrant), and the same gradient
        # would be recorded twice under one name
        self._grads_seen: set[tuple[str, str, int, int]] = set()
        self._seq = 0  # never reset: node tags compare call order across steps
        self._handles: list[Any] = []
        self._inner_code = _call_impl_inner_code()
        self._param_cache: tuple[int, list] | None = None
        self._module_cache: tuple[tuple[int, int], list] | None = None
        if model is not None:
            self.add_root(model)

    # -- naming ---------------------------------------------------------------------------------
    def add_root(self, model: torch.nn.Module) -> None:
        """Name ``model`` and its submodules; the first root is ``<root>``, later ones
        ``<root1>``, ``<root2>``, ... in the order they first run."""
        first = not self.roots
        names = self.names.add_root(model)
        if first:
            self._check_include_filter(list(names.values()))

    def _check_include_filter(self, names: list[str]) -> None:
        cfg = self._cfg
        if not cfg.modules or any(cfg.wants_module(n) for n in names):
            return
        import difflib

        close: list[str] = []
        for pattern in cfg.modules:
            close += difflib.get_close_matches(pattern.removeprefix("re:"), names, n=5, cutoff=0.4)
        hint = f"; close matches: {', '.join(dict.fromkeys(close))}" if close else ""
        raise ConfigError(f"modules: {list(cfg.modules)!r} matches no module of the model"
                          f"{hint}. Module names are the dotted names of named_modules(), "
                          f"e.g. {', '.join(names[1:4]) or ROOT}")

    def wants(self, name: str) -> bool:
        hit = self._wanted.get(name)
        if hit is None:
            hit = self._wanted[name] = self._cfg.wants_module(name)
        return hit

    def param_names(self) -> list[tuple[str, str, torch.nn.Parameter]]:
        """(parameter name, owning module name, parameter) of every root, each tensor once
        (tied parameters keep the first name ``named_parameters()`` gives them)."""
        cached = self._param_cache
        if cached is not None and cached[0] == len(self.roots):
            return cached[1]
        seen: set[int] = set()
        out = []
        for k, root in enumerate(self.roots):
            wrappers: dict[Any, str] = {}
            names = module_names(root, root_name(k), wrappers)
            for module, owner in [*names.items(), *wrappers.items()]:
                for p_name, p in module.named_parameters(recurse=False):
                    if id(p) in seen:
                        continue
                    seen.add(id(p))
                    out.append((p_name if owner == ROOT else f"{owner}.{p_name}", owner, p))
        self._param_cache = (len(self.roots), out)  # parameters are registered once, in __init__
        return out

    def named_modules(self) -> list[tuple[str, torch.nn.Module]]:
        """(record name, module) of every module under the roots, in `named_modules()` order
        (kept while the roots and their number of modules stay: a model's modules are built
        once, in __init__)."""
        count = sum(1 for root in self.roots for _ in root.modules())
        cached = self._module_cache
        if cached is not None and cached[0] == (len(self.roots), count):
            return cached[1]
        out = []
        for k, root in enumerate(self.roots):
            out += [(name, module) for module, name in module_names(root, root_name(k)).items()]
        self._module_cache = ((len(self.roots), count), out)
        return out

    # -- install / remove -----------------------------------------------------------------------
    def install(self) -> None:
        if self._handles:
            return
        if "torch._dynamo" in sys.modules:  # loaded: torch.compile may run the model
            keep_dynamo_out()
            if self.compiled:
                announce_compiles()
                tell_unwatched()
        if self.kernels and "torch._inductor.graph" in sys.modules:
            from tracer.capture import _inductor_kernels

            _inductor_kernels.swap(self._kernel_ran)
        self._handles = [
            _nn_module.register_module_forward_pre_hook(self._guarded_pre),
            _nn_module.register_module_forward_hook(self._guarded_post, with_kwargs=True,
                                                    always_call=True),
        ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._paused = []
        self.stack.clear()
        for region in self._interpreting:
            region.runner = None  # steps not dumped run the backend's code again
        self._interpreting.clear()
        if self.kernels and "torch._inductor.graph" in sys.modules:
            from tracer.capture import _inductor_kernels

            _inductor_kernels.unswap()  # steps not dumped run Inductor's kernels untouched
        self._region_names.clear()
        self._open_regions.clear()
        self._kernel_modules.clear()

    def compiling(self, starts: bool) -> None:
        """torch.compile starts (True) or ends compiling a frame: the module hooks come off
        meanwhile, so dynamo traces the model as an undumped step would have it traced (with
        them on it would break the graph at every module); the module stack stays."""
        if starts:
            if self._handles:
                for handle in self._handles:
                    handle.remove()
                self._paused, self._handles = self._handles, []
        elif self._paused:
            self._paused = []
            self.install()

    def reset_step(self) -> None:
        self.regions_run.clear()
        self.kernels_run.clear()
        self.wrapper_ran = False
        self.stack.clear()
        self.calls.reset()
        self._recompute_calls.reset()
        self._grads_seen.clear()

    # -- hooks ----------------------------------------------------------------------------------
    def _name_of(self, module: torch.nn.Module) -> str | None:
        stack = self.stack
        name = self.names.name(module, stack[-1] if stack else None)
        if name is not None or stack or self.fixed or wrapper_inner(module) is not None:
            # None: a wrapper (torch.compile, DDP, FSDP), named by the module it runs (whose
            # hooks fire next); or, with a model given, a module called outside it
            return name
        self.add_root(module)  # no model given: each top-level module that runs is a root
        return self.names.name(module, None)

    def _guarded_pre(self, module: torch.nn.Module, args: tuple) -> None:
        """`_pre`, its failure the dump's (`Recorder._fail`), never the model's."""
        if not self._dumper.capturing:
            return  # the dump went off (the hooks come off at the step boundary)
        try:
            self._pre(module, args)
        except Exception as e:  # noqa: BLE001 - the dump's failure, not the model's
            self._dumper._fail(e)

    def _guarded_post(self, module: torch.nn.Module, args: tuple, *rest: Any) -> None:
        """`_post`, its failure the dump's (`Recorder._fail`), never the model's."""
        try:
            self._post(module, args, *rest)
        except Exception as e:  # noqa: BLE001 - the dump's failure, not the model's
            self._dumper._fail(e)

    def _pre(self, module: torch.nn.Module, args: tuple) -> None:
        if self._dumper._busy or fake_mode_active() \
                or _graphs.capturing() and _graphs.told():  # (tracer.capture._graphs)
            return
        if self._in_region:
            return  # a backend's graph module (backend "eager"), not one of the model's
        stack = self.stack
        if self.compiled and stack and stack[-1][0] is module:
            return  # the module a compiled wrapper runs, run eagerly: the wrapper's call
        name = self._name_of(module)
        if name is None:
            if not compiled_module(module):
                return
            self.wrapper_ran = True
            if not self.compiled:
                tell_once()  # its forward runs eagerly in this step (tracer.capture._compiled)
                return
            # the wrapper's call is the compiled module's: its inputs, outputs and gradients;
            # dynamo may compile in it, and a reset since the step began forgot who to tell
            announce_compiles()
            module = compiled_inner(module)
            name = self._name_of(module)
            if name is None:
                return
        recomputing = _graph_task_id() != -1 and _grad_enabled()
        counter = self._recompute_calls if recomputing else self.calls
        call = counter.next(name, "forward")
        self._seq += 1
        wanted = self.record and self.want_in and self.wants(name)
        frame = sys._getframe(2)  # above this, its guard, then _call_impl's inner
        if frame.f_code is not self._inner_code:
            frame = None
        # the call's source line (from _call_impl's inner up), which its records and the ops
        # inside it share: walked once a call, and only up to the running caller's frame
        if frame is None:
            source = user_source(3) if wanted and self.want_fw and not recomputing else None
        elif stack and stack[-1][6] is not None:
            source = user_source(3, stack[-1][6], stack[-1][5])
        else:
            source = user_source(3)
        top = not stack and not recomputing
        stack.append((module, name, call, self._seq, recomputing, source, frame))
        if not (wanted or top):
            return
        kwargs = frame.f_locals.get("kwargs") if frame is not None else None
        if top:  # the model's own call: the step's batch
            self._dumper.model_called(name, args, kwargs)
        if not wanted:
            return
        inputs = flatten_tensors(args, [])
        if kwargs:
            flatten_tensors(kwargs, inputs)
        if not inputs:
            return
        self._record(name, "input", inputs, call, recomputing, source)

    def _post(self, module: torch.nn.Module, args: tuple, *rest: Any) -> None:
        # with_kwargs gives (kwargs, output); the always_call path after an exception gives (output,)
        output = rest[-1]
        stack = self.stack
        if not stack or self._dumper._busy or fake_mode_active():
            return
        if self.compiled:
            module = compiled_inner(module) or module
        for pos in range(len(stack) - 1, -1, -1):
            if stack[pos][0] is module:
                break
        else:
            return  # a module we do not track (outside the model, or a busy-time call)
        _, name, call, seq, recomputing, source, _ = stack[pos]
        del stack[pos:]
        if _graphs.capturing() and _graphs.told():
            return  # a capture began inside this call: its outputs hold no values yet
        outputs = None
        if self.tag_graph and _grad_enabled():
            outputs = flatten_tensors(output, [])
            stop = flatten_tensors(args, [])
            if len(rest) == 2:
                flatten_tensors(rest[0], stop)
            self._tag(outputs, stop, name, seq)
        if self._inner_code is None and len(rest) == 2 and rest[0] and self.record \
                and self.want_in and self.want_fw and not recomputing and self.wants(name):
            # torch changed _call_impl: keyword inputs could not be read before forward ran
            offset = len(flatten_tensors(args, []))
            source = user_source(3)
            with tool_range():
                self._dumper.emit_all(name, name, "", "forward", "input", call, source,
                                      flatten_tensors(rest[0], []), first=offset)
        if not (self.record and self.want_out and self.wants(name)):
            return
        if outputs is None:
            outputs = flatten_tensors(output, [])
        if not outputs:
            return
        self._record(name, "output", outputs, call, recomputing, source)

    def _record(self, name: str, direction: str, tensors: list[torch.Tensor], call: int,
                recomputing: bool, source: str | None, scope: str | None = None,
                op: str = "") -> None:
        """Emit a module call's forward inputs or outputs now (`source`: the call's line, None
        when not walked yet), and hook their gradients; a compiled region's (`scope`, `op`)
        likewise."""
        scope = scope or name
        if self.want_fw and not recomputing:
            if source is None:
                source = user_source(4)  # above this, the hook, its guard, torch's _call_impl
            with tool_range():
                self._dumper.emit_all(scope, name, op, "forward", direction, call, source,
                                      tensors)
        if self.want_bw:
            for i, t in enumerate(tensors):
                if t.requires_grad:
                    hook_grad(t, self._grad_hook(name, direction, i, call, scope, op))

    def _grad_hook(self, name: str, direction: str, index: int, call: int,
                   scope: str, op: str) -> Callable[[torch.Tensor], None]:
        dumper = self._dumper
        seen = self._grads_seen
        key = (scope, direction, index, call)

        def hook(grad: torch.Tensor) -> None:
            if dumper.capturing and grad is not None and key not in seen \
                    and not (_graphs.capturing() and _graphs.told()):
                try:
                    seen.add(key)
                    source = user_source(2)
                    with tool_range():
                        dumper.emit(scope, name, op, "backward", direction, index, call,
                                    source, grad)
                except Exception as e:  # noqa: BLE001 - the dump's failure, not the model's
                    dumper._fail(e)

        return hook

    # -- compiled regions (tracer.capture._regions) ---------------------------------------------
    def region(self, region: Any, run: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Run one call of a compiled region as it is, recording its inputs and outputs (and,
        through tensor hooks, their gradients) as ``{module}::compiled.{function}`` records of
        the module whose frame it compiles; ops it dispatches (Inductor's external calls, an
        ``aot_eager`` graph's ops) are scoped to that module."""
        dumper = self._dumper
        if not dumper.capturing or dumper._busy or fake_mode_active() \
                or _graph_task_id() != -1 or _graphs.capturing() and _graphs.told():
            return run(*args, **kwargs)
        try:
            entry = self._region_enter(region, args)
        except Exception as e:  # noqa: BLE001 - the dump's failure, not the model's
            dumper._fail(e)
            return run(*args, **kwargs)
        if self.interpret and region.interpreted is not None:
            self._interpreting[region] = entry[0][1]
            region.runner = self._interpret_graph
            run = region.interpreted
        stack = self.stack
        stack.append(entry[0])
        self._in_region += 1
        self._open_regions.append(region)
        try:
            out = run(*args, **kwargs)
        finally:
            self._in_region -= 1
            if self._open_regions and self._open_regions[-1] is region:
                self._open_regions.pop()
            if stack and stack[-1] is entry[0]:
                stack.pop()
        try:
            self._region_leave(entry, args, out)
        except Exception as e:  # noqa: BLE001 - the dump's failure, not the model's
            dumper._fail(e)
        return out

    def _interpret_graph(self, graph: Any, inputs: list) -> Any:
        """Run one of a region's graphs after AOTAutograd node by node, each aten node's inputs
        and outputs an op record (tracer.capture._interpret)."""
        from tracer.capture._interpret import Interpreter, module_stack_paths, node_source, op_of
        from tracer.capture._calls import mutates

        dumper = self._dumper
        region, phase = graph.region, graph.phase
        if not dumper.capturing or region not in self._interpreting \
                or not (self.want_fw if phase == "forward" else self.want_bw):
            return graph.gm(*inputs)
        owner = self._interpreting[region]
        fallback = region.source or user_source(2)
        cfg = self._cfg
        module_named = self._node_modules(region, owner)

        def module_of(node: Any) -> str:
            return module_named(module_stack_paths(node, phase))

        specs = self.want_in and cfg.mode in ("tensor", "full") and cfg.level != "module"

        def before(node: Any, args: tuple, kwargs: dict) -> tuple | None:
            op = op_of(node)
            module = module_of(node)
            if not cfg.wants_op(op) or not self.wants(module):
                return None
            ins = flatten_tensors(args, [])
            flatten_tensors({k: v for k, v in kwargs.items() if k != "out"}, ins)
            scope = op_scope(module, op)
            call = self.calls.next(scope, phase)
            source = node_source(node, fallback)
            stable = not mutates(node.target)
            if specs:  # what re-running the node needs (explain's rounding measure)
                dumper.emit_call(f"{scope}.{phase}.{call}", node.target, args, kwargs)
            if self.want_in and ins:
                dumper.emit_all(scope, module, op, phase, "input", call, source, ins, stable)
            return scope, module, op, call, source, stable

        def after(plan: tuple, out: Any) -> None:
            scope, module, op, call, source, stable = plan
            outs = flatten_tensors(out, []) if self.want_out else []
            if outs:
                dumper.emit_all(scope, module, op, phase, "output", call, source, outs,
                                stable)

        def quiet(work: Callable[[], Any]) -> Any:
            dumper._busy = True  # the op mode and the hooks pass the node's own ops by
            try:
                return work()
            finally:
                dumper._busy = False

        return Interpreter(graph.gm, before, after, quiet).run(*inputs)

    def _node_modules(self, region: Any, owner: str) -> Callable[[Sequence[str]], str]:
        """The name of the innermost module of a graph node's ``nn_module_stack`` paths
        (innermost first) that the model names, else the innermost path under `owner`, the
        region's module: resolved once per path for this region's call."""
        from tracer.capture._interpret import module_path, resolve

        named = {id(m): name for name, m in self.named_modules()}
        paths: dict[str, str] = {}

        def module_of(stack: Sequence[str]) -> str:
            key = stack[0] if stack else ""
            name = paths.get(key)
            if name is None:
                found = (resolve(p, region.modules, region.globals) for p in stack)
                name = next((named[id(m)] for m in found if id(m) in named), None) \
                    or module_path(owner, key)
                paths[key] = name
            return name

        return module_of

    def _kernel_ran(self, generated: Any, kernel: Any, outputs: list[torch.Tensor]) -> None:
        """One of Inductor's generated kernels ran in a dumped step: its outputs are the
        records ``{region's module}::kernel.{kernel}.{phase}.{call}.output.{i}``, at the line
        of the last node it fused; what it fused goes to the setup (`kernels_run`)."""
        from tracer.capture._inductor_kernels import region_of

        dumper = self._dumper
        phase = generated.phase
        if not dumper.capturing or dumper._busy or not self.want_out \
                or not (self.want_fw if phase == "forward" else self.want_bw):
            return
        region = region_of(generated) or (self._open_regions[-1] if self._open_regions
                                          else None)
        name = self._region_names.get(region, NONE) if region is not None else NONE
        op = f"{KERNEL_OP}{kernel.name}"
        if not self._cfg.wants_op(op) or not self.wants(name):
            return
        try:
            scope = op_scope(name, op)
            call = self.calls.next(scope, phase)
            lines = [n.source for n in kernel.nodes if n.source]
            source = lines[-1] if lines else (region.source if region is not None else "")
            key = f"{scope}.{phase}"
            if key not in self.kernels_run:
                module_of = self._kernel_modules.get(region)
                if module_of is None:
                    module_of = self._kernel_modules[region] = \
                        self._node_modules(region, name) if region is not None \
                        else (lambda _stack: name)
                nodes = dict.fromkeys((n.op, module_of(n.paths), n.source)
                                      for n in kernel.nodes)  # each distinct one once
                self.kernels_run[key] = {"kernel": kernel.name,
                                         "nodes": [list(n) for n in nodes]}
            # the kernel wrote these without a version bump: nothing known of them holds
            dumper.forget(outputs)
            with tool_range():
                dumper.emit_all(scope, name, op, phase, "output", call, source, outputs,
                                stable=False)
        except Exception as e:  # noqa: BLE001 - the dump's failure, not the model's
            dumper._fail(e)

    def _region_enter(self, region: Any, args: tuple) -> tuple:
        stack = self.stack
        top = stack[-1] if stack else None
        owner = region.owner_module()
        name = None
        if owner is not None:
            name = top[1] if top is not None and top[0] is owner else self._name_of(owner)
        if name is None:
            name = top[1] if top is not None else NONE
        scope = op_scope(name, region.op)
        call = self.calls.next(scope, "forward")
        self.regions_run[scope] = self.regions_run.get(scope, 0) + 1
        self._region_names[region] = name
        self._seq += 1
        source = region.source or (top[5] if top is not None and top[5] else "")
        entry = (owner if owner is not None else (top[0] if top is not None else None),
                 name, call, self._seq, False, source, None)
        wanted = self.wants(name)
        if wanted and self.want_in:
            inputs = [args[i] for i in region.data if i < len(args)
                      and isinstance(args[i], _Tensor)]
            if inputs:
                self._record(name, "input", inputs, call, False, source, scope, region.op)
        return entry, scope, wanted, region.op

    def _region_leave(self, entry: tuple, args: tuple, out: Any) -> None:
        (_, name, call, seq, _, source, _), scope, wanted, op = entry
        outputs = flatten_tensors(out, [])
        if self.tag_graph and _grad_enabled():
            self._tag(outputs, [a for a in args if isinstance(a, _Tensor)], name, seq)
        if wanted and self.want_out and outputs:
            self._record(name, "output", outputs, call, False, source, scope, op)

    @staticmethod
    def _tag(outputs: list[torch.Tensor], stop: list[torch.Tensor], name: str, seq: int) -> None:
        """Tag the autograd nodes this call created with its module name.

        Walks from the outputs' nodes towards the inputs' nodes. Inner calls ran (and tagged)
        first and have larger ``seq``; a node tagged with a smaller one was made before this
        call began, so the walk stops there, as it does at the inputs' nodes.
        """
        seen: set = {t.grad_fn for t in stop if t.grad_fn is not None}
        todo = [t.grad_fn for t in outputs if t.grad_fn is not None]
        value = (name, seq)
        while todo:
            node = todo.pop()
            if node in seen:
                continue
            seen.add(node)
            meta = node.metadata
            tag = meta.get(TAG)
            if tag is None:
                meta[TAG] = value
            elif tag[1] < seq:
                continue
            for nxt, _ in node.next_functions:
                if nxt is not None and nxt not in seen:
                    todo.append(nxt)
