"""sleuth.common's public names, pinned: every package imports them."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import sleuth.common

EXPECTED = ["ConfigError", "FormatError", "INTERNAL", "LIBRARY", "OtherRunError", "RANK_DIR",
            "RUN_ID_ENV", "STEP_FILE", "STEP_PARTIAL", "STRICT_ENV", "SleuthError",
            "SleuthWarning", "USER", "UntrustedFileError", "atomic_file", "describe_error",
            "frame_kind", "go_off", "h5_run_id", "inherited_run_id", "inside_run",
            "kind_problem", "lazy_exports", "left_open_for_write", "new_run_id", "number_of",
            "numbered", "open_regular", "printable", "process_alive", "process_start_time",
            "read_bounded", "read_run_id", "resolve_run_id", "run_files", "short_frame_kind",
            "short_path", "show_one_line", "start_helper", "strict", "warn"]


def test_public_names():
    assert sleuth.common.__all__ == sorted(EXPECTED)
    for name in sleuth.common.__all__:
        assert hasattr(sleuth.common, name)


def test_importing_it_imports_no_torch():
    code = "import sys, sleuth.common; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2]).stdout.strip()
    assert out == "False"
