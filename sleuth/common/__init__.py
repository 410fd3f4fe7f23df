"""The rules every Sleuth package shares, one module each, so that no two copies drift: run
identity (`_run_identity`), the user's line (`_user_line`) and the one door to a run's files
(`_door`). It imports no other package of
the project and no torch, so any package may import it (docs/architecture.md)."""
from __future__ import annotations

from sleuth.common._door import (RANK_DIR, STEP_FILE, STEP_PARTIAL, UntrustedFileError,
                                 atomic_file, inside_run, kind_problem, left_open_for_write,
                                 number_of, numbered, open_regular, printable, read_bounded)
from sleuth.common._run_identity import (RUN_ID_ENV, inherited_run_id, new_run_id,
                                         process_alive, process_start_time, read_run_id,
                                         resolve_run_id)
from sleuth.common._user_line import (INTERNAL, LIBRARY, USER, frame_kind, short_frame_kind,
                                      short_path)

__all__ = ["INTERNAL", "LIBRARY", "RANK_DIR", "RUN_ID_ENV", "STEP_FILE", "STEP_PARTIAL", "USER",
           "UntrustedFileError", "atomic_file", "frame_kind", "inherited_run_id", "inside_run",
           "kind_problem", "left_open_for_write", "new_run_id", "number_of", "numbered", "open_regular", "printable",
           "process_alive", "process_start_time", "read_bounded", "read_run_id",
           "resolve_run_id", "short_frame_kind", "short_path"]
