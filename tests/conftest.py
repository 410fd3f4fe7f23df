"""Shared test fixtures: run the CLI in a subprocess against this source tree."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# Two xdist workers share two cores: torch's intra-op threads would only spin against each
# other (a tiny trainer run costs three times the CPU with two threads a process). Every
# process the tests start inherits this; a test that needs more threads sets them itself.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def run_sleuth(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None,
               timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `python -m sleuth ARGS` from this checkout (not an installed copy)."""
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), full_env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "sleuth", *args], capture_output=True, text=True,
                          env=full_env, cwd=cwd or REPO, timeout=timeout)


@pytest.fixture(scope="session")
def sleuth_cli():
    return run_sleuth


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def free_port():
    """A function returning a TCP port free now, for torchrun's --master_port."""
    return _free_port


# the files that took the most CPU in the suite, longest first (an order, never a skip: a
# file missing here only runs later)
_LONG_FILES = ("docs/test_command_blocks.py", "compat/test_frameworks.py",
               "tracer/analysis/test_fault_zoo.py", "profiler/test_profiler_diff_models.py",
               "sleuth/test_tools_together.py", "sleuth/test_zero_code.py",
               "profiler/test_profiler_diff.py", "trainer/test_trainer_rundir.py",
               "faults/test_fault_files.py")


def _answers_within(work, seconds: float, fifo: Path | None = None) -> tuple[bool, list]:
    """Run `work()` in a thread and wait at most `seconds`: (whether it answered, [its
    result or the exception it raised]). A reader that hangs on a FIFO then fails its test
    instead of stalling the suite: `fifo` gets a writer end that opens and closes, so the
    blocked open lets go and the thread ends."""
    import threading

    answer: list = []

    def run() -> None:
        try:
            answer.append(work())
        except Exception as e:  # noqa: BLE001 - the test asserts what it was
            answer.append(e)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout=seconds)
    waited = worker.is_alive()
    if waited and fifo is not None:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        worker.join()
    return not waited, answer


@pytest.fixture
def answers_within():
    return _answers_within


_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@pytest.fixture(autouse=True)
def _signals_kept():
    """Each test leaves the process's signal handlers and mask as it found them. A process the
    suite starts inherits an ignored or blocked SIGINT (Popen resets neither), and a later test
    in the same worker then sees Ctrl-C do nothing: SIGINT's handler and the mask are put
    back after each test, and a test that changed any of them is named in a warning (a
    library it calls may be the one)."""
    handlers = {s: signal.getsignal(s) for s in _SIGNALS}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    ignored = _ignored_by_the_kernel()
    yield
    changed = [signal.Signals(s).name for s, h in handlers.items() if signal.getsignal(s) != h]
    # a library's C code can ignore SIGINT with sigaction, which Python's own record of the
    # handler never sees: the kernel's is read, and a child started after it would ignore Ctrl-C
    now_ignored = _ignored_by_the_kernel()
    if signal.SIGINT in now_ignored - ignored:
        changed.append("SIGINT (ignored in the kernel, behind Python's back)")
    now = signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    # SIGINT alone is put back (signal.signal sets the kernel's handler too): the tracer's
    # SIGTERM handler stays while a listener it keeps for a dying run (the flight recorder
    # after an interrupted close) still holds it
    if handlers[signal.SIGINT] is not None:
        signal.signal(signal.SIGINT, handlers[signal.SIGINT])
    if now != mask:
        changed.append(f"the blocked signals ({sorted(now)} where {sorted(mask)} was)")
    if changed:
        import warnings
        warnings.warn(f"the test left the handlers of {', '.join(changed)} changed",
                      stacklevel=1)


def _ignored_by_the_kernel() -> set[int]:
    """The signals this process ignores, as the kernel holds them (/proc/self/status SigIgn);
    empty where there is no /proc."""
    try:
        with open("/proc/self/status") as f:
            bits = next(int(line.split()[1], 16) for line in f if line.startswith("SigIgn:"))
    except (OSError, StopIteration, ValueError):
        return set()
    return {n + 1 for n in range(64) if bits >> n & 1}


def pytest_configure(config):
    # xdist orders whole files by their number of tests unless told not to, which puts the
    # docs' one long test last, alone, at the end of the run
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    # a suite started in the background of a shell (`pytest ... &`, nohup) ignores SIGINT, and
    # every process it starts would too: the tests that stop a command with Ctrl-C need what a
    # terminal gives
    if signal.SIGINT in _ignored_by_the_kernel():
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config, items):
    """Files that hold long tests run first, the docs' one-clone walk first of all.

    CI runs the suite in two processes that take whole files (`-n 2 --dist loadfile`) in
    collection order (`pytest_configure` keeps xdist from reordering them); a long file taken
    last runs alone at the end and sets the wall time. Starting the longest files first lets
    the short ones fill in beside them. The order inside a file is kept."""
    tests = Path(__file__).resolve().parent

    def weight(item) -> int:
        try:
            rel = item.path.resolve().relative_to(tests).as_posix()
        except ValueError:
            rel = ""
        if rel in _LONG_FILES:
            return _LONG_FILES.index(rel)
        return len(_LONG_FILES) + (0 if item.get_closest_marker("slow") else 1)

    first = {}
    for item in items:
        first[item.path] = min(first.get(item.path, 10**6), weight(item))
    items.sort(key=lambda item: first[item.path])  # stable: the order inside a file is kept
