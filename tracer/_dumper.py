"""`tracer.Dumper`: the public capture API that ties hooks, the op mode, steps and the writer.

A Dumper counts steps, and while the current step is selected it installs the module hooks
(and, for level op/mix, the dispatch mode); between selected steps nothing is installed, so an
unselected step costs only torch's global optimizer hooks. Where a step ends is `StepRule`'s
(tracer._step_rule, docs/tracer.md "Steps"): the Dumper feeds it the optimizer, scaler and
explicit `step()` events and writes the step it says ended. Its own life is one `Lifecycle`
field, whose transitions are written once (tracer._lifecycle); the parameter, gradient and update
records are made by `tracer.capture.ParamRecords`.

What runs after the last optimizer step (``loss.item()``, ``zero_grad``, logging, a final
evaluation) is not a step: at close it is dropped, with a warning and a line in
``RUN/dump/rank{R}/notes.jsonl`` that count its records, so a run of N optimizer steps writes N
step files. A step ended by an exception, a caught signal or the process exiting before its
optimizer step is written with its records so far and ``status`` "interrupted" (`close`).
"""
from __future__ import annotations

import json
import os
import sys
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.optim import optimizer as _optim

from tracer._config import DumpConfig, load_json, warn_retired_switches
from tracer._errors import (ConfigError, DumpWriteError, TracerError, WatchpointHit,
                            describe_error, warn)
from tracer._crash import describe_exception, on_crash
from tracer._lifecycle import LIVE, Lifecycle
from tracer._step_rule import LastStep, StepRule
from tracer.capture import (EagerWhileDumped, Kernels, ModuleTracker, ParamRecords, Site,
                            encode_call, in_graph_capture, local_shard, on_scaler_update,
                            recording_closure, tool_range, user_source)
from tracer.capture import rewrap as rewrap_scalers
from tracer.storage import copy_stats, difference_sketch, difference_stats, stored_extent


def _make_writer(config: DumpConfig, rank: int, world_size: int) -> Any:
    from tracer.storage import make_writer

    return make_writer(config, rank=rank, world_size=world_size)


def disarm_flight_recorder(config: DumpConfig, rank: int) -> None:
    from tracer.storage import disarm_flight_recorder as disarm

    disarm(config, rank)


_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter


def _values(t: torch.Tensor) -> torch.Tensor:
    """`t` where it holds memory of its own, else a plain tensor of its values on this rank.

    A wrapper tensor subclass (DTensor, a quantised or float8 weight, a user's own) has no
    memory behind it, and the writers read memory. A DTensor gives its local shard (the
    parameter records do the same); any other subclass copies its values into a plain tensor
    through its own `copy_`, which it implements as it implements every op. The copy runs
    without autograd so the run's graph is left as it was."""
    if _has_memory(t):
        return t
    with torch.no_grad():
        t = local_shard(t.detach())
        if type(t) is _Tensor or type(t) is _Parameter:
            return t
        return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def _has_memory(t: torch.Tensor) -> bool:
    """True when `t`'s storage holds memory that covers its elements.

    The data pointer alone does not tell: a wrapper's storage is empty, but its data pointer
    is the storage's (null) plus its storage offset, and FSDP2 makes its gradient DTensors with
    the local shard's offset, so a reader trusting that pointer reads address 0x1000 and the
    run dies with SIGSEGV."""
    if not t.numel():
        return True
    try:
        storage = t.untyped_storage()
        if not storage.data_ptr():
            return False
        nbytes = storage.nbytes()
    except (RuntimeError, NotImplementedError):  # a wrapper's invalid storage, or none at all
        return False
    extent = stored_extent(tuple(t.shape), t.stride())
    return nbytes >= (t.storage_offset() + extent) * t.element_size()


def _in_data_worker() -> bool:
    """True in a DataLoader worker process once its loop runs (see `Dumper._leave_process`)."""
    data = sys.modules.get("torch.utils.data")
    info = getattr(data, "get_worker_info", None)
    return info is not None and info() is not None


