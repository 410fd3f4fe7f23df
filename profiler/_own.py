"""Tool work: kept out of the user's step while it runs, and told apart from the model's in a trace.

Other tools observe the step through Python dispatch modes (the tracer's op level, a user's own
mode): a norm the summary computes while such a mode is pushed would be seen as one of the
user's ops. `own_work` sets every pushed mode aside (torch's `_disable_current_modes`, which
pops them and pushes them back in the same order) and, while a torch profiler runs, marks the
work with a `sleuth.tool::NAME` range, so the profile's tables count it as tool time instead of
the model's. The convention is documented in docs/tracer.md and docs/profiler.md; any tool may
follow it without importing this package. `tool_work` finds that work, and the time a Python
dispatch mode (the tracer's op level) adds around each op, in a saved trace.
"""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

TOOL_PREFIX = "sleuth.tool::"
"""Name prefix of the profiler ranges that hold a tool's own work."""


@contextlib.contextmanager
def own_work(tool: str) -> Iterator[None]:
    """Run the body with the Python dispatch modes set aside, marked `sleuth.tool::{tool}`."""
    torch = sys.modules.get("torch")
    if torch is None:  # no torch loaded (a histogram of a numpy array): nothing to set aside
        yield
        return
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        if torch.autograd.profiler._is_profiler_enabled:
            with torch.profiler.record_function(TOOL_PREFIX + tool):
                yield
        else:
            yield


# ---- finding tool work in a saved trace --------------------------------------------------------
DISPATCH_MODE_EVENT = "PythonDispatchMode"
"""torch.profiler's event around a Python dispatch mode's handler; the op it dispatches on is
nested inside it, under the op's own outer event."""


def tool_work(host: list[Any]) -> tuple[set[int], list[tuple[float, float, str]]]:
    """Split tool time from the model's in one thread-nested event list (profiler._trace._Ev).

    Tool work is (1) a `sleuth.tool::NAME` range with everything inside it, and (2) around each
    op that a Python dispatch mode intercepts, everything but the op itself: the mode's handler
    with the work it does (the tracer's statistics) and the op's outer record, which torch
    writes once more around the handler. A dispatch mode is attributed to the tracer when the
    trace holds its `sleuth.tool::tracer` ranges, else to "dispatch mode".

    Returns (ids of the events to leave out of the op table, [(start, end, tool name)] time
    intervals of tool work; they may overlap, e.g. a range opened by an op the mode intercepts).
    """
    tracer = any(ev.name == TOOL_PREFIX + "tracer" for ev in host)
    hidden: set[int] = set()
    pieces: list[tuple[float, float, str]] = []

    def hide(ev: Any) -> None:
        stack = [ev]
        while stack:
            e = stack.pop()
            hidden.add(id(e))
            stack.extend(e.children)

    for ev in sorted(host, key=lambda e: (e.ts, -e.dur)):  # outer events first
        if id(ev) in hidden:
            continue
        if ev.name.startswith(TOOL_PREFIX):
            hide(ev)
            pieces.append((ev.ts, ev.end, ev.name[len(TOOL_PREFIX):]))
        elif ev.name == DISPATCH_MODE_EVENT:
            shell = ev.parent if ev.parent is not None and ev.parent.cat == "cpu_op" else None
            ops = [c for c in ev.children if shell is not None and c.name == shell.name]
            outer = shell if ops else ev
            if outer is shell:
                hidden.add(id(shell))
            hidden.add(id(ev))
            for c in ev.children:
                if c not in ops:
                    hide(c)
            tool = "tracer" if tracer else "dispatch mode"
            start = outer.ts
            for op in sorted(ops, key=lambda c: c.ts):  # the handler's time around the op
                pieces.append((start, op.ts, tool))
                start = op.end
            pieces.append((start, outer.end, tool))
    return hidden, pieces
