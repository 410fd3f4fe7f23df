"""profiler._modules: the line a module's forward is defined at, through a library's wrapper."""
from __future__ import annotations

import functools
import inspect

import pytest
from torch import nn

from profiler._modules import _forward_line


def _deprecate(fn):
    """A decorator as libraries write them (transformers' deprecate_kwarg, its output
    capturing): functools.wraps around the forward, in the library's own file."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapped


class Attention(nn.Module):
    @_deprecate
    def forward(self, x):
        return x


def test_the_forward_line_is_the_models_not_its_wrappers():
    line = inspect.getsourcelines(Attention.forward.__wrapped__)[1]
    assert _forward_line(Attention()) == f"{__file__}:{line}"
    assert _forward_line(nn.Linear(2, 2)).endswith(f":{inspect.getsourcelines(nn.Linear.forward)[1]}")


@pytest.mark.slow
def test_module_ranges_leave_a_compiled_model_compiled():
    # traced by dynamo, the ranges' record_function and name lookups broke the graph at
    # every module until the recompile limit, and the model ran eagerly
    import torch
    from torch._dynamo.utils import counters

    from profiler._modules import ModuleRanges

    torch._dynamo.reset()
    counters.clear()
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(4)])
    compiled = torch.compile(model, backend="aot_eager")
    ranges = ModuleRanges()
    ranges.install()
    try:
        for _ in range(3):
            compiled(torch.randn(2, 8)).sum().backward()
    finally:
        ranges.remove()
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1
