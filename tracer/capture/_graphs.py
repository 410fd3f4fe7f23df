"""CUDA graph capture while a step is dumped: the tracer stays out of the capture.

A capture (``torch.cuda.graph``, ``make_graphed_callables``, torch.compile's
``mode="reduce-overhead"`` outside a dumped step) runs the model's Python once while the
stream only records kernels: no kernel runs, so the tensors the hooks see hold no values yet,
and a device-to-host copy or a wait, which a record's statistics need on the per-record path,
is an error that invalidates the user's capture. A replay runs the recorded kernels and no
Python, so no hook fires: what a record would take there is never seen.

So while the current stream is capturing, every hook of the tracer returns at once: nothing is
recorded or counted (the names of the eager steps around it stay those of a run without the
capture), the optimizer's step inside a capture neither records parameters nor ends the dumped
step, and the capture holds none of the tracer's work. One warning per process says so
(`GRAPH_NOTE`). docs/tracer.md ("CUDA graphs") describes the device-side design that would let a
captured graph carry statistics, and what blocks it.
"""
from __future__ import annotations

from typing import Callable

import torch

from sleuth.common import warn

GRAPH_NOTE = ("a CUDA graph is being captured while a step is dumped: the tracer records "
              "nothing of the capture, and the graph's replays record nothing (a replay runs no "
              "Python); run the steps you dump eagerly (docs/tracer.md, \"CUDA graphs\")")
"""The one line that says what a dump does inside a graph capture, and what to do instead."""


def _stream_check() -> Callable[[], bool]:
    """torch's check of the current stream, a C call that makes no CUDA context; on a build
    without CUDA, `bool` (whose call, also C, answers False): the hooks call it every time."""
    built = getattr(getattr(torch.backends, "cuda", None), "is_built", lambda: False)()
    found = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)
    return found if built and found is not None else bool  # a CPU build's stand-in raises


capturing: Callable[[], bool] = _stream_check()
"""True while the current CUDA stream is being captured into a graph. The hooks call it as
``_graphs.capturing() and told()``: the warning's Python runs only inside a capture."""
_told = False


def told() -> bool:
    """Warn once per process that the tracer stays out of a capture (`GRAPH_NOTE`); True."""
    global _told
    if not _told:
        _told = True
        warn(GRAPH_NOTE, stacklevel=3)
    return True


def in_graph_capture() -> bool:
    """True while the current CUDA stream is being captured into a graph (and then warns once
    per process, `GRAPH_NOTE`); False on a machine or build without CUDA."""
    return bool(capturing()) and told()
