"""Ctrl-C under Sleuth: the run stops with one line and exit code 130, never a traceback.

A command of Sleuth's own turns KeyboardInterrupt into `sleuth COMMAND: interrupted` (cli.main).
`sleuth run` has a child to stop as well, and two ways a SIGINT can come:

- from a terminal, where Ctrl-C goes to the whole foreground process group: the child, in that
  group, gets it once directly; Sleuth waits for it to write the step it was in;
- from anything else (`kill -INT`, a job scheduler, a test): there the child runs in a process
  group of its own, so a signal to Sleuth's group reaches the child once, forwarded by Sleuth.

The child is a Python program the user wrote: its KeyboardInterrupt ends it with one line naming
where it stopped (`child_excepthook`), not a traceback through the tools' hooks.
"""
from __future__ import annotations

import os
import sys
from types import TracebackType

# top-level packages whose frames are the tools' (or torch's), not the user's
_TOOL_PACKAGES = {"sleuth", "tracer", "profiler", "irdump", "trainer", "dashboard", "torch"}


def in_terminal_foreground() -> bool:
    """Whether this process's group is the foreground group of the terminal on stdin, so a
    Ctrl-C there reaches every process of the group, a child too."""
    try:
        return os.isatty(0) and os.tcgetpgrp(0) == os.getpgrp()
    except OSError:
        return False


def exit_code(returncode: int) -> int:
    """A child's exit status as a shell gives it: 128 + N for a child ended by signal N
    (`subprocess` gives -N, which `sys.exit` would turn into 256 - N)."""
    return 128 - returncode if returncode < 0 else returncode


def _user_frame(tb: TracebackType | None) -> str:
    """`file:line` of the innermost frame outside the tools and torch, where the run stopped."""
    where = ""
    while tb is not None:
        name = str(tb.tb_frame.f_globals.get("__name__", ""))
        if name.split(".")[0] not in _TOOL_PACKAGES:
            where = f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}"
        tb = tb.tb_next
    return where


def child_excepthook(previous=sys.excepthook):
    """An excepthook for `sleuth run`'s children: KeyboardInterrupt is one line naming the
    user's line it stopped at; anything else goes to `previous` unchanged."""

    def hook(kind: type[BaseException], value: BaseException,
             tb: TracebackType | None) -> None:
        if not issubclass(kind, KeyboardInterrupt):
            previous(kind, value, tb)
            return
        where = _user_frame(tb)
        print(f"KeyboardInterrupt{' at ' + where if where else ''} (sleuth run: the run was "
              "interrupted)", file=sys.stderr, flush=True)

    return hook
