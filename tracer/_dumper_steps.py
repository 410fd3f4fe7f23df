"""Where the Dumper's steps begin and end: the hooks put in and taken off, the step written.

`StepBoundaries` is the part of `tracer.Dumper` (tracer._dumper) that acts at a step boundary
once `StepRule` (tracer._step_rule) has said where one is: a selected step begins with the hooks
(and the op mode) installed; a step ends with its parameter records (unless an optimizer step
took them), the hooks off and the writer told to write it. The step open at close is kept,
marked interrupted or dropped as `StepRule.last_step` says; a dropped step is noted in the
rank's notes.jsonl.
"""
from __future__ import annotations

import json

from sleuth.common import describe_error, warn
from tracer._dumper_failure import disarm_flight_recorder
from tracer._errors import WatchpointHit
from tracer._lifecycle import Lifecycle
from tracer._step_rule import LastStep
from tracer.capture import rewrap as rewrap_scalers


class StepBoundaries:
    """A step's beginning and end in `tracer.Dumper`, the last step of the run included."""

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
        self._setup.begin()
        if self.config.compiled == "eager":
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
        setup = None
        if was_open and how is not LastStep.DROP:
            self._take_setup(self._setup.compiled, self.config.compiled,
                             self._tracker.regions_run, self._tracker.wrapper_ran,
                             self._tracker.kernels_run)
            self._take_setup(self._setup.finish)
            setup = self._setup.taken
        self._setup.end()
        if not was_open:
            return
        self._busy = True
        try:
            if setup is not None:
                self._writer.set_attr("setup", json.dumps(setup, sort_keys=True))
            if how is LastStep.DROP:
                self._drop_step()
            elif how is LastStep.INTERRUPTED:
                self._writer.end_step(reason)
            else:
                self._writer.end_step()
            if how is not LastStep.DROP and self._reference is not None:
                from tracer.storage import step_path

                step = self.current_step
                self._reference.step_ended(step_path(self.config.run_dir(), self.rank, step),
                                           self.rank, step)
        finally:
            self._busy = False

    def _judge_reference(self, *, final: bool = False) -> None:
        """After a step boundary (`final`: at close, the writer closed): the live reference,
        if any, compares the written steps, and may end the run (`ReferenceDiverged`, raised
        here, outside the dump's own error handling, once the boundary is whole)."""
        if self._reference is not None:
            self._busy = True  # its reading makes no records
            try:
                self._reference.judge(final=final)
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
