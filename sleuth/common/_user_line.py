"""The user's line: which Python frame made something, and how its path is printed.

The dump's records, the profile's ops and the IR's nodes each name the line that made them,
and one op must get one line from all three. A frame is of one of three kinds:

- `INTERNAL`: torch, the standard library (frozen modules too), code torch generates (an FX
  graph module's `<eval_with_key>` forward, Inductor's output code in its cache folder) and
  Sleuth's own tool packages (tracer, profiler, irdump, sleuth, dashboard, this one): never
  the line;
- `LIBRARY`: other installed code (site-packages, dist-packages), such as a Hugging Face
  model's `modeling_*.py`: the line, since the model's own line says more than the
  `trainer.train()` line that led to it, with the innermost `USER` frame beside it as the
  user's call;
- `USER`: everything else, Sleuth's reference trainer too (it is a model, installed or not).

So the line is the innermost frame that is not `INTERNAL`. `short_path` prints a path without
what differs between machines: the trainer's from the folder holding the packages
(`trainer/model.py`), else relative to the current directory when under it, else from its
site-packages folder on (`transformers/models/llama/modeling_llama.py`), else relative to the
`sys.path` entry holding it, as torch's profiler shortens a frame, else as given.

Nothing here is cached by the current directory: callers cache per code object or path.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from functools import lru_cache

INTERNAL, LIBRARY, USER = 0, 1, 2

_TOOLS = ("tracer", "profiler", "irdump", "sleuth", "dashboard")
_USER_PACKAGES = ("trainer",)
# the folder holding Sleuth's packages: the checkout, or site-packages once installed
_PACKAGES_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_LIBRARY_DIRS = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)
_STDLIB = os.path.dirname(os.path.abspath(os.__file__)) + os.sep
_torch_dir: str | None = None


def _roots(packages: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(os.path.join(_PACKAGES_ROOT, p) + os.sep for p in packages)


def _torch() -> str:
    """torch's folder, found without importing torch (the readers run without it)."""
    global _torch_dir
    if _torch_dir is None:
        module = sys.modules.get("torch")
        origin = getattr(module, "__file__", None)
        if origin is None:
            try:
                spec = importlib.util.find_spec("torch")
            except (ImportError, ValueError):
                spec = None
            origin = spec.origin if spec is not None else None
        _torch_dir = os.path.dirname(os.path.abspath(origin)) + os.sep if origin else "\0"
    return _torch_dir


# Inductor writes the code it generates under $TORCHINDUCTOR_CACHE_DIR, by default a folder
# `torchinductor_{user}` in the temporary directory
_INDUCTOR_DIR = os.sep + "torchinductor_"


def _inductor_cache() -> str:
    where = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return os.path.abspath(where) + os.sep if where else ""


def frame_kind(filename: str) -> int:
    """`INTERNAL`, `LIBRARY` or `USER`: the kind of a frame whose code lies in `filename` (a
    code object's `co_filename`)."""
    if filename.startswith("<"):  # no file: frozen modules are Python's, exec'd code the user's
        return INTERNAL if filename.startswith(("<frozen", "<eval_with_key>")) else USER
    path = os.path.abspath(filename)
    if _INDUCTOR_DIR in path or _inductor_cache() and path.startswith(_inductor_cache()):
        return INTERNAL
    if path.startswith(_roots(_USER_PACKAGES)):
        return USER
    if path.startswith(_torch()) or path.startswith(_roots(_TOOLS)):
        return INTERNAL
    library = any(d in path for d in _LIBRARY_DIRS)
    # site-packages may lie inside the standard library's folder (pyenv, python.org and conda
    # installs): a library there is code the user runs, not Python's
    if path.startswith(_STDLIB) and not library:
        return INTERNAL
    return LIBRARY if library else USER


@lru_cache(maxsize=4096)
def short_frame_kind(short: str) -> int:
    """The kind of a frame whose path torch's profiler shortened to what follows its `sys.path`
    entry (`torch/nn/modules/linear.py`, `transformers/...`, `train.py`): judged by where its
    first component imports from in this process."""
    if short.startswith("<") or os.path.isabs(short):
        return frame_kind(short)
    head = short.replace("\\", "/").lstrip("./").split("/")[0]
    module = head[:-3] if head.endswith(".py") else head
    if not module.isidentifier():
        return USER
    if module in _TOOLS:
        return INTERNAL
    if module in _USER_PACKAGES:
        return USER
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return USER
    if spec is None:
        return USER
    if spec.origin in ("built-in", "frozen"):
        return INTERNAL
    where = spec.origin or next(iter(spec.submodule_search_locations or []), "")
    return frame_kind(where) if where else USER


def short_path(filename: str) -> str:
    """`filename` printed the same on every machine (the module's docstring says how)."""
    if filename.startswith("<"):
        return filename
    try:
        path = os.path.abspath(filename)
        cwd = os.getcwd()
    except (OSError, ValueError):  # a deleted cwd: keep the path as given
        return filename
    if path.startswith(_roots(_USER_PACKAGES)):
        return os.path.relpath(path, _PACKAGES_ROOT)
    if path.startswith(cwd + os.sep):
        return os.path.relpath(path, cwd)
    for d in _LIBRARY_DIRS:
        if d in path:
            return path.rpartition(d)[2]
    roots = [os.path.abspath(p) + os.sep for p in sys.path if p and isinstance(p, str)]
    holding = [r for r in roots if path.startswith(r) and r != os.sep]
    return path[len(max(holding, key=len)):] if holding else filename
