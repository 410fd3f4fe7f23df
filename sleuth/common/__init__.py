"""The rules every Sleuth package shares, one module each, so that no two copies drift: run
identity (`_run_identity`), the user's line (`_user_line`), the one door to a run's files
(`_door`), the error root and its shared kinds (`_errors`), a tool that fails while it observes
a run (`_going_off`: warn once and go off, or raise under SLEUTH_STRICT=1), the lazy public
face (`_lazy`), starting a helper process of the project's (`_helper_process`) and the names of what each tool writes into a run directory (`run_files`, which
the claim on a directory goes by). It imports no other package of the project and no torch, so
any package may import it (docs/architecture.md)."""
from __future__ import annotations

from sleuth.common._errors import ConfigError, FormatError, OtherRunError, SleuthError
from sleuth.common import _run_files as run_files  # the names of what each tool writes
from sleuth.common._door import (RANK_DIR, STEP_FILE, STEP_PARTIAL, UntrustedFileError,
                                 atomic_file, inside_run, kind_problem, left_open_for_write,
                                 number_of, numbered, open_regular, printable, read_bounded)
from sleuth.common._going_off import (STRICT_ENV, SleuthWarning, describe_error, go_off,
                                      show_one_line, strict, warn)
from sleuth.common._helper_process import start_helper
from sleuth.common._lazy import lazy_exports
from sleuth.common._run_identity import (RUN_ID_ENV, h5_run_id, inherited_run_id, new_run_id,
                                         process_alive, process_start_time, read_run_id,
                                         resolve_run_id)
from sleuth.common._user_line import (INTERNAL, LIBRARY, USER, frame_kind, short_frame_kind,
                                      short_path)

__all__ = ["ConfigError", "FormatError", "INTERNAL", "LIBRARY", "OtherRunError", "RANK_DIR",
           "RUN_ID_ENV", "STEP_FILE", "STEP_PARTIAL", "STRICT_ENV", "SleuthError",
           "SleuthWarning", "USER", "UntrustedFileError", "atomic_file", "describe_error",
           "frame_kind", "go_off", "h5_run_id", "inherited_run_id", "inside_run",
           "kind_problem", "lazy_exports", "left_open_for_write", "new_run_id", "number_of",
           "numbered", "open_regular", "printable", "process_alive", "process_start_time",
           "read_bounded", "read_run_id", "resolve_run_id", "run_files", "short_frame_kind",
           "short_path", "show_one_line", "start_helper", "strict", "warn"]
