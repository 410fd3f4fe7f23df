"""benchmarks/diff_memory.py at its smallest: statistics and tensor dumps, one record of each
perturbed, and every command names it (the memory figures themselves are the benchmark's)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "diff_memory.py"


@pytest.mark.slow
def test_smallest_size_names_the_perturbed_record(tmp_path):
    pytest.importorskip("psutil")
    out = subprocess.run([sys.executable, str(BENCH), "--records", "8000", "--per-step", "1000",
                          "--ranks", "2", "--tensor-gb", "0.0625", "--step-mib", "8",
                          "--dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads(out.stdout)
    assert set(data["cases"]) == {"statistics_small", "statistics", "tensor_small", "tensor"}
    stats = data["cases"]["statistics"]
    assert stats["planted"]["records"] == 8000 and stats["planted"]["ranks"] == 2
    assert set(stats["rows"]) == {"diff", "diff_one_rank", "check_first_nan", "check"}
    assert data["cases"]["tensor"]["planted"]["steps"] == 8
    for case in data["cases"].values():
        for name, row in case["rows"].items():
            assert row["right"] and row["exit"] == 1, (name, row)
            assert row["peak_rss_mib"] > 10 and row["wall_s"] > 0, name
    assert data["all_right"]
    assert not list(tmp_path.glob("sleuth-diff-memory-*"))  # the dumps are removed
