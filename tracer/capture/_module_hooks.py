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

import contextlib
import dataclasses
import sys
import types
from typing import Any, Callable

import torch
from torch.nn.modules import module as _nn_module

from tracer._errors import ConfigError
from tracer.capture import _graphs
from tracer.capture._compiled import compiled_module, tell_once
from tracer.capture._naming import (ROOT, CallCounter, CallNames, module_names, root_name,
                                    wrapper_inner)
from tracer.capture._recorder import Recorder
from tracer.capture._source import user_source

_graph_task_id = torch._C._current_graph_task_id
_grad_enabled = torch.is_grad_enabled


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
        self._handles = [
            _nn_module.register_module_forward_pre_hook(self._guarded_pre),
            _nn_module.register_module_forward_hook(self._guarded_post, with_kwargs=True,
                                                    always_call=True),
        ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.stack.clear()

    def reset_step(self) -> None:
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
        name = self._name_of(module)
        if name is None:
            if compiled_module(module):
                tell_once()  # its forward runs eagerly in this step (tracer.capture._compiled)
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
        stack = self.stack
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
                recomputing: bool, source: str | None) -> None:
        """Emit a module call's forward inputs or outputs now (`source`: the call's line, None
        when not walked yet), and hook their gradients."""
        if self.want_fw and not recomputing:
            if source is None:
                source = user_source(4)  # above this, the hook, its guard, torch's _call_impl
            with tool_range():
                self._dumper.emit_all(name, name, "", "forward", direction, call, source,
                                      tensors)
        if self.want_bw:
            for i, t in enumerate(tensors):
                if t.requires_grad:
                    t.register_hook(self._grad_hook(name, direction, i, call))

    def _grad_hook(self, name: str, direction: str, index: int,
                   call: int) -> Callable[[torch.Tensor], None]:
        dumper = self._dumper
        seen = self._grads_seen
        key = (name, direction, index, call)

        def hook(grad: torch.Tensor) -> None:
            if dumper.capturing and grad is not None and key not in seen \
                    and not (_graphs.capturing() and _graphs.told()):
                try:
                    seen.add(key)
                    source = user_source(2)
                    with tool_range():
                        dumper.emit(name, name, "", "backward", direction, index, call, source,
                                    grad)
                except Exception as e:  # noqa: BLE001 - the dump's failure, not the model's
                    dumper._fail(e)

        return hook

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
