"""The dashboard's public API is pinned, and importing it costs nothing."""
from __future__ import annotations

import subprocess
import sys

import dashboard
from dashboard_helpers import REPO


def test_all_is_pinned():
    assert dashboard.__all__ == ["DashboardError", "RunDirError", "UnsafePathError", "create_app", "serve"]
    for name in dashboard.__all__:
        assert getattr(dashboard, name) is not None


def test_import_is_lazy():
    code = ("import sys, dashboard; heavy = [m for m in ('dash', 'pandas', 'plotly', 'torch') "
            "if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_missing_run_dir_is_a_clear_error(tmp_path):
    import pytest

    with pytest.raises(dashboard.RunDirError, match="does not exist"):
        dashboard.create_app([tmp_path / "nope"])
    with pytest.raises(dashboard.RunDirError, match="no run directory"):
        dashboard.create_app([])
