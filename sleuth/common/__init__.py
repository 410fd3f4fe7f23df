"""The rules every Sleuth package shares, one module each, so that no two copies drift: run
identity (`_run_identity`) and the user's line (`_user_line`). It imports no other package of
the project and no torch, so any package may import it (docs/architecture.md)."""
from __future__ import annotations

from sleuth.common._run_identity import (RUN_ID_ENV, inherited_run_id, new_run_id,
                                         process_alive, process_start_time, read_run_id,
                                         resolve_run_id)
from sleuth.common._user_line import (INTERNAL, LIBRARY, USER, frame_kind, short_frame_kind,
                                      short_path)

__all__ = ["INTERNAL", "LIBRARY", "RUN_ID_ENV", "USER", "frame_kind", "inherited_run_id",
           "new_run_id", "process_alive", "process_start_time", "read_run_id", "resolve_run_id",
           "short_frame_kind", "short_path"]
