"""benchmarks/ranks_scale.py at its smallest: a real run replicated into 4 ranks, one perturbed;
every engine (in process, local pool, Dask) and check must name the perturbed rank, step and
record, and the JSON keeps its shape."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "ranks_scale.py"


@pytest.mark.slow
def test_smallest_size_names_the_perturbed_rank(tmp_path):
    pytest.importorskip("distributed")
    out = subprocess.run([sys.executable, str(BENCH), "--ranks", "4", "--model", "tiny",
                          "--steps", "2", "--procs", "1", "--workers", "1,2"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads(out.stdout)
    assert set(data["rows"]) == {"diff_w1", "diff_w2", "diff_dask", "check_w1", "check_w2",
                                 "check_dask", "first_nan_w1", "first_nan_w2"}
    planted = data["planted"]
    assert planted["rank"] == 2 and planted["step"] == 1
    for name, row in data["rows"].items():
        assert row["named"] == [planted["rank"], planted["step"], planted["name"]], name
        assert row["right"] and row["exit"] == 1 and row["wall_s"] > 0, name
        assert row["peak_rss_mib"] > 10, name
    assert data["rows"]["diff_w2"]["engine"] == "local (2 processes)"
    assert data["rows"]["diff_dask"]["engine"].startswith("dask ")
    assert data["rows"]["check_w2"]["engine"] == "local (2 processes)"
    assert data["rows"]["check_dask"]["engine"].startswith("dask ")
    assert data["all_right"] and data["ranks"] == 4 and data["records"] > 0
