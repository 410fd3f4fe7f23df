"""Op-level capture in compiled code: ``"op_capture": "observer"``.

At every level the module hooks' tensor records (forward inputs and outputs, gradients) are
kept by the compiled observer too (`record`): their statistics and bytes are taken in C++ and
their rows come in order with the op records, with no Python writer per record. At level op
and mix the op records are the same as the dispatch mode's (tracer._op_mode), taken by torch's
C++ op callbacks
(`tracer._observer`, built from tracer/_observer.cpp at install) instead of a Python
TorchDispatchMode: no Python runs per op. The module hooks tell the observer which module runs
(`enter`, `leave`); it scopes a backward op to the module whose forward made the autograd node
that runs it (by the node's sequence number), takes the statistics of CPU tensors with
the statistics kernel's C API, and keeps a copy of every other tensor for the Python writer.
What it kept becomes rows when Python next records anything itself (`suspend`, which the
Dumper calls before each of its own records), when a module call leaves more than
`DRAIN_BYTES` of copies behind, and when the step ends, so rows stay in record order.

Differences from the dispatch mode (docs/tracer.md, "Op capture"): a dispatch mode changes
what torch runs (autograd copies gradients it holds references to, composite ops take their
tensor-subclass paths), and the observer records the run without those changes; ops that run
while another TorchDispatchMode is active, or while torch.compile traces, are left out.
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

from tracer import _source, _stats
from tracer._errors import ConfigError
from tracer._naming import NONE

if TYPE_CHECKING:
    from tracer._dumper import Dumper
    from tracer._module_hooks import ModuleTracker

DRAIN_BYTES = 64 << 20
"""Tensor bytes and copies kept for the Python writer beyond which a module boundary turns
them into records."""

_NOT_WANTED = -1
_owner: weakref.ref | None = None  # the OpObserver the compiled observer is configured for
_made: weakref.WeakSet = weakref.WeakSet()  # every OpObserver made (see in_use)


def load() -> Any:
    """The compiled observer module, or ConfigError saying how to get it."""
    if _stats._fused is None:
        raise ConfigError('op_capture "observer" needs the statistics kernel (tracer/_fused.c), '
                          'which is not built here or is switched off (SLEUTH_FUSED_STATS=0); '
                          'build it with `python setup.py build_ext --inplace` or use '
                          '"op_capture": "dispatch"')
    try:
        from tracer import _observer  # type: ignore[attr-defined]
    except ImportError as e:
        raise ConfigError(f'op_capture "observer" needs tracer._observer (tracer/_observer.cpp, '
                          f'built against torch at install: {e}); build it with `python '
                          f'setup.py build_ext --inplace` in an environment with torch, or use '
                          f'"op_capture": "dispatch"') from e
    return _observer


def available() -> bool:
    """True when `load` finds the compiled observer and the statistics kernel it uses."""
    try:
        load()
    except ConfigError:
        return False
    return True


def in_use() -> bool:
    """True while a Dumper that is neither closed nor stopped holds an OpObserver."""
    return any(not o._dumper._closed and o._dumper.enabled for o in list(_made))


class OpObserver:
    """The op level's capture through torch's C++ op callbacks; OpMode's interface."""

    def __init__(self, dumper: Dumper, tracker: ModuleTracker) -> None:
        self._ext = load()
        if in_use():
            raise ConfigError('op_capture "observer": another Dumper uses the op observer; one '
                              'Dumper at a time may (close the other first, or use '
                              '"op_capture": "dispatch")')
        self._dumper = dumper
        self._tracker = tracker
        cfg = dumper.config
        self._flags = (cfg.io in ("input", "both"), cfg.io in ("output", "both"),
                       cfg.phases in ("forward", "both"), cfg.phases in ("backward", "both"),
                       cfg.mode != "statistics")
        self._ids: dict[str, int] = {}  # module name -> scope id
        # level op or mix: op records through torch's callbacks; level module: the module
        # hooks' records only (`record`)
        self._ops = cfg.level in ("op", "mix")
        self.active = False
        self._suspended = False
        # statistics only: the parameter records in compiled code too (`snapshot`,
        # `record_params`); with tensor bytes they share stored bytes in the Python writer
        self.params_record = not self._flags[4]
        self._param_ids: dict[str, int] = {}  # parameter name -> scope id
        tracker.observer = self
        # backward ops find their module by the autograd node's sequence number (see
        # tracer/_observer.cpp): the module hooks need not tag the graph
        tracker.tag_graph = False
        _made.add(self)

    # -- configuration --------------------------------------------------------------------------
    def _configure(self) -> None:
        global _owner
        if _owner is not None and _owner() is self:
            return
        # the writers refresh it at each step start, later than this: read it now, or the
        # first Dumper's observer measures large tensors on one thread where torch leaves a core
        threads = _stats.refresh_stats_threads()
        self._ext.configure(self._dumper.config.wants_op, _source._is_internal,
                            _source._format, *self._flags, threads, _stats._fused._C_API)
        self._ids.clear()
        self._param_ids.clear()
        _owner = weakref.ref(self)

    def _scope_id(self, name: str) -> int:
        sid = self._ids.get(name)
        if sid is None:
            sid = self._ids[name] = (self._ext.add_scope(name) if self._tracker.wants(name)
                                     else _NOT_WANTED)
        return sid

    def _param_scope(self, name: str, owner: str) -> int:
        sid = self._param_ids.get(name)
        if sid is None:
            sid = self._param_ids[name] = self._ext.add_scope(name, self._scope_id(owner))
        return sid

    # -- the module hooks -----------------------------------------------------------------------
    def enter(self, name: str, recomputing: bool) -> None:
        """A module call starts (its forward ops are scoped to it)."""
        if self.active:
            kept = self._ext.set_scope(self._scope_id(name), recomputing)
            if kept > DRAIN_BYTES:
                self._dumper.take_observed()

    def leave(self) -> None:
        """A module call ended: the scope is the module that called it again."""
        if self.active:
            stack = self._tracker.stack
            if stack:
                top = stack[-1]
                self.enter(top[1], top[4])
            else:
                self.enter(NONE, False)

    # -- OpMode's interface ---------------------------------------------------------------------
    def reset_step(self) -> None:
        """A dumped step begins: call counts, the reuse table and the scopes start again."""
        self._configure()
        self._ext.reset_step()
        self._ext.set_params([(p, self._scope_id(owner))
                              for _, owner, p in self._tracker.param_names()],
                             self._scope_id(NONE))

    def push(self) -> None:
        if not self.active:
            self._configure()
            self.active = True
            self._ext.pause(False)
            self.leave()  # the scope of whatever runs now
            if self._ops:
                self._ext.start()

    def pop(self) -> None:
        if self.active:
            if self._ops:
                self._ext.stop()
            self.active = False
            self._dumper.take_observed()

    def record(self, module: str, phase: str, direction: str, call: int, source: str,
               tensors: Any, first: int) -> None:
        """Keep the module hooks' records of `tensors` (a module call's forward inputs or
        outputs, or one gradient) in the observer, in order with its op records: the
        statistics (and bytes) are taken in C++, and the rows come with the next drain."""
        sid = self._scope_id(module)
        if sid != _NOT_WANTED:
            self._ext.record(sid, phase == "backward", direction == "output", call, source,
                             tensors, first)

    def record_call(self, module: str, direction: str, call: int, tensors: list,
                    forward: bool, hook: bool) -> bool:
        """The module hooks' `_record` in compiled code: a module call's forward inputs or
        outputs kept now (`forward`), and (`hook`) C++ gradient hooks on those that require
        grad, which record their gradients in C++ (tracer/_observer_hooks.cpp). False where
        the Python path must take them (a tensor subclass, a source line that is not the
        step's, a record the Dumper would not make now)."""
        dumper = self._dumper
        if dumper._busy or not dumper.capturing or not self.active:
            return False
        if not dumper._open:
            from tracer._dumper import _in_data_worker

            if _in_data_worker():
                return False  # a DataLoader worker: the Python path leaves the dump to the trainer
        sid = self._scope_id(module)
        if sid == _NOT_WANTED:
            return True
        try:
            return self._ext.record_call(sid, direction == "output", call, tensors, forward,
                                         hook)
        except Exception as e:  # noqa: BLE001 - routed through on_error
            dumper._fail(e)
            return True

    def snapshot(self, buffers: list, params: list) -> bool:
        """Copy each parameter into its buffer before the optimizer step, keeping the copy's
        statistics for its param record; False, with nothing copied, where the Python path
        must (a tensor that is not dense on the CPU, a dtype the kernel does not read)."""
        return self._ext.snapshot(buffers, params)

    def record_params(self, call: int, source: str, params: list, before: list) -> None:
        """Keep the param, grad and update records of `params` ((name, owner, parameter)
        each; `before`: each one's pre-step copy, or None for no update record) as rows, in
        the Python path's order (Dumper._add_params)."""
        entries = []
        for (name, owner, p), copy in zip(params, before):
            grad = p.grad
            entries.append((self._param_scope(name, owner), p.detach(),
                            None if grad is None else grad.detach(), copy))
        self._ext.record_params(call, source, entries)

    def capture(self, on: bool) -> None:
        """Whether the C++ gradient hooks record (the module hooks are installed)."""
        self._ext.capture(on)

    def suspend(self) -> bool:
        """Pause while the dump runs its own work, after turning what was kept into rows
        first (the Dumper calls this before each record it makes itself)."""
        if not self.active or self._suspended:
            return False
        self._ext.pause(True)
        self._suspended = True
        try:
            if self._ext.pending():
                self._dumper.take_observed()
        except BaseException:
            self.resume()
            raise
        return True

    def resume(self) -> None:
        self._suspended = False
        self._ext.pause(False)

    def on_top(self) -> bool:
        return self.active

    def stored(self, tensor: Any) -> tuple[int, int] | None:
        """(offset, nbytes) in /tensors of a record the observer stored of `tensor`'s memory
        as it is now (a weight an op read: its param record shares those bytes)."""
        return self._ext.stored(tensor)

    def pending(self) -> int:
        return self._ext.pending()

    def drain(self, seq: int, place: Any) -> tuple[list, int]:
        """The kept records, numbered from `seq`: rows, and (fields, tensor, stable) for the
        writer's `add`, and how many of the latter there are; `place(chunk, on_written)`
        stores a uint8 tensor of their bytes and answers its offset in /tensors (mode
        tensor/full)."""
        give_back = self._ext.give_back

        def lend(chunk: Any) -> int:
            # the chunk's memory is reused once written (a fresh one's first touch costs as
            # much as the copy into it)
            return place(chunk, lambda: give_back(chunk))

        return self._ext.drain(seq, lend)

    def discard(self) -> None:
        """Drop what was kept (dumping is off)."""
        self._ext.drain(0, lambda chunk: 0)
