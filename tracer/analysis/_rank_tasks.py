"""Where per-rank tasks run: in this process, on a local process pool, or on a Dask
distributed cluster the user names.

A run of many ranks is one dump folder per rank, and the analyses (`diff_ranks`,
`check_ranks`) are one task per rank whose arguments and result are plain data. The task
functions live at module level so a pool or a Dask worker can import them; each task reads its
rank's files where they lie (shared storage on a cluster: paths are made absolute before they
are sent) and returns a summary, never a record table, so the caller's memory grows with the
number of ranks, not with the dump's size.
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any, Callable

from tracer._errors import TracerError

SCHEDULER_ENV = "SLEUTH_DASK_SCHEDULER"
"""Environment variable naming a Dask scheduler address when `scheduler` is not given."""

Progress = Callable[[int, int], None]

SCHEMES = ("tcp", "tls", "inproc", "ucx", "ws", "wss")
"""The address schemes Dask's comms know."""
_ADDRESS = re.compile(r"^(?:(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://)?(?P<rest>[^\s/]+.*)$")


def check_scheduler(address: str) -> str:
    """`address` when it reads as a Dask scheduler address (`tcp://host:8786`, `host:8786`, or
    another scheme Dask knows); TracerError naming the address and the form otherwise, before
    any connection is tried."""
    m = _ADDRESS.match(address.strip())
    scheme = (m.group("scheme") or "tcp").lower() if m else ""
    if m is None or scheme not in SCHEMES or (scheme != "inproc" and not re.match(
            r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+)(:\d{1,5})?/?$", m.group("rest"))):
        why = f"unknown scheme {scheme!r}" if m and scheme not in SCHEMES else \
            "not HOST:PORT"
        raise TracerError(f"Dask scheduler address {address!r}: {why}; give the address "
                          f"`dask scheduler` prints, e.g. tcp://127.0.0.1:8786 (schemes: "
                          f"{', '.join(SCHEMES)}), or drop --scheduler (and "
                          f"${SCHEDULER_ENV}) to use local processes")
    return address.strip()


def run_per_rank(task: Callable[..., dict], ranks: list[int], kwargs: dict[str, Any], *,
                 workers: int | None = None, scheduler: str | None = None,
                 progress: Progress | None = None) -> tuple[list[dict], str]:
    """`task(rank, **kwargs)` for every rank; (results in completion order, engine).

    scheduler (else $SLEUTH_DASK_SCHEDULER) runs the tasks on that Dask cluster; otherwise
    `workers` local processes (0: one per core, at most one per rank), or this process when
    that is one or None. The engine reads "in-process", "local (N processes)" or "dask ADDRESS".

    A process pool starts by importing the caller's main script again, as every Python
    process pool does, so a script that runs its work at import time would run it again in
    each worker: from Python the default is this process, and the command line, whose entry
    point is guarded, asks for one process per core.
    """
    scheduler = scheduler or os.environ.get(SCHEDULER_ENV) or None
    if scheduler:
        scheduler = check_scheduler(scheduler)
        return _on_dask(scheduler, task, ranks, kwargs, progress), f"dask {scheduler}"
    n = min(os.cpu_count() or 1, len(ranks)) if workers == 0 else (workers or 1)
    return _on_pool(n, task, ranks, kwargs, progress)


def rank_path(root: str, rank: int) -> str:
    """The rank's own folder when the dump names its run (dump/dump.json), so that a task
    reads one rank's files instead of probing every rank's (which would make n ranks cost n^2
    file opens); the whole dump otherwise, where the run's files are told apart by the newest
    file of all ranks."""
    from tracer.storage import DUMP_JSON

    d = Path(root) / "dump" if (Path(root) / "dump").is_dir() else Path(root)
    if (d / DUMP_JSON).is_file() and (d / f"rank{rank}").is_dir():
        return str(d / f"rank{rank}")
    return root


def _on_pool(n: int, task: Callable[..., dict], ranks: list[int], kwargs: dict[str, Any],
             progress: Progress | None) -> tuple[list[dict], str]:
    out = []
    if n <= 1 or len(ranks) <= 1:
        for r in ranks:
            out.append(task(r, **kwargs))
            if progress:
                progress(len(out), len(ranks))
        return out, "in-process"
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from concurrent.futures.process import BrokenProcessPool

    # forkserver: a child never inherits this process's open HDF5 handles or threads
    ctx = mp.get_context("forkserver" if sys.platform != "win32" else "spawn")
    try:
        with ProcessPoolExecutor(max_workers=n, mp_context=ctx) as pool:
            futures = [pool.submit(task, r, **kwargs) for r in ranks]
            for f in as_completed(futures):
                out.append(f.result())
                if progress:
                    progress(len(out), len(ranks))
    except BrokenProcessPool as e:
        raise TracerError(
            f"the {n} worker processes for the ranks stopped before they answered ({e}). A "
            "process pool imports the main script again: in a script, make the call under "
            "`if __name__ == \"__main__\":`, or use workers=1 (this process)") from e
    return out, f"local ({n} processes)"


def _on_dask(address: str, task: Callable[..., dict], ranks: list[int],
             kwargs: dict[str, Any], progress: Progress | None) -> list[dict]:
    try:
        from distributed import Client, KilledWorker, as_completed
    except ImportError as e:
        raise TracerError("a Dask scheduler was named but dask.distributed is not installed: "
                          "pip install 'dask[distributed]', or drop --scheduler (and "
                          f"${SCHEDULER_ENV}) to use local processes") from e
    try:
        client = Client(address, timeout=10)
    except (OSError, TimeoutError, ValueError) as e:
        raise TracerError(f"cannot reach the Dask scheduler at {address}: {e}; start one "
                          f"(`dask scheduler`) or drop --scheduler (and ${SCHEDULER_ENV}) to "
                          "use local processes") from e
    out = []
    try:
        futures = {client.submit(task, r, pure=False, **kwargs): r for r in ranks}
        for f in as_completed(futures):
            try:
                out.append(f.result())
            except KilledWorker as e:
                # the scheduler gave up after the task's workers died (allowed-failures times)
                raise TracerError(
                    f"the Dask workers lost rank {futures[f]}'s task: each worker that ran it "
                    f"died ({e}); a worker killed for memory is the usual cause: give the "
                    f"workers more memory (`dask worker --memory-limit`), or drop --scheduler "
                    f"(and ${SCHEDULER_ENV}) to use local processes") from e
            if progress:
                progress(len(out), len(ranks))
    finally:
        client.close()
    return out
