"""`StepRule`: where a dumped step ends, the one definition of docs/tracer.md, "Steps".

A step begins when the previous ``optimizer.step()`` (of any optimizer) returns and ends when its
own does, so dump step numbers are the optimizer's steps and equal the trainer's
``metrics.jsonl`` steps. The cases around that rule:

- gradient accumulation: several backward passes before one optimizer step are one step;
- ``optimizer.step(closure)``: the closure's forward and backward run inside the optimizer step,
  before it returns, so they belong to the step it ends;
- ``GradScaler``: when ``scaler.step()`` skipped the optimizer step (Inf or NaN gradients),
  ``scaler.update()`` ends the step instead, so a skipped iteration is a step of its own;
- evaluation between two optimizer steps opens the next step, and before the first one it is
  part of step 0;
- ``Dumper.step()``: once the script calls it, only its calls end steps (a first call right
  after an optimizer step ends nothing more: that optimizer step ended the iteration's step);
- the end of a run: what follows the last optimizer step is not a step (dropped, and noted),
  unless it ran backward (a step cut short before its optimizer step: interrupted); a run with
  no optimizer step at all is one step, kept; an exception or signal marks the step interrupted.

The rule is pure bookkeeping, with no torch in it: `tracer.Dumper` tells it what happened (the
hooks see the events) and does what it answers (writes the step, begins the next).
"""
from __future__ import annotations

import enum

BEFORE_OPTIMIZER_STEP = "the run ended before this step's optimizer.step()"
"""The reason a step that ran backward but never reached its optimizer step is interrupted."""


class LastStep(enum.Enum):
    """What becomes of the step open when the run ends (`StepRule.last_step`)."""

    KEEP = "keep"
    """written as a step: explicit steps, or a run with no optimizer step at all"""
    INTERRUPTED = "interrupted"
    """written with its records so far and the status "interrupted" (and why)"""
    DROP = "drop"
    """not a step: what followed the run's last optimizer step (``loss.item()``, logging, a
    final evaluation); dropped, with a note that counts its records"""


class StepRule:
    """The step boundaries of one Dumper: fed the events, it says whether each ends a step.

    Each event method returns True when the step open at that moment ends there; the caller
    then writes it and begins the next. `ran_backward` is set by whoever sees a backward record
    (an attribute, not a call: the Dumper sets it on its per-record path)."""

    def __init__(self) -> None:
        self.explicit = False
        """The script called `Dumper.step()`: from then on only its calls end steps."""
        self.ran_backward = False
        """The open step recorded a backward pass (reset when a step begins)."""
        self._optimizer_ends = False
        # an optimizer step (or a skipping scaler) ended a step: they are what end this run's
        # steps, so what follows the last one is not a step of its own
        self._stepped = False
        # an optimizer step ended a step since the last GradScaler.update(): that update then
        # ends nothing

    def begin(self) -> None:
        """A step begins."""
        self.ran_backward = False

    def optimizer_step(self) -> bool:
        """An ``optimizer.step()`` returned (its closure, if any, ran inside it): True where it
        ends the step, that is unless the script calls `Dumper.step()` itself."""
        if self.explicit:
            return False
        self._stepped = self._optimizer_ends = True
        return True

    def scaler_update(self) -> bool:
        """``GradScaler.update()`` begins: True where it ends the step, that is where no
        optimizer step did since the last update (the scaler skipped it) and the script does not
        call `Dumper.step()` itself."""
        stepped, self._stepped = self._stepped, False
        if stepped or self.explicit:
            return False
        self._optimizer_ends = True
        return True

    def explicit_step(self) -> bool:
        """The script called `Dumper.step()`: True where that ends the step. A first call right
        after an optimizer step, with no backward pass since, ends nothing: that optimizer step
        already ended the iteration's step (``opt.step(); d.step()``)."""
        first, self.explicit = not self.explicit, True
        return not (first and self._optimizer_ends and not self.ran_backward)

    def last_step(self, interrupted: str | None = None) -> tuple[LastStep, str | None]:
        """What becomes of the step open when the run ends, and the reason it is interrupted.

        `interrupted`: the reason the run is ending early (an exception, a signal): the step is
        interrupted whatever else holds. Else, where optimizer steps end this run's steps and
        one did: a step that ran backward was cut short before its own optimizer step
        (interrupted), and one that did not is what followed the last optimizer step (dropped).
        Otherwise (explicit steps, or no optimizer step at all) the step is kept."""
        if interrupted is not None:
            return LastStep.INTERRUPTED, interrupted
        if self._optimizer_ends and not self.explicit:
            if self.ran_backward:
                return LastStep.INTERRUPTED, BEFORE_OPTIMIZER_STEP
            return LastStep.DROP, None
        return LastStep.KEEP, None
