"""sleuth.common's public names, pinned: every package imports them."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import sleuth.common

EXPECTED = ["ConfigError", "FormatError", "INTERNAL", "LIBRARY", "OtherRunError", "RUN_ID_ENV",
            "STRICT_ENV", "SleuthError", "SleuthWarning", "USER", "describe_error", "frame_kind",
            "go_off", "h5_run_id", "inherited_run_id", "lazy_exports", "new_run_id",
            "process_alive", "process_start_time", "read_run_id", "resolve_run_id", "run_files",
            "short_frame_kind", "short_path", "show_one_line", "strict", "warn"]


def test_public_names():
    assert sleuth.common.__all__ == sorted(EXPECTED)
    for name in sleuth.common.__all__:
        assert hasattr(sleuth.common, name)


def test_importing_it_imports_no_torch():
    code = "import sys, sleuth.common; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2]).stdout.strip()
    assert out == "False"
