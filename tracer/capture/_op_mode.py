"""Op-level capture: a TorchDispatchMode that records the tensors of every aten op.

Each op is scoped to a module: in forward the innermost running module (the ModuleTracker's
stack), in backward the module whose forward created the autograd node now running (its tag in
``node.metadata``), else ``<none>``. Ops of the optimizer are not recorded (the mode is popped
while ``optimizer.step()`` runs, pushed again while a closure given to it runs; its effect is
recorded as ``update`` parameter records), nor are the ops the dump itself runs to compute
statistics, nor forward ops re-run inside backward for activation recomputation. The hot path is a few dictionary look-ups per op.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tracer.capture import _graphs
from tracer.capture._module_hooks import (TAG, ModuleTracker, fake_mode_active,
                                          keep_dynamo_out, tool_range)
from tracer.capture._naming import NONE, op_name, op_scope
from tracer.capture._calls import mutates as _mutates
from tracer.capture._recorder import Recorder
from tracer.capture._source import RECEIVED, WRAPPER, user_source

_graph_task_id = torch._C._current_graph_task_id
_current_node = torch._C._current_autograd_node
_grad_enabled = torch.is_grad_enabled
_Tensor = torch.Tensor
_stack_len = torch._C._len_torch_dispatch_stack
_stack_at = torch._C._get_dispatch_stack_at
_stack_pop = torch._C._pop_torch_dispatch_stack
_stack_push = torch._C._push_on_torch_dispatch_stack
# torch.compile's frame evaluation hook (see OpMode._should_skip_dynamo); None where this torch
# has no such switches, and OpMode then keeps torch's default wrapper
_eval_frame = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
_eval_frame_callback = getattr(_eval_frame, "get_eval_frame_callback", None)
_set_eval_frame = getattr(_eval_frame, "set_eval_frame", None)
_OWN_DYNAMO_GUARD = _eval_frame_callback is not None and _set_eval_frame is not None


# outputs that hold no values, by position among the op's tensor outputs (sorted): memory as
# the allocator found it (`aten.empty` & co) or a kernel's scratch memory (oneDNN's LSTM
# workspace, in part uninitialised, different in two runs of the same code). They are no
# records, and neither is an input that reads one before anything writes it.
UNINITIALISED_OUTPUTS: dict[str, tuple[int, ...]] = {
    **dict.fromkeys(("aten.empty", "aten.empty_like", "aten.empty_strided", "aten.new_empty",
                     "aten.new_empty_strided", "aten.empty_permuted"), (0,)),
    "aten.mkldnn_rnn_layer": (3,),
}
_MAX_FRESH = 256


def _flat(args: tuple, kwargs: dict, written: bool = True) -> list[torch.Tensor]:
    """The tensors of an op's arguments; `written` False leaves out an ``out=`` argument,
    which the op only writes (what it held before is whatever its allocation found: Inductor
    allocates its buffers without an op the mode sees)."""
    # aten schemas hold tensors directly or in one level of lists (aten.cat, _foreach_*)
    out = []
    for a in args:
        if isinstance(a, _Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out += [b for b in a if isinstance(b, _Tensor)]
    for key, a in kwargs.items():
        if not written and key == "out":
            continue
        if isinstance(a, _Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out += [b for b in a if isinstance(b, _Tensor)]
    return out


def _view_source(func: Any) -> int:
    """Schema position of the argument a view op's outputs alias (`t(Tensor(a) self) ->
    Tensor(a)`, `split`, `detach`, ...), or -1 when the outputs are new tensors."""
    try:
        schema = func._schema
        if not any(r.alias_info is not None for r in schema.returns):
            return -1
        for i, a in enumerate(schema.arguments):
            if a.alias_info is not None and not a.alias_info.is_write:
                return i
    except AttributeError:  # no schema: treat the outputs as new tensors
        pass
    return -1


def _keep_dynamo_out() -> None:
    """Keep dynamo out of the tracer's frames (OpMode's handler among them); where this torch
    has no skip list, wrap the handler the way torch does by default after all. At the first
    push."""
    global _dynamo_checked
    if _dynamo_checked:
        return
    _dynamo_checked = True
    if not keep_dynamo_out():
        OpMode.__torch_dispatch__ = torch._disable_dynamo(  # type: ignore[method-assign]
            OpMode.__dict__["__torch_dispatch__"], recursive=True)


_dynamo_checked = False


_AccumulateGrad = type(torch.ones(1, requires_grad=True).expand(1).grad_fn.next_functions[0][0])


def _ddp_bucketing(func: Any) -> bool:
    """True for an op that DDP's reducer runs from a parameter's gradient accumulator once the
    gradient is ready: the gradient written into its bucket (an ``out=`` overload, the
    accumulator's own ops have none) and the bucket's all-reduce. A single-process run of the
    same model runs neither, so they are not the model's backward."""
    if func.namespace == "c10d":
        return True
    return func._overloadname == "out" and torch.distributed.is_available() \
        and torch.distributed.is_initialized()


class _Site:
    """An op inside one module: its record scope and its call counters' keys, made once (the
    first time that op runs there), not per call."""

    __slots__ = ("backward", "forward", "scope")

    def __init__(self, scope: str) -> None:
        self.scope = scope
        self.forward = (scope, "forward")
        self.backward = (scope, "backward")


class OpMode(TorchDispatchMode):
    """Records inputs and outputs of aten ops; entered only while a dumped step runs."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in dynamo's `disable` by default: Python that
        # runs around every op (a no-op mode on the tiny preset: 1.65x with it, 1.43x without).
        # OpMode keeps torch.compile out itself: the tracer's package is on dynamo's skip list
        # (`_keep_dynamo_out`, at the first push), and while a compiled region runs the handler
        # switches frame evaluation off around its work, as the wrapper would.
        return not _OWN_DYNAMO_GUARD

    def ignore_compile_internals(self) -> bool:  # type: ignore[override]
        # True: torch.compile compiles with this mode on the stack (it takes the mode off
        # while it compiles) and runs the compiled code under it, which then dispatches only
        # the ops the compiled code calls (Inductor's external kernels); False would have
        # dynamo skip every frame while the mode is pushed, running the model eagerly
        return self._tracker.compiled

    def __init__(self, dumper: Recorder, tracker: ModuleTracker) -> None:
        super().__init__()
        cfg = dumper.config
        self._dumper = dumper
        self._tracker = tracker
        # per op: (aten name, wanted by the filters, writes one of its arguments in place,
        # schema position of the argument its outputs are views of or -1, positions of its
        # uninitialised outputs or None, its sites: module name -> `_Site` or None where the
        # module filters leave it out)
        self._ops: dict[Any, tuple[str, bool, bool, int, tuple[int, ...] | None,
                                   dict[str, _Site | None]]] = {}
        # data_ptr -> (tensor, version) of this step's uninitialised outputs not yet written
        # (see _record_inputs); the reference keeps the address from being reused meanwhile
        self._fresh: dict[int, tuple[torch.Tensor, int]] = {}
        self.want_in = cfg.io in ("input", "both")
        self.want_out = cfg.io in ("output", "both")
        self.want_fw = cfg.phases in ("forward", "both")
        self.want_bw = cfg.phases in ("backward", "both")
        self.calls = tracker.calls  # op scopes contain "::", so they never collide with modules
        # what re-running each call needs, where its inputs are kept to re-run it on
        self.want_specs = self.want_in and cfg.mode in ("tensor", "full")
        self.active = False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        if _OWN_DYNAMO_GUARD and _eval_frame_callback() is not None:  # type: ignore[misc]
            # inside torch.compile's frame evaluation: nothing this runs may be compiled
            prior = _set_eval_frame(None)  # type: ignore[misc]
            try:
                return self.__torch_dispatch__(func, types, args, kwargs)
            finally:
                _set_eval_frame(prior)  # type: ignore[misc]
        if kwargs is None:
            kwargs = {}
        # the tracer's own work around the op is guarded, the op is not: a failure of the
        # dump goes to the Dumper (`_fail`: raised where the config says so, else the dump goes
        # off with a warning) and the op runs as it would without the mode; an exception of the
        # op itself reaches the caller unchanged
        try:
            plan = self._before(func, args, kwargs)
        except Exception as e:  # noqa: BLE001 - the dump's failure, not the op's
            self._dumper._fail(e)
            plan = None
        out = func(*args, **kwargs)
        if plan is not None:
            try:
                self._after(plan, args, out)
            except Exception as e:  # noqa: BLE001 - the dump's failure, not the op's
                self._dumper._fail(e)
        return out

    def _before(self, func: Any, args: tuple, kwargs: dict) -> tuple | None:
        """What the mode does before the op runs: None when the op is not recorded, else the
        op's plan for `_after`, its input records made."""
        dumper = self._dumper
        info = self._ops.get(func)
        if info is None:
            name = op_name(func)
            mutates = _mutates(func)
            info = self._ops[func] = (name, dumper.config.wants_op(name), mutates,
                                      -1 if mutates else _view_source(func),
                                      UNINITIALISED_OUTPUTS.get(name), {})
        if info[2]:
            if _graphs.capturing() and _graphs.told():
                return None  # the writer's forgetting may launch a batch: not into a capture
            # some ops write arguments without bumping their version counter (BatchNorm's
            # running statistics): the writer forgets what it knew of every in-place argument
            dumper.forget(_flat(args, kwargs))
        if not info[1] or dumper._busy or not dumper.capturing or fake_mode_active() \
                or _graphs.capturing() and _graphs.told():
            return None
        if _graph_task_id() != -1:
            if _grad_enabled() or not self.want_bw:
                # grad enabled inside backward: activation recomputation (checkpoint) re-running
                # forward ops, already recorded in the forward pass
                return None
            phase = "backward"
            top = None
            node = _current_node()
            if node is None:
                # run by a callback queued on the engine after the graph's last node: DDP's
                # and FSDP's gradient synchronisation, not the model's backward
                return None
            if type(node) is _AccumulateGrad and _ddp_bucketing(func):
                return None
            tag = node.metadata.get(TAG)
            module = tag[0] if tag is not None else NONE
        else:
            if not self.want_fw:
                return None
            phase = "forward"
            stack = self._tracker.stack
            top = stack[-1] if stack else None
            module = top[1] if top is not None else NONE
            if top is not None and top[4]:
                return None  # recomputation driven by module hooks
        sites = info[5]
        site = sites.get(module, False)
        if site is False:
            site = sites[module] = _Site(op_scope(module, info[0])) \
                if self._tracker.wants(module) else None
        if site is None:
            return None
        scope = site.scope
        # the walk stops at the running module call's frame, whose line is known
        source = user_source(3, top[6], top[5]) if top is not None and top[6] is not None \
            else user_source(3)
        if source is RECEIVED or source is WRAPPER:
            # rebuilding a tensor another process sent, or DDP's own work: not the step's
            return None
        call = self.calls.count(site.forward if phase == "forward" else site.backward)
        # an in-place op's tensors get their version bumped only after the op returned from
        # this mode: before and after it they carry the same version, so no reuse for them
        stable = not info[2]
        inputs = _flat(args, kwargs, False) if self.want_in or self._fresh else None
        if self.want_specs:
            with tool_range():
                dumper.emit_call(f"{scope}.{phase}.{call}", func, args, kwargs)
        uninitialised = False
        if self._fresh:
            with tool_range():
                uninitialised = self._record_inputs(scope, module, info[0], phase, call,
                                                    source, inputs, info[2])
        elif self.want_in:
            with tool_range():
                dumper.emit_all(scope, module, info[0], phase, "input", call, source, inputs,
                                stable)
        if not self.want_out and info[4] is None:
            return None
        return info, scope, module, phase, call, source, stable, uninitialised

    def _after(self, plan: tuple, args: tuple, out: Any) -> None:
        """What the mode does after the op ran: its output records (`plan` from `_before`)."""
        info, scope, module, phase, call, source, stable, uninitialised = plan
        fresh = info[4]
        if isinstance(out, _Tensor):
            outs = [out]
        elif isinstance(out, (list, tuple)):
            # non-tensor outputs (None, ints) are skipped, as in pytree order
            outs = [t for t in out if isinstance(t, _Tensor)]
        else:
            outs = []
        if fresh is not None:
            for i in fresh:
                if i < len(outs):
                    self._remember_fresh(outs[i])
        base = args[info[3]] if 0 <= info[3] < len(args) else None
        if uninitialised and base is not None and self._is_fresh(base):
            return  # a view of uninitialised memory (the detach inside Parameter(empty))
        if self.want_out:
            # a view's output gets its base's version counter only after this mode returns
            try:
                version = base._version if isinstance(base, _Tensor) else None
            except RuntimeError:  # an inference tensor (torch.inference_mode) has no counter
                version = None
            with tool_range():
                if fresh is None:
                    self._dumper.emit_all(scope, module, info[0], phase, "output", call,
                                          source, outs, stable, version)
                else:
                    self._emit_leaving_out(scope, module, info[0], phase, "output", call,
                                           source, outs, fresh, stable, version)

    def _emit_leaving_out(self, scope: str, module: str, op: str, phase: str, direction: str,
                          call: int, source: str, tensors: list[torch.Tensor],
                          left_out: Sequence[int], stable: bool, version: int | None) -> None:
        """Records of `tensors` except those at the positions `left_out` (sorted): the others
        keep their indices."""
        first = 0
        for i in left_out:
            if i >= len(tensors):
                break
            self._dumper.emit_all(scope, module, op, phase, direction, call, source,
                                  tensors[first:i], stable, version, first)
            first = i + 1
        self._dumper.emit_all(scope, module, op, phase, direction, call, source,
                              tensors[first:], stable, version, first)

    def _remember_fresh(self, out: Any) -> None:
        """Note an uninitialised output (`aten.empty` & co), which is not recorded: what it
        holds is whatever the allocator found, different in every run."""
        if isinstance(out, _Tensor) and out.layout == torch.strided and not out.is_inference():
            ptr = out.data_ptr()
            if not ptr:  # no memory of its own (a wrapper subclass, or no elements)
                return
            if len(self._fresh) >= _MAX_FRESH:
                self._fresh.clear()
            # its storage, not the tensor, keeps the memory from being reused: a mode that
            # holds an op's output past its return makes torch hand the caller a detached alias
            self._fresh[ptr] = (out.untyped_storage(), out._version)

    def _is_fresh(self, t: Any) -> bool:
        """True when `t` is (a view at the start of) uninitialised memory not yet written."""
        if not isinstance(t, _Tensor) or t.layout != torch.strided or t.is_inference():
            return False
        entry = self._fresh.get(t.data_ptr())
        return entry is not None and t._version == entry[1]

    def _record_inputs(self, scope: str, module: str, op: str, phase: str, call: int,
                       source: str, inputs: list[torch.Tensor], writes: bool) -> bool:
        """The op's input records, except those of uninitialised memory (what `empty` made,
        read by the `detach` of `Parameter(empty)` or filled by `uniform_`, an `out=` buffer):
        those are left out, keeping the others' indices; the first record of that memory is
        the output of the op that writes it. True when any input was left out."""
        left_out = []
        for i, t in enumerate(inputs):
            if self._is_fresh(t):
                left_out.append(i)
                if writes:
                    del self._fresh[t.data_ptr()]  # written by this op
        if self.want_in:
            self._emit_leaving_out(scope, module, op, phase, "input", call, source, inputs,
                                   left_out, not writes, None)
        return bool(left_out)

    def suspend(self) -> bool:
        """Take this mode off the dispatch stack while the dump computes statistics from a hook
        (a pass-through would cost ~18 us per op); True when it was on top and is now off."""
        n = _stack_len()  # on_top(), inline: this runs for every record
        if self.active and n and _stack_at(n - 1) is self:
            _stack_pop(None)
            return True
        return False

    def on_top(self) -> bool:
        """True while this mode is pushed and on top of the dispatch stack."""
        n = _stack_len()
        return self.active and bool(n) and _stack_at(n - 1) is self

    def resume(self) -> None:
        """Put the mode back after `suspend`, unless it was abandoned meanwhile (`abandon`)."""
        if self.active:
            _stack_push(self)

    def abandon(self) -> None:
        """Stop recording without touching the dispatch stack, where the mode is not on top
        (the process is dying from a signal that arrived while the mode's handler ran): an
        inactive mode that torch puts back passes every op through, as the Dumper has
        stopped capturing."""
        self.active = False

    def push(self) -> None:
        if _OWN_DYNAMO_GUARD:
            _keep_dynamo_out()
        if not self.active:
            self._fresh.clear()  # a new step (push also follows the optimizer's pause)
        if not self.active:
            self.__enter__()
            self.active = True

    def pop(self) -> None:
        if self.active:
            self.active = False
            self.__exit__(None, None, None)
