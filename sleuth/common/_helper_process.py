"""Starting one of the project's own helper processes (`python -m <module>`).

Not through multiprocessing: spawning would re-import the user's training script in the child,
and forking a process that runs torch's threads is unsafe. The child finds the project where
the parent found it (the checkout's root first on its path), attaches no tool to itself (the
SLEUTH_* variables of a traced run are left out) and runs in a session of its own, so a
Ctrl-C meant for the run does not cut an answer in half; it ends with its input, so it exits
with its parent even when the parent is killed.
"""
from __future__ import annotations

import os
import subprocess
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start_helper(module: str) -> subprocess.Popen:
    """`python -m module` with its stdin and stdout as pipes (bytes). Raises OSError."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
    for key in [k for k in env if k.startswith("SLEUTH_")]:
        del env[key]  # the helper must not attach tools to itself
    return subprocess.Popen([sys.executable, "-m", module], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=env, start_new_session=True)
