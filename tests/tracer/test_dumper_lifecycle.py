"""The Dumper's lifecycle (tracer._lifecycle): one state, its transitions written once, an
illegal one an error; and the states a real Dumper goes through in a run, a failure, a crash
while closing and a second close."""
from __future__ import annotations

import pytest
import torch
from models import MLP, FakeWriter
from torch.nn.modules import module as nn_module

import tracer
import tracer._dumper as dumper_module
from tracer._lifecycle import LIVE, Lifecycle

IDLE, CAPTURING, FAILED, OFF, CLOSING, CLOSED = (
    Lifecycle.IDLE, Lifecycle.CAPTURING, Lifecycle.FAILED, Lifecycle.OFF, Lifecycle.CLOSING,
    Lifecycle.CLOSED)


def test_the_legal_paths_of_a_run():
    state = IDLE
    for new in (CAPTURING, IDLE, CAPTURING, FAILED, OFF, CLOSING, CLOSED):
        state = state.to(new)
    assert state is CLOSED
    assert CAPTURING.to(CLOSING, step_open=True) is CLOSING  # close() writes the open step
    assert CAPTURING.to(FAILED, step_open=True) is FAILED  # written or dropped later
    assert IDLE.to(OFF) is OFF  # the writer switched the dump off
    for state in Lifecycle:  # leaving the process is possible from anywhere
        assert state.to(CLOSED) is CLOSED
    assert LIVE == {IDLE, CAPTURING}


@pytest.mark.parametrize("old, new", [(CLOSED, IDLE), (CLOSED, CAPTURING), (OFF, CAPTURING),
                                      (OFF, IDLE), (FAILED, CAPTURING), (FAILED, IDLE),
                                      (CAPTURING, OFF), (CLOSING, IDLE), (CLOSING, FAILED),
                                      (IDLE, IDLE), (CAPTURING, CAPTURING)])
def test_an_illegal_transition_is_an_error(old, new):
    with pytest.raises(AssertionError, match=f"from {old.value} to {new.value}"):
        old.to(new)


@pytest.mark.parametrize("new", [IDLE, OFF])
def test_no_state_without_hooks_keeps_a_step_open(new):
    with pytest.raises(AssertionError, match="with a step open"):
        CAPTURING.to(new, step_open=True) if new is IDLE else FAILED.to(new, step_open=True)


def _step(model, opt):
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    opt.zero_grad()


def test_a_dumper_goes_idle_capturing_idle_closed(tmp_path):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    d = tracer.Dumper(model, {"path": str(tmp_path), "writer": "sync", "steps": "1"})
    assert d.state is IDLE and d.enabled and not d.capturing
    _step(model, opt)
    assert d.state is CAPTURING and d.capturing and nn_module._global_forward_hooks
    _step(model, opt)
    assert d.state is IDLE and not nn_module._global_forward_hooks
    d.close()
    assert d.state is CLOSED and not d.enabled
    d.close()  # safe twice
    d.step()  # after close: counts, installs nothing
    assert d.state is CLOSED and not nn_module._global_forward_hooks
    assert tracer.open_dump(tmp_path).steps(0) == [1]


def test_an_unselected_rank_is_off_from_the_start(tmp_path):
    d = tracer.Dumper(MLP(), {"path": str(tmp_path), "ranks": "1"}, rank=0)
    assert d.state is OFF and not d.enabled
    d.close()
    assert d.state is CLOSED


def test_a_failure_is_failed_then_off_at_the_next_boundary(tmp_path, monkeypatch):
    class Broken(FakeWriter):
        def add(self, meta, tensor, stable=True, version=None, stats=None):
            raise OSError("disk full")

    monkeypatch.delenv("SLEUTH_STRICT", raising=False)
    monkeypatch.setattr(dumper_module, "_make_writer", lambda *a: Broken())
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(tracer.SleuthWarning, match="disk full"):
        d = tracer.Dumper(model, {"path": str(tmp_path), "level": "mix"})
        model(torch.randn(2, 8)).sum().backward()
    # off, but its hooks (and the op mode) stay until the step ends: the failure may have
    # come from inside the op mode's handler
    assert d.state is FAILED and not d.enabled and torch._C._len_torch_dispatch_stack()
    opt.step()
    assert d.state is OFF and not torch._C._len_torch_dispatch_stack()
    d.close()
    assert d.state is CLOSED


def test_a_crash_while_closing_does_not_close_again(tmp_path, monkeypatch):
    """SIGTERM (the crash hooks) arriving while close() writes the last step: the step is
    written once, and close finishes."""
    made = []

    class Crashing(FakeWriter):
        def end_step(self, status_reason=None, *, drop=False):
            made[0][1]._crashed("SIGTERM")  # the signal lands here
            super().end_step(status_reason, drop=drop)

    def make(*args):
        made.append((Crashing(), dumper))
        return made[0][0]

    monkeypatch.setattr(dumper_module, "_make_writer", make)
    model = MLP()
    dumper = tracer.Dumper(model, {"path": str(tmp_path), "writer": "sync"})
    model(torch.randn(2, 8))
    dumper.close()
    writer = made[0][0]
    assert dumper.state is CLOSED and writer.closed
    assert writer.ended == [(0, None, False)]
