"""Run identity: how a process finds the id of the run it belongs to.

Every file a run writes carries its run id (run.json, the metrics, checkpoints, the dump, the
summary and the profile), and readers never combine files of two runs. The processes of one run
must find the same id without talking to each other, and every tool of one process must find
the same one, so this is the only place that works it out:

1. `$SLEUTH_RUN_ID`, set by `sleuth run`, the trainer (a resumed run: the run it continues),
   zero-code attach, or the user;
2. torchrun's `$TORCHELASTIC_RUN_ID` (its `--rdzv-id`; on one node a fresh one per launch),
   unless it is torchrun's default "none";
3. with more than one rank (as the caller says, $WORLD_SIZE, or an initialized process group),
   the parent process (the torchrun agent, or the process that called `mp.spawn`: one per
   node) by host, pid and start time;
4. else none: `resolve_run_id` then makes a fresh one (`new_run_id`), and a tool that may go
   without one (the profiler, whose windows are then not checked) takes "".
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import socket
import sys
import uuid
from pathlib import Path
from typing import Any

RUN_ID_ENV = "SLEUTH_RUN_ID"
_ELASTIC_ENV = "TORCHELASTIC_RUN_ID"


def process_start_time(pid: int) -> str | None:
    """The start time of process `pid` in clock ticks since boot (Linux /proc), None where
    unknown: with the pid it names a process, as a pid alone may be reused."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: count from its last ')'
    fields = stat[stat.rfind(b")") + 2:].split()
    return fields[19].decode() if len(fields) > 19 else None


def process_alive(pid: int, started: str | None) -> bool:
    """Whether process `pid` of this host, which started at `started` (`process_start_time`;
    None: unknown), may still run: the holder of a lock, checked before it is taken over."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        pass
    now = process_start_time(pid)
    return not (started and now and now != started)


def _several_ranks(world_size: int | None) -> bool:
    """Whether this process is one of several ranks: as its caller says, else as $WORLD_SIZE
    says, else as an initialized process group says (`mp.spawn` sets no $WORLD_SIZE)."""
    if world_size is not None and world_size > 1:
        return True
    world = os.environ.get("WORLD_SIZE", "").strip()
    if world.isdigit():
        return int(world) > 1
    dist = sys.modules.get("torch.distributed")  # never imported here: readers run without torch
    try:
        return bool(dist is not None and dist.is_available() and dist.is_initialized()
                    and dist.get_world_size() > 1)
    except (RuntimeError, ValueError):
        return False


def inherited_run_id(world_size: int | None = None) -> str:
    """The run id this process inherits from how it was launched (steps 1-3 of the module's
    docstring), "" when it inherits none. `world_size`: the run's processes, where the caller
    knows them."""
    value = os.environ.get(RUN_ID_ENV, "").strip()
    if value:
        return value
    elastic = os.environ.get(_ELASTIC_ENV, "").strip()
    if elastic and elastic.lower() != "none":
        return f"torchelastic-{elastic}"
    if _several_ranks(world_size):
        ppid = os.getppid()
        return f"parent-{socket.gethostname()}-{ppid}-{process_start_time(ppid) or 'unknown'}"
    return ""


def resolve_run_id(world_size: int | None = None) -> str:
    """The run id of this process: the inherited one (`inherited_run_id`), else a new one."""
    return inherited_run_id(world_size) or new_run_id()


def new_run_id() -> str:
    """A fresh run id: UTC start time (readable, sorts by start), then a random part."""
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ-") + uuid.uuid4().hex[:12]


def h5_run_id(attrs: Any) -> str:
    """The run id an HDF5 file of a run carries (a step file, a summary): its root attribute
    `run_id`, from `attrs` (the open file's `.attrs`; each reader opens the file by its own
    checks), "" when it has none."""
    value = attrs.get("run_id", "")
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def read_run_id(run_dir: str | os.PathLike[str]) -> str | None:
    """The run id `RUN/run.json` names: None without a readable run.json, "" for one written
    before run ids."""
    from sleuth.common._door import UntrustedFileError, read_bounded

    try:  # through the door: a FIFO named run.json is never waited on, a device never read
        data = json.loads(read_bounded(Path(run_dir) / "run.json", 1 << 20))
    except (OSError, ValueError, RecursionError, UntrustedFileError):
        return None
    run_id = data.get("run_id", "") if isinstance(data, dict) else None
    return run_id if isinstance(run_id, str) else None
