"""Where torch's native profiler (kineto) needs working around: the log lines it prints on the
process's stderr, and the trace path it writes without escaping.

**Log lines.** Every start and stop of a profiling window prints kineto's `USDT: ...
profiler_start` / `profiler_stop` lines (a level that `KINETO_LOG_LEVEL` cannot drop without also
dropping kineto's errors), and the first block freed inside a window that was allocated before it
prints c10's `CPUAllocator ... Memory block of unknown size` warning (`TORCH_CPP_LOG_LEVEL` would
silence every C++ warning of the process, the user's too). Both are written by C++ straight to
file descriptor 2, so `quiet_native_stderr` points fd 2 at a temporary file around the calls that
start and stop a window, then writes back every line but these known ones: real errors (kineto's
`ERROR:` lines, Python warnings, tracebacks) still reach the terminal, only a moment later, and
nothing outside those calls (the user's own output) passes through it. `SLEUTH_DEBUG=1` lets
everything through.

**Trace path.** torch's Chrome exporter writes the output path into the trace unescaped and
kineto renames its temporary file through a path it has parsed again, so a folder name holding
`"` or `\\` gives an invalid trace or none at all. `safe_export_path` gives such a path's trace a
temporary name without those characters, to be moved into place by the caller.
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from profiler._errors import ProfilerError

# what kineto and c10 print on every profiled run, whatever the run does
_NOISE = re.compile(
    rb"^(USDT:.*\] profiler_(start|stop)"
    rb"|STAGE:.*\] Completed Stage: "
    rb"|\[W[^\]]* CPUAllocator\.cpp:\d+\] Memory block of unknown size was allocated before "
    rb"the profiling started)")


def _debug() -> bool:
    return os.environ.get("SLEUTH_DEBUG", "").strip() not in ("", "0")


def drop_noise(data: bytes) -> bytes:
    """`data` (lines written to stderr) without kineto's and c10's routine profiler lines."""
    lines = data.splitlines(keepends=True)
    return b"".join(line for line in lines if not _NOISE.match(line))


@contextlib.contextmanager
def quiet_native_stderr() -> Iterator[None]:
    """Hold what is written to fd 2 inside the block, then write it back without the routine
    profiler lines (`drop_noise`). A no-op where fd 2 cannot be redirected, or with
    SLEUTH_DEBUG=1."""
    if _debug():
        yield
        return
    _flush_stderr()
    try:
        saved = os.dup(2)
    except OSError:  # no fd 2 (a daemon): nothing to quiet
        yield
        return
    held = tempfile.TemporaryFile()
    try:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            _flush_stderr()
            os.dup2(saved, 2)
            held.seek(0)
            kept = drop_noise(held.read())
            if kept:
                _write_all(2, kept)
    finally:
        os.close(saved)
        held.close()


@contextlib.contextmanager
def window_edge(entering_record: bool) -> Iterator[None]:
    """Around a call that starts or stops a profiling window: `quiet_native_stderr`, and when
    the call starts recording, the allocator's once-per-thousand warning spent on a block of
    Sleuth's own (allocated before, freed after), not on the user's first freed tensor."""
    with quiet_native_stderr():
        canary = _allocate_canary() if entering_record else None
        yield
        del canary


def _allocate_canary() -> object:
    import torch

    from profiler._own import own_work

    with own_work("profiler"):  # not an op of the user's step
        return torch.empty(16)


def _flush_stderr() -> None:
    for stream in (sys.stderr, sys.__stderr__):
        with contextlib.suppress(Exception):  # closed or replaced by something without flush
            stream.flush()


def _write_all(fd: int, data: bytes) -> None:
    with contextlib.suppress(OSError):
        while data:
            data = data[os.write(fd, data):]


def needs_safe_path(path: str | os.PathLike[str]) -> bool:
    """Whether torch's exporter would mangle `path`: a quote, a backslash or a control
    character, which it writes into the trace's JSON unescaped."""
    return any(ch in '"\\' or ord(ch) < 0x20 for ch in str(path))


def safe_export_path(path: Path) -> tuple[Path, bool]:
    """Where torch should write the trace meant for `path`: `path` itself when torch handles
    it, else a new temporary file of a safe name (the bool is then True: the caller moves it
    into place, or removes it). ProfilerError when no safe temporary folder exists."""
    if not needs_safe_path(path):
        return path, False
    fd, name = tempfile.mkstemp(prefix="sleuth-trace-", suffix=".json")
    os.close(fd)
    if needs_safe_path(name):
        os.unlink(name)
        raise ProfilerError(f"the run directory {str(path.parent)!r} holds a quote, backslash or "
                            f"control character, which torch's trace exporter cannot write, "
                            f"and so does the temporary folder {tempfile.gettempdir()!r}: pick "
                            "a run directory without them, or set TMPDIR to a plain folder")
    return Path(name), True
