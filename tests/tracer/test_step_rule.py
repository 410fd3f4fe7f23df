"""Where a step ends (tracer._step_rule.StepRule), case by case as docs/tracer.md, "Steps", tells
it. A loop's events go to the rule as the Dumper hands them on; what the dump would hold comes
back: each step's events and status, and what was dropped at close. No torch, no files: the
Dumper's own tests (test_capture_steps.py, test_capture_closure.py, test_capture_interrupted.py)
run the same cases end to end."""
from __future__ import annotations

from tracer._step_rule import BEFORE_OPTIMIZER_STEP, LastStep, StepRule


class Loop:
    """Feeds a loop's events to a StepRule as the Dumper does. `steps`: step number -> (its
    events, its status); a step that recorded nothing writes no file, as in a dump."""

    def __init__(self) -> None:
        self.rule = StepRule()
        self.steps: dict[int, tuple[list[str], str]] = {}
        self.dropped: list[str] = []
        self.step = 0
        self.events: list[str] = []
        self.rule.begin()

    def run(self, events: str) -> Loop:
        """`events`, separated by spaces: `bwd` (a backward pass), `opt.step()`,
        `scaler.update()` (its optimizer step skipped unless one ran since the last update),
        `d.step()`; anything else (`fwd`, `eval`, `.item()`, `log`) is recorded in the open
        step."""
        for event in events.split():
            if event == "opt.step()":
                self.optimizer_step()
            elif event == "scaler.update()":
                self._end_if(self.rule.scaler_update())
                self.events.append(event)  # the scale's own ops begin the next step
            elif event == "d.step()":
                self._end_if(self.rule.explicit_step())
            else:
                if event == "bwd":
                    self.rule.ran_backward = True
                self.events.append(event)
        return self

    def optimizer_step(self, closure: str = "") -> Loop:
        """An ``optimizer.step()``; `closure`: the events a closure passed to it runs inside."""
        for event in closure.split():
            if event == "bwd":
                self.rule.ran_backward = True
            self.events.append(f"closure:{event}")
        self.events.append("opt.step()")  # its parameter records
        self._end_if(self.rule.optimizer_step())
        return self

    def close(self, interrupted: str | None = None) -> Loop:
        how, reason = self.rule.last_step(interrupted)
        if how is LastStep.DROP:
            self.dropped = self.events
        elif self.events:
            self.steps[self.step] = (self.events, "complete" if how is LastStep.KEEP
                                     else f"interrupted: {reason}")
        self.events = []
        return self

    def _end_if(self, ends: bool) -> None:
        if not ends:
            return
        if self.events:
            self.steps[self.step] = (self.events, "complete")
        self.events = []
        self.step += 1
        self.rule.begin()


def events(loop: Loop) -> dict[int, str]:
    return {step: " ".join(evs) for step, (evs, _) in loop.steps.items()}


def statuses(loop: Loop) -> dict[int, str]:
    return {step: status for step, (_, status) in loop.steps.items()}


def test_a_step_begins_after_the_previous_optimizer_step_and_ends_with_its_own():
    """The diagram: what follows a step's optimizer step (its .item(), logging, evaluation)
    opens the next step, so a loop of N optimizer steps writes N steps."""
    loop = Loop()
    for _ in range(3):
        loop.run("fwd bwd clip opt.step() zero_grad .item() log eval")
    loop.close()
    assert events(loop) == {
        0: "fwd bwd clip opt.step()",
        1: "zero_grad .item() log eval fwd bwd clip opt.step()",
        2: "zero_grad .item() log eval fwd bwd clip opt.step()"}
    assert set(statuses(loop).values()) == {"complete"}


def test_what_follows_the_last_optimizer_step_is_not_a_step():
    """After the run's last optimizer step: dropped at close (the Dumper warns and writes a line
    in notes.jsonl), so there are still N steps, not N + 1."""
    loop = Loop().run("fwd bwd opt.step() zero_grad .item() log eval").close()
    assert events(loop) == {0: "fwd bwd opt.step()"}
    assert loop.dropped == ["zero_grad", ".item()", "log", "eval"]


def test_a_run_with_no_optimizer_step_is_step_0_complete():
    """Inference: the whole run is step 0, kept as complete."""
    loop = Loop().run("fwd .item() fwd .item()").close()
    assert events(loop) == {0: "fwd .item() fwd .item()"}
    assert statuses(loop) == {0: "complete"} and loop.dropped == []


