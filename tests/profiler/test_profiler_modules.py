"""profiler._modules: the line a module's forward is defined at, through a library's wrapper."""
from __future__ import annotations

import functools
import inspect

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
