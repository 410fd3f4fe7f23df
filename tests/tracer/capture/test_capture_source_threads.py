"""Source lines of hooks autograd runs in a thread of its own. On CUDA, backward runs in the
device's thread, which calls the hook from C++ with no Python frame above it: the record's
source must be the line that called ``backward()`` (what the CPU gives, where the engine runs in
the calling thread), and finding none must never raise into the user's run."""
from __future__ import annotations

import _thread
import threading

import torch

from tracer.capture import _source


def _in_bare_thread(fn) -> list:
    """Run `fn` as the top frame of a new thread (as a device thread runs a hook); its result."""
    out: list = []
    done = threading.Event()

    def top():  # the only Python frame of the thread
        try:
            out.append(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out.append(e)
        done.set()

    _thread.start_new_thread(top, ())
    assert done.wait(30)
    return out


def test_a_hook_with_no_frame_above_it_outside_backward_gets_no_source():
    assert _in_bare_thread(lambda: _source.user_source(3)) == [""]


def test_a_device_thread_hook_gets_the_line_that_called_backward(monkeypatch):
    x = torch.ones(3, requires_grad=True)
    seen: list = []

    def grad_hook(g):
        # the engine's graph task, as a device thread sees it, while this thread waits in it
        task = torch._C._current_graph_task_id()
        monkeypatch.setattr(_source, "_graph_task_id", lambda: task)
        seen.extend(_in_bare_thread(lambda: _source.user_source(3)))
        return g

    _source.user_source()  # the engine's code known before the patch
    monkeypatch.setattr(_source, "_engine_cache", (-1, ""))
    y = x * 2
    y.register_hook(grad_hook)
    y.sum().backward()  # THE BACKWARD LINE
    line = next(i for i, text in enumerate(open(__file__), 1) if "# THE BACKWARD LINE" in text)
    assert len(seen) == 1 and seen[0].endswith(f"test_capture_source_threads.py:{line}")
