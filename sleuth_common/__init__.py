"""The rules every Sleuth package shares, each in one module that the tracer, the profiler, the
IR exporter, the trainer and the command line import, so that no two copies can drift:

- `_run_identity`: how a process finds the id of the run it belongs to (the environment,
  torchrun's rendezvous, the process that spawned the ranks, a fresh one) and how run.json
  names it.

This package imports no other package of the project and no torch (the readers run without it),
so any package may import it. Its face is this module; a test pins `__all__`.
"""
from __future__ import annotations

from sleuth_common._run_identity import (RUN_ID_ENV, inherited_run_id, new_run_id,
                                         process_start_time, read_run_id, resolve_run_id)

__all__ = ["RUN_ID_ENV", "inherited_run_id", "new_run_id", "process_start_time", "read_run_id",
           "resolve_run_id"]