_live: weakref.WeakSet[Dumper] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for dumper in list(_live):
        dumper._leave_process(pop_mode=True)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def resolve_config(config: DumpConfig | dict | str | os.PathLike | None) -> DumpConfig:
    """A DumpConfig from a config, a dict, inline JSON (``{...}``), a JSON path, or None
    (the defaults)."""
    if config is None:
        return DumpConfig()
    if isinstance(config, DumpConfig):
        return config
    if isinstance(config, dict):
        return DumpConfig.from_dict(config)
    if isinstance(config, str) and config.lstrip().startswith("{"):
        return DumpConfig.from_dict(load_json(config, "inline dump config"))
    if isinstance(config, (str, os.PathLike)):
        return DumpConfig.from_json(Path(config))
    raise ConfigError(f"config: expected a DumpConfig, dict, JSON path or None, "
                      f"got {type(config).__name__}")


class Dumper:
    """Dump a model's tensors step by step into ``RUN/dump/rank{R}/step{S}.h5``.

    Args:
        model: the model to name modules and parameters after; None attaches to every
            top-level module that runs (the first is ``<root>``, later ones ``<root1>``, ...).
        config: a DumpConfig, a dict, inline JSON, a JSON path, or None for the defaults.
        rank, world_size: default to $RANK / $WORLD_SIZE (0 and 1).
        first_step: the number of the first step (a resumed run's next optimizer step, so
            that dump steps keep matching the trainer's).

    Use as a context manager, or call ``close()``: it writes the last step and re-raises
    writer errors; an exception leaving the ``with`` block, an uncaught exception or SIGTERM
    writes the open step marked interrupted. Raises ConfigError for a bad config or a module
    filter matching nothing.
    """

    def __init__(self, model: torch.nn.Module | None = None,
                 config: DumpConfig | dict | str | os.PathLike | None = None, *,
                 rank: int | None = None, world_size: int | None = None,
                 first_step: int = 0) -> None:
        self.config = resolve_config(config)
        warn_retired_switches()
        self.rank = int(os.environ.get("RANK", 0)) if rank is None else int(rank)
        self.world_size = (int(os.environ.get("WORLD_SIZE", 1)) if world_size is None
                           else int(world_size))
        self.current_step = int(first_step)
        self._state = Lifecycle.IDLE if self.config.wants_rank(self.rank) else Lifecycle.OFF
        self.capturing = False
        """`state` is CAPTURING, kept as a plain attribute for the hooks, which read it per
        record; written only by `_to`."""
        self._busy = False  # the Dumper runs its own work on tensors: the hooks pass it by
        self._open = False  # the writer holds the current step open (begun at its first record)
        self._writer: Any = None
        # the writer's add and storage's RecordMeta, bound when the writer is made (the
        # per-record calls; the step file's module, and h5py, load only then)
        self._add: Any = None
        self._meta: Any = None
        self._lock = threading.Lock()
        self._rule = StepRule()
        self._handles: list[Any] = []
        self._mode: Any = None
        self._params: ParamRecords | None = None
        self._eager = EagerWhileDumped()
        if self._state is Lifecycle.OFF:
            return
        _live.add(self)
        self._tracker = ModuleTracker(self, model)
        self._params = ParamRecords(self._tracker, Kernels(copy_stats, difference_stats,
                                                           difference_sketch))
        if self.config.level in ("op", "mix"):
            from tracer.capture import OpMode

            self._mode = OpMode(self, self._tracker)
        self._handles = [_optim.register_optimizer_step_pre_hook(self._optimizer_pre),
                         _optim.register_optimizer_step_post_hook(self._optimizer_post),
                         on_scaler_update(self._scaler_update),
                         on_crash(self._crashed)]
        try:
            self._begin()
        except BaseException:  # nothing of a Dumper that failed to start stays attached
            self._leave_process(pop_mode=True)
            raise

    @property
    def state(self) -> Lifecycle:
        """Where the Dumper is in its life (`Lifecycle`)."""
        return self._state

    @property
    def enabled(self) -> bool:
        """True while the dump can still record: attached to a selected rank, not failed, not
        switched off, not closed."""
        return self._state in LIVE

    def _to(self, state: Lifecycle) -> None:
        """The one place the lifecycle changes (an illegal transition raises: `Lifecycle.to`)."""
        self._state = self._state.to(state, step_open=self._open)
        self.capturing = state is Lifecycle.CAPTURING

    # -- public API -----------------------------------------------------------------------------
    def __enter__(self) -> Dumper:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close(interrupted=exc if exc is not None else exc_type.__name__)
        except WatchpointHit:
            # the exception in flight (often the first hit, raised where it happened) is the
            # one to see; a later record hitting while the step is written must not mask it
            pass
        except DumpWriteError:
            # close() says again that the dump is incomplete; the write error in flight
            # already says so, and where
            if not isinstance(exc, DumpWriteError):
                raise

    def step(self) -> None:
        """End the current step (its file is written) and start the next one.

        After the first explicit call, optimizer steps no longer end steps by themselves. A
        first call right after an optimizer step (``opt.step(); d.step()``, the usual place)
        ends nothing: that optimizer step already ended the iteration's step.
        """
        ends = self._rule.explicit_step()
        self._after_failure()
        if self._state not in LIVE:
            self.current_step += 1
        elif ends:
            self._next_step()

    def _next_step(self) -> None:
        """End the open step and begin the next; a failure goes through on_error."""
        try:
            self._end()
            self.current_step += 1
            self._begin()
        except Exception as e:  # noqa: BLE001 - routed through on_error
            self._fail(e)

    def close(self, *, interrupted: BaseException | str | None = None) -> None:
        """Write the current step if it recorded anything, remove every hook, close the writer
        (re-raising its errors). Safe to call twice.

        `interrupted`: the exception (or a description) that ended the run: the open step is
        written with its records so far, `complete` 0, `status` "interrupted" and the reason
        (``"ValueError: bad batch"``). Without it the open step is written as a step, unless
        optimizer steps end this Dumper's steps (no explicit `step()`) and one already did:
        then a step that ran backward is marked interrupted (the run ended before its
        optimizer step), and one that did not holds only what followed the last optimizer step
        and is dropped with a note (`StepRule.last_step`)."""
        was = self._state
        if was in (Lifecycle.CLOSING, Lifecycle.CLOSED):
            return
        self._to(Lifecycle.CLOSING)
        reason = None
        if interrupted is not None:
            reason = (interrupted if isinstance(interrupted, str)
                      else describe_exception(interrupted)) or "interrupted"
        if reason is None and was in LIVE:
            self._warn_steps_never_run()
        try:
            if was is Lifecycle.FAILED:
                self._uninstall()
                self._drop_writer()
            elif was is Lifecycle.CAPTURING:
                self._end_last(reason)
        finally:
            for handle in self._handles:
                handle.remove()
            self._handles = []
            if self._params is not None:
                self._params.release()
            writer, self._writer = self._writer, None
            self._open = False  # closing the writer ends whatever it still holds
            self._to(Lifecycle.CLOSED)
            _live.discard(self)
            try:
                if writer is not None:
                    writer.close()
            finally:
                if reason is None and writer is not None:
                    disarm_flight_recorder(self.config, self.rank)

    @property
    def run_dir(self) -> Path:
        """The run directory the dump goes to (``RUN/dump/rank{R}/...``)."""
        return self.config.run_dir()

    # -- recording ------------------------------------------------------------------------------
    def emit(self, scope: str, module: str, op: str, phase: str, direction: str, index: int,
             call: int, source: str, tensor: torch.Tensor, stable: bool = True,
             version: int | None = None, stats: dict | None = None) -> None:
        """Hand one tensor to the writer under its record name (called from the hooks).

        `stable` False: the tensor is an argument or output of an in-place op running in the
        dispatch mode; torch bumps its version counter only after the op returns, so the writer
        must not match its statistics to (or offer them for) another record at that version.
        `version`: the output of a view op in the dispatch mode, which shares its base's
        version counter only after the mode returns: the base's version (see `Writer.add`).
        `stats`: statistics computed already (see `Writer.add`).
        """
        if self._busy or not self.capturing:
            return
        self.emit_all(scope, module, op, phase, direction, call, source, (tensor,), stable,
                      version, index, stats)

    def emit_all(self, scope: str, module: str, op: str, phase: str, direction: str,
                 call: int, source: str, tensors: Sequence[torch.Tensor], stable: bool = True,
                 version: int | None = None, first: int = 0, stats: dict | None = None
                 ) -> None:
        """`emit` for several tensors of one call, indexed from `first`: one pass through the
        lock and the dispatch-mode suspension for all of them. Inline, not through
        `_quietly`: each Python call level costs ~3 us on the caches an op just cooled."""
        if self._busy or not self.capturing or not tensors:
            return
        if phase == "backward":
            self._rule.ran_backward = True
        if not self._open and _in_data_worker():
            self._leave_process()
            return
        error = None
        with self._lock:
            self._busy = True
            mode = self._mode
            suspended = False
            try:
                suspended = mode is not None and mode.suspend()
                if not self._open:
                    self._open_step()
                meta, add = self._meta, self._add
                prefix = f"{scope}.{phase}.{call}.{direction}."
                caller = source.caller if type(source) is Site else ""
                for i, t in enumerate(tensors, first):
                    if type(t) is not _Tensor and type(t) is not _Parameter:
                        t = _values(t)  # a tensor subclass
                    # RecordMeta(name, module, op, phase, direction, index, call, source, caller)
                    add(meta(prefix + str(i), module, op, phase, direction, i, call, source,
                             caller), t, stable, version, stats)
            except Exception as e:  # noqa: BLE001 - routed through on_error below
                error = e
            finally:
                if suspended:
                    mode.resume()
                self._busy = False
        if error is not None:
            self._fail(error)

    def emit_call(self, name: str, func: Any, args: tuple, kwargs: dict) -> None:
        """Record what re-running an op call needs (its overload and arguments, the tensors
        by input record: tracer.capture._calls) in the step's /calls, before its inputs are
        recorded (its seq is that of its first input record)."""
        if self._busy or not self.capturing:
            return
        if not self._open and _in_data_worker():
            self._leave_process()
            return
        error = self._quietly(self._add_call, name, func, args, kwargs)
        if error is not None:
            self._fail(error)

    def _add_call(self, name: str, func: Any, args: tuple, kwargs: dict) -> None:
        if not self._open:
            self._open_step()
        self._writer.add_call(self._writer.next_seq, name, encode_call(func, args, kwargs))

    def _quietly(self, work: Any, *args: Any) -> Exception | None:
        """Run the dump's own `work(*args)` under the lock, marked busy (the hooks ignore what
        it runs) and with the op mode off the dispatch stack; returns its exception."""
        with self._lock:
            self._busy = True
            mode = self._mode
            suspended = False
            try:
                suspended = mode is not None and mode.suspend()
                work(*args)
            except Exception as e:  # noqa: BLE001 - the caller routes it through on_error
                return e
            finally:
                if suspended:
                    mode.resume()
                self._busy = False
        return None

    def forget(self, tensors: list[torch.Tensor]) -> None:
        """Tell the writer these tensors are being written in place (see `Writer.forget`)."""
        if self._writer is not None:
            self._writer.forget(tensors)

    def _open_step(self) -> None:
        """Have the writer begin the current step (at its first record); the first step also
        makes the writer, the flight recorder and the live watchpoints."""
        if self._state is not Lifecycle.CAPTURING:
            raise AssertionError(f"tracer bug: a step opened while {self._state.value}")
        if self._writer is None:
            from tracer.storage import RecordMeta

            self._writer = _make_writer(self.config, self.rank, self.world_size)
            self._add, self._meta = self._writer.add, RecordMeta
            # the first step claims the rank (tracer.storage._lock): a run directory of another
            # run, or a rank another writer holds, fails here, before the flight recorder
            # could write into that folder
            self._writer.begin_step(self.current_step)
            from tracer.storage import install_flight_recorder, install_watch

            # the flight recorder and the watchpoints; removed with the writer at close. The
            # open step is written on a crash by the Dumper's own crash listener (__init__),
            # with or without a flight recorder
            recorder = None
            try:
                recorder = install_flight_recorder(self._writer, self.config)
            except Exception as e:  # noqa: BLE001 - the flight recorder is a best-effort extra
                warn(f"no flight recorder for this run ({describe_error(e)})", stacklevel=3)
            install_watch(self._writer, self.config, recorder)
        else:
            self._writer.begin_step(self.current_step)
        self._open = True

    def _fail(self, error: Exception) -> None:
        """A failure of the dump's own work (writing, a hook, the optimizer hook, a claim on the
        run directory): raised where the config `raises()` (on_error "raise", SLEUTH_STRICT=1)
        or a watchpoint asked to stop the run; otherwise the dump goes off with one warning,
        its flight recorder disarmed so nothing more is written, and the run goes on. Called
        again with the error it raised (a hook above the one that failed), it raises it again."""
        if isinstance(error, WatchpointHit) or self.config.raises():
            if isinstance(error, TracerError):
                raise error
            raise TracerError(f"dumping step {self.current_step} failed: "
                              f"{describe_error(error)}; with \"on_error\": \"warn\" (the "
                              f"default) and SLEUTH_STRICT unset the run goes on without the "
                              f"dump") from error
        if self._state in LIVE:
            # hooks come off at the next step boundary (`_after_failure`): this may run inside
            # the dispatch mode's handler, where popping the mode would pop someone else's
            self._to(Lifecycle.FAILED)
        elif self._state is not Lifecycle.CLOSING:  # (closing: close() takes everything off)
            return  # switched off already, and said so
        try:
            disarm_flight_recorder(self.config, self.rank)
        except Exception:  # noqa: BLE001 - restoring the previous hooks is best effort
            pass
        warn(f"the tensor dump is off from step {self.current_step} on, and the run goes on "
             f"without it: {describe_error(error)} (SLEUTH_STRICT=1 stops the run instead)",
             stacklevel=3)

    def _after_failure(self) -> None:
        """At a step boundary after a failure: the hooks and the writer come off."""
        if self._state is Lifecycle.FAILED:
            self._uninstall()
            self._drop_writer()
            self._to(Lifecycle.OFF)

    def _drop_writer(self) -> None:
        """Close the writer of a dump that failed: its threads stop, its rank lock is released.
        What it still has to say was warned about already."""
        writer, self._writer = self._writer, None
        self._open = False
        if writer is not None:
            try:
                writer.close()
            except Exception:  # noqa: BLE001 - the dump is off; the failure is reported
                pass

    def _leave_process(self, pop_mode: bool = False) -> None:
        """Stop for good in this process, touching neither the dump nor the writer.

        Called in a forked child (the writer's threads and file helper stayed in the parent,
        whose step files these are) and in a DataLoader worker, where nn.Module transforms run
        but no training step does: with the zero-code attach a spawned worker has a Dumper of
        its own, whose step files would overwrite the trainer's. The op mode is taken off the
        dispatch stack only where it is on top and no handler of it runs (`pop_mode`, after a
        fork); elsewhere it stays and passes every op through."""
        self._open = False
        self._writer = None
        self._to(Lifecycle.CLOSED)
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._tracker.remove()
        self._eager.leave()
        mode = self._mode
        if pop_mode and mode is not None and mode.on_top():
            mode.pop()
        _live.discard(self)

    # -- steps ----------------------------------------------------------------------------------
    def _begin(self) -> None:
        rewrap_scalers()  # a scaler class imported since (FSDP's)
        self._rule.begin()
        if self._state is Lifecycle.IDLE and self._writer is not None \
                and not self._writer.enabled:
            # the writer switched the dump off after an error it warned about (on_error
            # "warn"): the hooks stay off from now on, and nothing more is written
            self._to(Lifecycle.OFF)
            disarm_flight_recorder(self.config, self.rank)
            self._drop_writer()
        if self._state is not Lifecycle.IDLE or not self.config.wants_step(self.current_step):
            self._params.release()
            return
        self._tracker.reset_step()
        self._params.begin_step()
        self._tracker.install()
        if self._mode is not None:
            self._mode.push()
        self._to(Lifecycle.CAPTURING)
        self._eager.enter(self.current_step)

    def _uninstall(self) -> None:
        self._eager.leave()
        if self._mode is not None:
            self._mode.pop()
        self._tracker.remove()

    def _end(self) -> None:
        """End the current step at a step boundary: the step's parameter records unless an
        optimizer step took them, the hooks off, the step written."""
        if self._state is not Lifecycle.CAPTURING:
            # a step that was not dumped ended: an earlier step's file that failed to write
            # is reported now, not at close (the async writer's `step_boundary`)
            boundary = getattr(self._writer, "step_boundary", None)
            if boundary is not None:
                boundary()
            return
        try:
            if self._mode is not None:
                self._mode.pop()  # the parameter records' ops are not records
            if self.config.params and not self._params.taken:
                self._record_params(call=0, with_update=False)
        finally:
            self._write_step(LastStep.KEEP, None)

    def _end_last(self, interrupted: str | None) -> None:
        """End the step open at close as `StepRule.last_step` says: kept, interrupted or
        dropped. A kept or interrupted step gets its parameter and gradient records unless an
        optimizer step took them: in an interrupted step, the weights and gradients the run died
        with, where an error taking them must not hide the one that ended the run, so it is only
        warned about (a watchpoint hit among them is already in the step's /hits)."""
        how, reason = self._rule.last_step(interrupted)
        try:
            if self._mode is not None:
                self._mode.pop()
            if (self.config.params and not self._params.taken and how is not LastStep.DROP
                    and self._open):
                try:
                    self._record_params(call=0, with_update=False)
                except Exception as e:  # noqa: BLE001 - the run is ending with its own error
                    if reason is None:
                        raise
                    if not isinstance(e, WatchpointHit):
                        warn(f"the parameter records of interrupted step {self.current_step} "
                             f"were not taken: {describe_error(e)}", stacklevel=2)
        finally:
            self._write_step(how, reason)

    def _warn_steps_never_run(self) -> None:
        """Steps the config asks for that the run ended before beginning (`"steps": "9"` in a
        run of two steps): one line, since the dump then lacks them without a trace. The step
        the run was in at its end is not among them: its records are written or noted."""
        # the open step, if any, is written or dropped with a note
        never = self.config.steps_from(self.current_step + 1)
        if not never or self._writer is None:
            return
        last = f"after step {self.current_step - 1}" if self.current_step > 0 else \
            "before its first optimizer step"
        warn(f"step(s) {', '.join(never)} of the dump config never ran: the run ended {last}, "
             f"so the dump holds none of them", stacklevel=3)

    def _write_step(self, how: LastStep, reason: str | None) -> None:
        """Take the hooks off and have the writer write the open step (`how`), if it has one."""
        was_open, self._open = self._open, False
        if self._state is Lifecycle.CAPTURING:
            self._to(Lifecycle.IDLE)
        self._uninstall()
        if not was_open:
            return
        self._busy = True
        try:
            if how is LastStep.DROP:
                self._drop_step()
            elif how is LastStep.INTERRUPTED:
                self._writer.end_step(reason)
            else:
                self._writer.end_step()
        finally:
            self._busy = False

    def _drop_step(self) -> None:
        """Drop the open step (what followed the last optimizer step), saying so: a warning
        and a line in the rank's notes.jsonl, both with the number of records dropped."""
        from tracer.storage import step_path

        records = self._writer.next_seq
        self._writer.end_step(drop=True)
        if not records:
            return
        step = self.current_step
        note = {"step": step, "dropped_records": records,
                "reason": "made after the last optimizer.step() of the run (loss.item(), "
                          "zero_grad, logging, evaluation): not a step of its own"}
        path = step_path(self.config.run_dir(), self.rank, step).with_name("notes.jsonl")
        where = f"noted in {path}"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps(note) + "\n")
        except OSError as e:
            where = f"not noted in {path}: {e}"
        if step > 0:  # a step asked for past the run's end is the usual way here
            why = (f"belong to no step: a run's steps are its optimizer steps, and its last was "
                   f"step {step - 1}, so there is no step {step} to write ({where}); in a loop "
                   f"of your own, Dumper.step() ends a step where you choose")
        else:
            why = (f"were not written as step {step} ({where}); call Dumper.step() yourself to "
                   f"choose where steps end")
        warn(f"{records} record(s) made after the run's last optimizer.step() {why}",
             stacklevel=5)  # the user's close (or with block)

    def _crashed(self, reason: str) -> None:
        """The process is dying (an uncaught exception, SIGTERM; tracer._crash):
        write the open step, marked interrupted, while it still can."""
        if self._state not in LIVE:
            return
        mode = self._mode
        if mode is not None and mode.active and not mode.on_top():
            # a signal handler runs between any two bytecodes: inside the mode's own handler
            # (torch takes the mode off the stack while it runs) or while the dump suspended it.
            # Popping now would take another mode off, or fail on an empty stack ("trying to
            # pop from empty mode stack"); where the process goes on, torch puts it back,
            # inactive, and it passes every op through
            mode.abandon()
        self.close(interrupted=reason)

    def _record_params(self, call: int, with_update: bool,
                       optimizer: torch.optim.Optimizer | None = None) -> None:
        """The parameter records of a dumped step (`ParamRecords`), handed to the writer."""
        params = self._params.wanted(optimizer) if not self._busy else []
        if params and not self._open and _in_data_worker():
            self._leave_process()
            return
        if params:
            # one pass through the lock for all of the step's parameter records
            with tool_range():
                error = self._quietly(self._add_params, params, call, user_source(3),
                                      with_update)
            if error is not None:
                self._fail(error)
        self._params.forget()

    def _add_params(self, params: list, call: int, source: str, with_update: bool) -> None:
        """Hand `params`' records to the writer (run by `_quietly`)."""
        if not self._open:
            self._open_step()
        meta, add = self._meta, self._add
        caller = source.caller if type(source) is Site else ""
        for r in self._params.records(params, call, with_update=with_update,
                                      keep_bytes=self.config.mode != "statistics",
                                      sketch=self._writer.sketch):
            # RecordMeta(name, module, op, phase, direction, index, call, source, caller)
            add(meta(r.name, r.module, "", "optimizer", r.direction, 0, call, source, caller),
                r.tensor, True, None, r.stats)

    # -- optimizer hooks ------------------------------------------------------------------------
    def _optimizer_pre(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict
                       ) -> tuple[tuple, dict] | None:
        """Take the step's pre-step parameter copies and take the op mode off while the
        optimizer runs; its closure, if any, is handed on wrapped so that its forward and
        backward are recorded after all (`tracer.capture.recording_closure`). A failure is the
        dump's (`_fail`): the optimizer step then runs with the arguments it was given."""
        if not self.capturing or in_graph_capture():
            return None
        try:
            return self._before_optimizer(optimizer, args, kwargs)
        except Exception as e:  # noqa: BLE001 - routed through on_error
            self._fail(e)
            return None

    def _before_optimizer(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict
                          ) -> tuple[tuple, dict] | None:
        if self._mode is not None:
            self._mode.pop()  # the optimizer's own ops are not records
        if self._open:
            # batched device records are measured before the optimizer writes the weights
            # and gradients they read (tracer.storage._batcher)
            self._writer.launch_pending()
        if self.config.params:
            self._busy = True
            try:
                with torch.no_grad(), tool_range():
                    # a copy told to the writer as the parameter's bytes (`Writer.same_bytes`)
                    self._params.before_step(self._params.wanted(optimizer),
                                             self._writer.same_bytes if self._open else None)
            finally:
                self._busy = False
        if self._mode is None:
            return None  # module hooks stay installed while the optimizer runs
        return recording_closure(optimizer, args, kwargs, self._mode, self)

    def _optimizer_post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._after_failure()
        if self._state not in LIVE or in_graph_capture():
            return  # a captured step is not run: it ends no step (tracer.capture._graphs)
        try:
            self._after_optimizer(optimizer)
        except Exception as e:  # noqa: BLE001 - routed through on_error
            self._fail(e)

    def _after_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer step's parameter records; the step it ends (`StepRule`) is written and
        the next one begins."""
        if self.capturing and self.config.params:
            call = self._tracker.calls.next("<optimizer>", "optimizer")
            self._record_params(call=call, with_update=True, optimizer=optimizer)
            self._params.taken = True
        if self._rule.optimizer_step():
            self._end()
            self.current_step += 1
            self._begin()
        elif self.capturing and self._mode is not None:
            self._mode.push()

    def _scaler_update(self, scaler: Any) -> None:
        """``GradScaler.update()`` ends an iteration. When the scaler skipped
        ``optimizer.step()`` (Inf or NaN gradients), no optimizer hook ended the step: end it
        here (its parameter and gradient records are taken as at any step end without an
        optimizer step), so the next iteration gets a step, and names, of its own."""
        ends = self._rule.scaler_update()
        self._after_failure()
        if ends and self._state in LIVE:
            self._next_step()
