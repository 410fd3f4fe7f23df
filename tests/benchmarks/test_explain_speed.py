"""benchmarks/explain_speed.py at its smallest: the tiny preset, one repeat; it prints the ratio
and the verdict (precision: B runs in bf16)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "explain_speed.py"


@pytest.mark.slow
def test_smallest_size_runs_and_says_precision(tmp_path):
    out = subprocess.run([sys.executable, str(BENCH), "--model", "tiny", "--repeat", "1",
                          "--limit", "3"], capture_output=True, text=True, timeout=600,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads(out.stdout)
    assert data["status"] == "precision", data["verdict"]
    assert data["diff_s"] > 0 and data["explain_s"] > 0 and data["ratio"] > 0
    assert data["dump_mib_per_side"] > 0
