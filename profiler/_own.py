"""The profiler's own tensor work (summary norms and histograms), kept out of the user's step.

Other tools observe the step through Python dispatch modes (the tracer's op level, a user's own
mode): a norm the summary computes while such a mode is pushed would be seen as one of the
user's ops. `own_work` sets every pushed mode aside (torch's `_disable_current_modes`, which
pops them and pushes them back in the same order) and, while a torch profiler runs, marks the
work with a `sleuth.tool::NAME` range, so the profile's tables count it as tool time instead of
the model's. The convention is documented in docs/tracer.md and docs/profiler.md; any tool may
follow it without importing this package.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

TOOL_PREFIX = "sleuth.tool::"
"""Name prefix of the profiler ranges that hold a tool's own work."""


@contextlib.contextmanager
def own_work(tool: str) -> Iterator[None]:
    """Run the body with the Python dispatch modes set aside, marked `sleuth.tool::{tool}`."""
    import torch
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        if torch.autograd.profiler._is_profiler_enabled:
            with torch.profiler.record_function(TOOL_PREFIX + tool):
                yield
        else:
            yield