def test_a_step_that_ran_backward_but_not_its_optimizer_step_is_interrupted():
    loop = Loop().run("fwd bwd opt.step() fwd bwd").close()
    assert events(loop) == {0: "fwd bwd opt.step()", 1: "fwd bwd"}
    assert statuses(loop) == {0: "complete", 1: f"interrupted: {BEFORE_OPTIMIZER_STEP}"}


def test_an_exception_or_a_signal_marks_the_open_step_interrupted_with_why():
    """Whatever else holds: a forward-only step, or one of a run with no optimizer step."""
    for script in ("fwd bwd opt.step() fwd", "fwd"):
        loop = Loop().run(script).close(interrupted="SIGTERM")
        last = max(loop.steps)
        assert statuses(loop)[last] == "interrupted: SIGTERM" and loop.dropped == []


def test_evaluation_before_the_first_step_is_part_of_step_0():
    loop = Loop().run("eval eval fwd bwd opt.step() fwd bwd opt.step()").close()
    assert events(loop) == {0: "eval eval fwd bwd opt.step()", 1: "fwd bwd opt.step()"}


def test_gradient_accumulation_puts_every_micro_batch_in_its_step():
    loop = Loop()
    for _ in range(2):
        loop.run("fwd bwd fwd bwd fwd bwd opt.step()")
    loop.close()
    assert events(loop) == {0: "fwd bwd fwd bwd fwd bwd opt.step()",
                            1: "fwd bwd fwd bwd fwd bwd opt.step()"}


def test_once_the_script_calls_d_step_only_d_step_ends_steps():
    """Several optimizers (a GAN): each optimizer step inside a step is one more call of
    parameter records, and the step ends at `d.step()`."""
    loop = Loop().run("fwd bwd d.step()")  # no optimizer: evaluation-style steps
    loop.run("fwd bwd opt.step() fwd bwd opt.step() d.step() fwd bwd opt.step()").close()
    assert events(loop) == {0: "fwd bwd", 1: "fwd bwd opt.step() fwd bwd opt.step()",
                            2: "fwd bwd opt.step()"}
    # explicit steps: the open step at close is a step of its own, complete
    assert statuses(loop) == {0: "complete", 1: "complete", 2: "complete"}


def test_a_first_d_step_right_after_an_optimizer_step_ends_nothing_more():
    """``opt.step(); d.step()``: that optimizer step already ended the iteration's step."""
    loop = Loop()
    for _ in range(3):
        loop.run("fwd bwd opt.step() d.step()")
    loop.close()
    assert events(loop) == {0: "fwd bwd opt.step()", 1: "fwd bwd opt.step()",
                            2: "fwd bwd opt.step()"}
    # ... but a first d.step() after a backward pass with no optimizer step ends that step
    loop = Loop().run("fwd bwd opt.step() fwd bwd d.step() fwd").close()
    assert events(loop) == {0: "fwd bwd opt.step()", 1: "fwd bwd", 2: "fwd"}


def test_a_closure_belongs_to_the_step_its_optimizer_step_ends():
    """``optimizer.step(closure)`` (LBFGS, Lightning): the closure's forward and backward run
    inside the optimizer step, each evaluation one more call of the step's records."""
    loop = Loop()
    for _ in range(2):
        loop.optimizer_step(closure="fwd bwd fwd bwd")
    loop.close()
    assert events(loop) == {
        step: "closure:fwd closure:bwd closure:fwd closure:bwd opt.step()" for step in (0, 1)}
    assert loop.dropped == []


def test_a_step_the_grad_scaler_skipped_ends_at_its_update():
    """``scaler.step(opt)`` skipped the optimizer step (Inf/NaN gradients): ``scaler.update()``
    ends the step, so the skipped iteration is a step of its own; after an optimizer step
    that did run, the update ends nothing more and its ops open the next step."""
    loop = Loop()
    loop.run("fwd bwd scaler.update()")  # skipped
    loop.run("fwd bwd opt.step() scaler.update()")  # stepped
    loop.run("fwd bwd scaler.update()")  # skipped again (the run went NaN)
    loop.close()
    assert events(loop) == {0: "fwd bwd", 1: "scaler.update() fwd bwd opt.step()",
                            2: "scaler.update() fwd bwd"}
    assert loop.dropped == ["scaler.update()"]  # the last update's ops: after the last step


def test_once_the_script_calls_d_step_the_scaler_ends_nothing():
    loop = Loop().run("fwd bwd d.step() fwd bwd scaler.update() fwd bwd scaler.update() d.step()")
    loop.close()
    assert events(loop) == {0: "fwd bwd", 1: "fwd bwd scaler.update() fwd bwd scaler.update()"}
