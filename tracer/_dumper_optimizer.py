"""The Dumper's optimizer and GradScaler hooks, and each optimizer step's parameter records.

`OptimizerHooks` is the part of `tracer.Dumper` (tracer._dumper) that torch's global optimizer
hooks and the scaler hook (tracer.capture._scaler) call: before an optimizer step the parameter
copies are taken and the op mode comes off (the optimizer's own ops are not records); after it
the step's parameter, gradient and update records (`tracer.capture.ParamRecords`) are handed to
the writer, and the step `StepRule` says ended is written. A failure in them is the dump's
(`_fail`): the optimizer step runs as it would without the dump.
"""
from __future__ import annotations

from typing import Any

import torch

from tracer._dumper_emit import in_data_worker
from tracer._lifecycle import LIVE
from tracer.capture import Site, in_graph_capture, recording_closure, tool_range, user_source

_new = tuple.__new__


class OptimizerHooks:
    """The optimizer and scaler hooks of `tracer.Dumper`, and its parameter records."""

    def _record_params(self, call: int, with_update: bool,
                       optimizer: torch.optim.Optimizer | None = None) -> None:
        """The parameter records of a dumped step (`ParamRecords`), handed to the writer."""
        params = self._params.wanted(optimizer) if not self._busy else []
        if params and not self._open and in_data_worker():
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
            # RecordMeta(name, module, op, phase, direction, index, call, source, caller),
            # made by tuple's own __new__ (the named tuple's is a Python call)
            add(_new(meta, (r.name, r.module, "", "optimizer", r.direction, 0, call, source,
                            caller)), r.tensor, True, None, r.stats)

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
        self._take_setup(self._setup.optimizer, optimizer)
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
        self._judge_reference()

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
