"""Put on PYTHONPATH by `sleuth run` so its child processes attach the tools at start-up.

`sleuth run` cannot rely on the installed .pth file (an editable or PYTHONPATH checkout has
none), but Python imports `sitecustomize` from sys.path in every process, torchrun's workers
included. A user's own sitecustomize further down the path still runs: this one hands over to it.
"""
import importlib.machinery
import importlib.util
import os
import sys

import sleuth._autoattach  # noqa: F401  (installs the after-torch-import hook)
from sleuth._interrupt import child_excepthook

sys.excepthook = child_excepthook(sys.excepthook)  # Ctrl-C: one line, not a traceback


def _chain_user_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_chain_user_sitecustomize()
