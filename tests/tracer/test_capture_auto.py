"""`"op_capture": "auto"`, the default: which capture a Dumper takes, and what the files say.

At level module the observer's records are the Python path's (test_capture_observer_modules),
so auto takes the observer where it is built and nothing rules it out; at op and mix it keeps
the dispatch mode, whose records differ from the observer's on a few ops by design.
"""
from __future__ import annotations

import json

import pytest
import torch

import tracer
from models import MLP, observer_built, train_and_dump
from tracer import _op_observer
from tracer._config import DumpConfig
from tracer._dumper import resolve_capture

needs_observer = pytest.mark.skipif(not observer_built(),
                                    reason="tracer._observer is not built here")


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: False)


def _capture_in_file(path) -> str:
    dump = tracer.open_dump(path)
    return json.loads(dump.attrs(0, 0)["config"])["op_capture"]


def test_auto_is_the_default_and_explicit_choices_stay():
    assert DumpConfig().op_capture == "auto"
    for choice in ("dispatch", "observer"):
        assert resolve_capture(DumpConfig(op_capture=choice)) == choice
        assert resolve_capture(DumpConfig(level="op", op_capture=choice)) == choice


@needs_observer
def test_auto_takes_the_observer_at_level_module(tmp_path, no_cuda):
    d = train_and_dump(MLP, lambda: (torch.randn(2, 8),), tmp_path, steps=1, writer="sync")
    assert _capture_in_file(tmp_path) == "observer"
    assert (d.stats(0, 0).phase == "backward").sum() >= 4


@pytest.mark.parametrize("level", ["op", "mix"])
def test_auto_keeps_the_dispatch_mode_where_ops_are_records(tmp_path, no_cuda, level):
    train_and_dump(MLP, lambda: (torch.randn(2, 8),), tmp_path, steps=1, writer="sync",
                   level=level)
    assert _capture_in_file(tmp_path) == "dispatch"


def test_auto_without_the_observer_runs_the_python_path(tmp_path, no_cuda, monkeypatch):
    """Where the observer is not built auto is no error: an explicit "observer" is one."""
    monkeypatch.setattr(_op_observer, "available", lambda: False)
    d = train_and_dump(MLP, lambda: (torch.randn(2, 8),), tmp_path, steps=1, writer="sync")
    assert _capture_in_file(tmp_path) == "dispatch" and len(d.stats(0, 0)) > 10


def test_auto_leaves_cuda_builds_on_the_python_path(monkeypatch):
    """A CUDA build of torch gets the Python path, and the choice does not initialise CUDA
    (the script may still set CUDA_VISIBLE_DEVICES; an initialised CUDA poisons forks)."""
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)

    def no(*a):
        raise AssertionError("the choice must not ask the CUDA driver")

    monkeypatch.setattr(torch.cuda, "is_available", no)
    monkeypatch.setattr(torch.cuda, "device_count", no)
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", no, raising=False)
    assert resolve_capture(DumpConfig()) == "dispatch"


@needs_observer
def test_a_raising_watchpoint_keeps_the_raise_in_the_hook(tmp_path, no_cuda):
    """With `on_hit: raise` auto takes the Python path, which raises in the hook that made
    the record (the observer's rows are watched at the next drain)."""
    cfg = {"path": str(tmp_path), "writer": "sync",
           "watch": [{"condition": "nan_inf", "on_hit": "raise"}]}
    assert resolve_capture(DumpConfig(**cfg)) == "dispatch"
    recorded = {"path": str(tmp_path), "watch": [{"condition": "nan_inf"}]}
    assert resolve_capture(DumpConfig(**recorded)) == "observer"
    model = MLP()
    with pytest.raises(tracer.WatchpointHit, match=r"<root>\.forward\.0\.input\.0"):
        with tracer.Dumper(model, cfg):
            model(torch.full((2, 8), float("nan")))
            raise AssertionError("the forward pass should have raised")


@needs_observer
def test_a_second_dumper_takes_the_python_path(tmp_path, no_cuda):
    """One Dumper at a time holds the observer: auto gives a second one the dispatch path
    (an explicit "observer" is refused), and the observer is free again once it closes."""
    model = MLP()
    first = tracer.Dumper(model, {"path": str(tmp_path / "a")})
    try:
        assert first.config.op_capture == "observer"
        second = tracer.Dumper(model, {"path": str(tmp_path / "b")})
        assert second.config.op_capture == "dispatch"
        second.close()
        with pytest.raises(tracer.ConfigError, match="one Dumper at a time"):
            tracer.Dumper(model, {"path": str(tmp_path / "c"), "op_capture": "observer"})
    finally:
        first.close()
    third = tracer.Dumper(model, {"path": str(tmp_path / "d")})
    assert third.config.op_capture == "observer"
    third.close()


def test_diff_notes_dumps_of_two_op_captures(tmp_path):
    """At level op the two captures record a few ops differently by design: a diff of a run
    of each says so."""
    if not observer_built():
        pytest.skip("tracer._observer is not built here")
    for name, capture in (("a", "dispatch"), ("b", "observer")):
        torch.manual_seed(0)
        train_and_dump(MLP, lambda: (torch.randn(2, 8),), tmp_path / name, steps=1,
                       level="op", op_capture=capture, writer="sync")
    result = tracer.diff(tmp_path / "a", tmp_path / "b")
    assert any("op captures differ: A used dispatch, B observer" in n for n in result.notes)
    same = tracer.diff(tmp_path / "a", tmp_path / "a")
    assert not any("op captures" in n for n in same.notes)
