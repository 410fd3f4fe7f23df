"""`tracer.Dumper`: the public capture API that ties hooks, the op mode, steps and the writer.

A Dumper counts steps, and while the current step is selected it installs the module hooks
(and, for level op/mix, the dispatch mode); between selected steps nothing is installed, so an
unselected step costs only torch's global optimizer hooks. Where a step ends is `StepRule`'s
(tracer._step_rule, docs/tracer.md "Steps"): the Dumper feeds it the optimizer, scaler and
explicit `step()` events and writes the step it says ended. Its own life is one `Lifecycle`
field, whose transitions are written once (tracer._lifecycle); the parameter, gradient and update
records are made by `tracer.capture.ParamRecords`.

This module holds the Dumper's life: its construction, `step`, `close`, the crash listener, the
writer it makes at the first record, and leaving a forked process. Its other parts are one file
each, mixed into the one class so that they share its one state: the record path the hooks call
(tracer._dumper_emit), a step's beginning and end (tracer._dumper_steps), the optimizer and
scaler hooks with the parameter records (tracer._dumper_optimizer), and failure handling
(tracer._dumper_failure).

What runs after the last optimizer step (``loss.item()``, ``zero_grad``, logging, a final
evaluation) is not a step: at close it is dropped, with a warning and a line in
``RUN/dump/rank{R}/notes.jsonl`` that count its records, so a run of N optimizer steps writes N
step files. A step ended by an exception, a caught signal or the process exiting before its
optimizer step is written with its records so far and ``status`` "interrupted" (`close`).
"""
from __future__ import annotations

import os
import threading
import weakref
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.optim import optimizer as _optim

from sleuth.common import describe_error, warn
from tracer._config import DumpConfig, load_json, warn_retired_switches
from tracer._crash import describe_exception, on_crash
from tracer._dumper_emit import Emitting
from tracer._dumper_failure import FailureHandling, disarm_flight_recorder
from tracer._dumper_optimizer import OptimizerHooks
from tracer._dumper_steps import StepBoundaries
from tracer._errors import ConfigError, DumpWriteError, WatchpointHit
from tracer._lifecycle import LIVE, Lifecycle
from tracer._step_rule import StepRule
from tracer.capture import (EagerWhileDumped, Kernels, ModuleTracker, ParamRecords,
                            SetupRecorder, on_clip, on_region, on_scaler_scale,
                            on_scaler_unscale, on_scaler_update, tool_range, user_source)
from tracer.storage import copy_stats, difference_sketch, difference_stats


def _make_writer(config: DumpConfig, rank: int, world_size: int) -> Any:
    from tracer.storage import make_writer

    return make_writer(config, rank=rank, world_size=world_size)


_live: weakref.WeakSet[Dumper] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for dumper in list(_live):
        dumper._leave_process(pop_mode=True)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class StepListener(Protocol):
    """What a Dumper tells a live reference (`tracer.LiveReference`): the steps it wrote, and
    when to compare those on disk. Nothing of it runs per record."""

    def step_ended(self, path: Path, rank: int, step: int) -> None:
        """Step `step` of `rank` ended; its file is, or will be once written, `path`."""

    def judge(self, *, final: bool = False) -> None:
        """Compare the ended steps whose files are on disk (`final`: the writer closed)."""


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


