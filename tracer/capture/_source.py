"""Source location of the code that made a record: ``path/to/file.py:LINE`` of the user's line,
by the rule every Sleuth package shares (`sleuth.common`'s `frame_kind` and `short_path`).
When that line is an installed library's (a Hugging Face model's), the user's call site is kept
as well, as the `caller` of a `Site`, which is the source text itself (a str) with that field.

Hooks run deep inside torch, so this walks ``sys._getframe`` outward. Whether a code object is
"internal" is decided once per code object and cached, and formatted locations are cached per
(code, line), so a call costs a few dictionary look-ups per frame and never ``inspect.stack``.
A walk from inside a module call stops at that call's frame, whose source was walked when the
call began (`user_source`'s ``known_at``): the ops of a deep model's leaf modules walk two or
three frames, not the whole stack.
Hooks that autograd's engine runs in backward (gradient hooks, ops of backward formulas) all
find the same user frame, the one that called ``backward()``, above the engine's entry frame:
that walk is done once per backward pass (graph task) and its result reused. Where the engine
runs the pass in a thread of its own (a CUDA device's), that frame is found in the thread that
called ``backward()``, so a record's source does not depend on the device.
"""
from __future__ import annotations

import os
import sys
import types

from sleuth.common import INTERNAL, LIBRARY, frame_kind, short_path

RECEIVED = "<received from another process>"
"""What `user_source` returns for code that runs while torch rebuilds a tensor another process
sent (torch/multiprocessing/reductions.py: a DataLoader worker's batch): not the user's."""
WRAPPER = "<a parallel wrapper's own work>"
"""What `user_source` returns for code that DistributedDataParallel or FSDP2 runs on its own
account (DDP's construction, buffer broadcast and bookkeeping around each forward; FSDP2's
all-gathers, reduce-scatters and the copies around them): work a single-process run of the
same model does not do, so it is not recorded as the user's."""
# torch/nn/parallel/distributed.py's functions whose ops are the wrapper's own; the wrapped
# module's forward runs from `_run_ddp_forward`, outside them
_WRAPPER_FILE = os.path.join("nn", "parallel", "distributed.py")
_WRAPPER_FUNCTIONS = frozenset({"__init__", "_pre_forward", "_post_forward"})
# FSDP2 (fully_shard): every function in this folder is the wrapper's own (all-gather and its
# copy-in, the views onto the unsharded parameters, reduce-scatter and its chunk_cat, input
# casts); the model's forward is called by the module, never from inside it
_FSDP2_DIR = os.path.join("distributed", "fsdp", "_fully_shard") + os.sep
_TORCH: str | None = None  # torch's folder, once torch is loaded
_RECEIVING: str | None = None  # the path of torch/multiprocessing/reductions.py
# torch.autograd.graph._engine_run_backward's code: what lies above that frame is fixed while
# its graph task runs (None: an older torch without it; every walk then goes to the top)
_ENGINE: types.CodeType | None = None
_graph_task_id = None
_engine_cache: tuple[int, str] = (-1, "")  # (graph task id, its source)
# code -> 0 user code, 1 internal, 2 torch rebuilding a received tensor (RECEIVED),
# 4 DistributedDataParallel's or FSDP2's own work (WRAPPER)
# 8 code installed in a library (site-packages): the source, but not the call site
_internal: dict[types.CodeType, int] = {}
_formatted: dict[tuple[types.CodeType, int], str] = {}
_sited: dict[tuple[str, str], Site] = {}
_LIBRARY = 8


class Site(str):
    """A record's source (``file:line``, the str itself) in an installed library, with the
    user's call site that led there (`caller`, ``""`` where no frame outside libraries ran
    it). A plain str source is its own call site."""

    __slots__ = ("caller",)
    caller: str

    def __reduce__(self) -> tuple:
        return Site._make, (str(self), self.caller)

    @staticmethod
    def _make(source: str, caller: str) -> Site:
        site = Site(source)
        site.caller = caller
        return site


_relpath: dict[str, str] = {}


def _setup() -> None:
    global _TORCH, _ENGINE, _graph_task_id, _RECEIVING
    import torch

    engine = getattr(getattr(torch.autograd, "graph", None), "_engine_run_backward", None)
    _ENGINE = getattr(engine, "__code__", None)
    _graph_task_id = torch._C._current_graph_task_id
    _TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
    _RECEIVING = os.path.join(_TORCH, "multiprocessing", "reductions.py")


