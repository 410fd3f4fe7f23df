"""Parameter records (tracer.capture.ParamRecords) made without a Dumper or a writer: their
order and names, the update's values and statistics, the copy buffers kept between optimizer
steps, and the parameters one optimizer steps."""
from __future__ import annotations

import types

import pytest
import torch
from models import MLP

from tracer import DumpConfig
from tracer.capture import Kernels, ModuleTracker, ParamRecords
from tracer.storage import copy_stats, difference_sketch, difference_stats
from tracer.storage._stats import host_stats

KERNELS = Kernels(copy_stats, difference_stats, difference_sketch)


def _records(config: dict | None = None, model=None):
    model = model or MLP()
    tracker = ModuleTracker(types.SimpleNamespace(config=DumpConfig.from_dict(config or {})),
                            model)
    return model, ParamRecords(tracker, KERNELS)


def _optimizer_step(model, params: ParamRecords, opt, keep_bytes: bool, sketch: bool = False):
    """Before and after one SGD step, as the Dumper's optimizer hooks call it; returns the
    records with each tensor cloned as the writer would have read it when handed on."""
    model(torch.randn(2, 8)).pow(2).sum().backward()
    wanted = params.wanted(opt)
    params.before_step(wanted, None)
    opt.step()
    out = [(r, r.tensor.clone()) for r in params.records(wanted, 0, with_update=True,
                                                         keep_bytes=keep_bytes, sketch=sketch)]
    params.forget()
    return out


def test_param_grad_update_per_parameter_in_model_order():
    model, params = _records()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    recs = _optimizer_step(model, params, opt, keep_bytes=True)
    names = [r.name for r, _ in recs]
    assert names[:3] == ["fc1.weight.optimizer.0.param.0", "fc1.weight.optimizer.0.grad.0",
                         "fc1.weight.optimizer.0.update.0"]
    assert len(names) == 3 * len(list(model.parameters()))
    assert {r.module for r, _ in recs} == {"fc1", "fc2"}


def test_update_is_after_minus_before_and_param_the_value_before():
    torch.manual_seed(0)
    model, params = _records()
    before = model.fc1.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    recs = {r.name: (r, t) for r, t in _optimizer_step(model, params, opt, keep_bytes=True)}
    param, param_t = recs["fc1.weight.optimizer.0.param.0"]
    grad, grad_t = recs["fc1.weight.optimizer.0.grad.0"]
    update, update_t = recs["fc1.weight.optimizer.0.update.0"]
    torch.testing.assert_close(param_t, before)
    torch.testing.assert_close(update_t, model.fc1.weight.detach() - before)
    torch.testing.assert_close(update_t, -0.1 * grad_t)
    for r, t in (param, param_t), (update, update_t):
        if r.stats is not None:  # the fused kernel measured it: the statistics of its values
            assert r.stats["mean"] == pytest.approx(host_stats(t)["mean"], rel=1e-5, abs=1e-7)
            assert r.stats["norm"] == pytest.approx(host_stats(t)["norm"], rel=1e-5)


def test_statistics_mode_measures_the_update_without_making_it():
    model, params = _records()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.fc1.weight.detach().clone()
    recs = {r.name: r for r, _ in _optimizer_step(model, params, opt, keep_bytes=False,
                                                 sketch=True)}
    update = recs["fc1.weight.optimizer.0.update.0"]
    expected = host_stats(model.fc1.weight.detach() - before)
    if update.stats is None:  # no C kernel: the update is made
        torch.testing.assert_close(update.tensor, model.fc1.weight.detach() - before)
        return
    assert update.tensor.shape == before.shape  # stands in for dtype and shape
    assert update.stats["norm"] == pytest.approx(expected["norm"], rel=1e-5)
    assert update.stats["sketch"] is not None


def test_at_a_step_end_without_an_optimizer_step_param_and_grad_only():
    model, params = _records()
    model(torch.randn(2, 8)).sum().backward()
    recs = list(params.records(params.wanted(), 0, with_update=False, keep_bytes=True,
                               sketch=False))
    assert {r.direction for r in recs} == {"param", "grad"}
    model.zero_grad(set_to_none=True)
    assert {r.direction for r in params.records(params.wanted(), 0, with_update=False,
                                                keep_bytes=True, sketch=False)} == {"param"}


def test_copy_buffers_are_reused_between_optimizer_steps_and_released():
    model, params = _records()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    first = {r.name: r.tensor for r, _ in _optimizer_step(model, params, opt, keep_bytes=False)}
    second = {r.name: r.tensor for r, _ in _optimizer_step(model, params, opt, keep_bytes=False)}
    name = "fc1.weight.optimizer.0.param.0"
    assert second[name].data_ptr() == first[name].data_ptr()  # no fresh memory each step
    params.release()  # no step dumped: the buffers go
    assert params._buffers == {}


def test_only_what_the_optimizer_steps_and_the_config_selects():
    model, params = _records({"modules": ["fc2"]})
    opt = torch.optim.SGD(model.fc1.parameters(), lr=0.1)
    assert params.wanted(opt) == []  # fc1's optimizer, fc2 selected
    assert [n for n, _, _ in params.wanted()] == ["fc2.weight", "fc2.bias"]
    told = []
    params.before_step(params.wanted(), lambda copy, p: told.append((copy, p)))
    # each copy holds its parameter's values, and is said to
    assert [p.data_ptr() for _, p in told] == [model.fc2.weight.data_ptr(),
                                               model.fc2.bias.data_ptr()]
    assert all(torch.equal(copy, p) for copy, p in told)