class Dumper(Emitting, StepBoundaries, OptimizerHooks, FailureHandling):
    """Dump a model's tensors step by step into ``RUN/dump/rank{R}/step{S}.h5``.

    Args:
        model: the model to name modules and parameters after; None attaches to every
            top-level module that runs (the first is ``<root>``, later ones ``<root1>``, ...).
        config: a DumpConfig, a dict, inline JSON, a JSON path, or None for the defaults.
        rank, world_size: default to $RANK / $WORLD_SIZE (0 and 1).
        first_step: the number of the first step (a resumed run's next optimizer step, so
            that dump steps keep matching the trainer's).
        reference: a `tracer.LiveReference`: each written step is compared with the
            reference run's step of the same number and rank while the run trains
            (docs/diff.md, "Live reference").

    Use as a context manager, or call ``close()``: it writes the last step and re-raises
    writer errors; an exception leaving the ``with`` block, an uncaught exception or SIGTERM
    writes the open step marked interrupted. Raises ConfigError for a bad config or a module
    filter matching nothing.
    """

    def __init__(self, model: torch.nn.Module | None = None,
                 config: DumpConfig | dict | str | os.PathLike | None = None, *,
                 rank: int | None = None, world_size: int | None = None,
                 first_step: int = 0, reference: StepListener | None = None) -> None:
        self.config = resolve_config(config)
        if isinstance(reference, (str, os.PathLike)):
            raise ConfigError(f"reference: pass tracer.LiveReference({str(reference)!r}), not a "
                              f"path: the comparison is the diff's, which a Dumper does not "
                              f"import by itself")
        self._reference = reference
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
        self._setup: SetupRecorder | None = None
        self._eager = EagerWhileDumped()
        if self._state is Lifecycle.OFF:
            return
        _live.add(self)
        self._tracker = ModuleTracker(self, model)
        self._params = ParamRecords(self._tracker, Kernels(copy_stats, difference_stats,
                                                           difference_sketch))
        self._setup = SetupRecorder(self._tracker.param_names, self._tracker.named_modules)
        if self.config.level in ("op", "mix"):
            from tracer.capture import OpMode

            self._mode = OpMode(self, self._tracker)
        self._handles = [_optim.register_optimizer_step_pre_hook(self._optimizer_pre),
                         _optim.register_optimizer_step_post_hook(self._optimizer_post),
                         on_scaler_update(self._scaler_update),
                         on_clip(self._clipped),
                         on_scaler_unscale(self._unscaled),
                         on_scaler_scale(self._scaled),
                         on_crash(self._crashed)]
        if self.config.compiled != "eager":
            self._handles.append(on_region(self._tracker.region, self._tracker.compiling,
                                           self.config.compiled == "interpret",
                                           self._tracker.kernels))
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
        self._judge_reference()

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
                if reason is None:  # a dying run's last steps are not worth its last seconds
                    self._judge_reference(final=True)
            finally:
                if reason is None and writer is not None:
                    disarm_flight_recorder(self.config, self.rank)

    @property
    def run_dir(self) -> Path:
        """The run directory the dump goes to (``RUN/dump/rank{R}/...``)."""
        return self.config.run_dir()

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
        self._take_setup(self._setup.take_model)

    def _take_setup(self, work: Any, *args: Any) -> None:
        """Take part of the step's setup (tracer.capture._setup) as the dump's own work; what
        fails is noted in the setup (the diff says it is incomplete), never raised into the
        run."""
        try:
            with torch.no_grad(), tool_range():
                work(*args)
        except Exception as e:  # noqa: BLE001 - the setup is an extra of the step's records
            self._setup.failed(describe_error(e))

    def _clipped(self, fn: str, args: dict, params: list, source: str) -> None:
        """A gradient-clipping call of the open step (tracer.capture._setup.on_clip)."""
        if self.capturing and not self._busy:
            self._take_setup(self._setup.clip, fn, args, params, source)

    def _unscaled(self, scaler: Any, optimizer: Any, explicit: bool) -> None:
        """A gradient scaler's unscale_ in the open step (tracer.capture._scaler)."""
        if self.capturing and not self._busy:
            self._take_setup(self._setup.scaler, scaler, optimizer, explicit, user_source(2))

    def _scaled(self, scaler: Any) -> None:
        """A gradient scaler's scale(loss) in the open step (tracer.capture._scaler)."""
        if self.capturing and not self._busy:
            self._take_setup(self._setup.scaled, user_source(2))

    def model_called(self, root: str, args: tuple, kwargs: dict | None) -> None:
        """A top-level call of the model in the open step: its batch's fingerprint."""
        if self.capturing and not self._busy:
            self._take_setup(self._setup.batch, root, args, kwargs)

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