def _is_internal(code: types.CodeType) -> int:
    if _TORCH is None:
        _setup()
    assert _TORCH is not None
    kind = frame_kind(code.co_filename)
    flag = int(kind == INTERNAL)
    if kind == INTERNAL:
        absolute = os.path.abspath(code.co_filename)
        if absolute == _RECEIVING:
            flag = 2
        elif absolute.startswith(_TORCH) and (  # torch's own copy
                (code.co_name in _WRAPPER_FUNCTIONS and absolute.endswith(_WRAPPER_FILE))
                or _FSDP2_DIR in absolute):
            flag = 4
    elif kind == LIBRARY:
        flag = _LIBRARY
    _internal[code] = flag
    return flag


def _relative(path: str) -> str:
    rel = _relpath.get(path)
    if rel is None:
        rel = _relpath[path] = short_path(path)
    return rel


def user_source(skip: int = 1, known_at: types.FrameType | None = None,
                known: str = "") -> str:
    """``file:line`` of the innermost user frame above the caller, or ``""`` when there is none,
    `RECEIVED` when torch is rebuilding a tensor received from another process, or `WRAPPER`
    for DistributedDataParallel's or FSDP2's own work.

    ``skip`` frames are skipped first (1 = the caller of this function). ``known_at``: a frame
    of the caller's stack whose walk gave ``known`` (a running module call's, walked when it
    began): a walk that reaches it takes ``known`` instead of walking the frames above it
    again. Those frames wait in their calls while ``known_at`` runs, so the answer is the same.
    """
    try:
        frame = sys._getframe(skip)
    except ValueError:
        # autograd's device threads (CUDA's backward) call a hook from C++ with no Python
        # frame above it: the walk then starts at the top and finds the pass's caller
        frame = None
    return _walk(frame, True, known_at, known)


def _pass_source(engine: types.FrameType | None) -> str:
    """The source of the backward pass this thread runs: the walk above autograd's engine
    frame `engine`, or, where the engine runs the pass in a thread of its own (a CUDA
    device's) and `engine` is None, above that frame in the thread that called
    ``backward()``. Walked once per pass (graph task); ``""`` outside a pass, or where several
    threads are in one at once and which one is this pass's cannot be told."""
    global _engine_cache
    task = _graph_task_id()  # type: ignore[misc]  # set with _ENGINE
    if task != -1 and task == _engine_cache[0]:
        return _engine_cache[1]
    if engine is None:
        if task == -1:
            return ""
        found = []
        for frame in sys._current_frames().values():
            while frame is not None and frame.f_code is not _ENGINE:
                frame = frame.f_back
            if frame is not None:
                found.append(frame)
        engine = found[0] if len(found) == 1 else None
    text = _walk(engine.f_back, False) if engine is not None else ""
    _engine_cache = (task, text)
    return text


def _walk(frame: types.FrameType | None, shortcut: bool,
          known_at: types.FrameType | None = None, known: str = "") -> str:
    internal = _internal
    while frame is not None:
        if frame is known_at:
            return known
        code = frame.f_code
        if code is _ENGINE and shortcut:
            # reached through internal frames only: autograd's engine runs this hook, and the
            # rest of the walk is the same for the whole backward pass (graph task)
            return _pass_source(frame)
        flag = internal.get(code)
        if flag is None:
            flag = _is_internal(code)
        if not flag:
            return _format(code, frame.f_lineno)
        if flag == _LIBRARY:
            return _library_site(_format(code, frame.f_lineno), frame.f_back)
        if flag == 2:
            return RECEIVED
        if flag == 4:
            return WRAPPER
        frame = frame.f_back
    if not shortcut:
        return ""
    # no user frame in this thread: in a backward pass that autograd runs in a thread of its
    # own, the user's frame is in the thread that called backward()
    if _TORCH is None:
        _setup()
    return _pass_source(None) if _ENGINE is not None else ""


def _library_site(source: str, frame: types.FrameType | None) -> str:
    """`source` (a library's line) as a `Site` whose caller is the innermost frame at or above
    `frame` that is neither internal nor a library's; `source` itself when none is."""
    caller = ""
    internal = _internal
    while frame is not None:
        code = frame.f_code
        if code is _ENGINE:
            # above autograd's engine: the frame that called backward(), walked once per pass
            above = _walk(frame, True)
            caller = above.caller if type(above) is Site else above
            if caller in (RECEIVED, WRAPPER):
                caller = ""
            break
        flag = internal.get(code)
        if flag is None:
            flag = _is_internal(code)
        if not flag:
            caller = _format(code, frame.f_lineno)
            break
        frame = frame.f_back
    if not caller:
        return source
    key = (source, caller)
    site = _sited.get(key)
    if site is None:
        site = _sited[key] = Site._make(source, caller)
    return site


def _format(code: types.CodeType, line: int) -> str:
    key = (code, line)
    text = _formatted.get(key)
    if text is None:
        text = _formatted[key] = f"{_relative(code.co_filename)}:{line}"
    return text
