"""The public API of irdump is pinned, and importing it costs nothing."""
from __future__ import annotations

import subprocess
import sys

import irdump

EXPECTED = [
    "CaptureError", "Graph", "IrDumpError", "IrFormatError", "Node", "Param", "RenderError",
    "TensorType", "attach_from_env", "capture_graphs", "list_graphs", "read_ir", "render_svg",
    "save_graphs", "to_dot", "to_ir", "to_sorted_ir",
]


def test_all_is_pinned_and_sorted():
    assert irdump.__all__ == EXPECTED
    for name in EXPECTED:
        assert getattr(irdump, name) is not None


def test_import_does_not_import_torch_and_env_unset_attaches_nothing():
    code = ("import sys, irdump; assert 'torch' not in sys.modules; "
            "import os; os.environ.pop('SLEUTH_SAVE_GRAPHS', None); "
            "assert irdump.attach_from_env() is None; print('ok')")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(__import__("pathlib").Path(
        irdump.__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
