"""Every benchmark runs at its smallest size and prints its JSON, so none can rot unnoticed.
Each runs as a user runs it (`python3 benchmarks/NAME.py`, from another folder), measuring the
checkout it sits in. (tracer_overhead, record_cost and ranks_scale have smoke tests of their
own.)"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"

CASES = {
    "dashboard_load": (["--steps", "2000", "--repeats", "1"],
                       ["steps", "read_metrics_s", "scalars_figure_s", "points_drawn"]),
    "diff_speed": (["--mb", "8", "--repeat", "1", "--stats-records", "200"],
                   ["diff_s", "diff_over_read", "statistics_diff_s", "status"]),
    "ir_export": (["--rounds", "1"], ["benchmark", "nodes", "capture_plus_formats_over_export"]),
    "profiler_overhead": (["--rounds", "1"], ["ratio_recorded_step", "goal"]),
    "tracer_writer": (["--mib-per-step", "2", "--tensor-kib", "64", "--steps", "1", "--rounds",
                       "1", "--small-records", "50"], ["async_mib_s", "sync_mib_s"]),
    "trainer_step": (["--steps", "3"], ["trainer_step_ms", "trainer_over_hand"]),
}


def test_every_benchmark_has_a_smoke_test():
    own = {p.stem.removeprefix("test_") for p in Path(__file__).parent.glob("test_*.py")}
    names = {p.stem for p in BENCH.glob("*.py")}
    assert names - set(CASES) - own == set()


def _last_json(text: str) -> dict:
    start = text.find("{")
    assert start >= 0, text[-2000:]
    return json.loads(text[start:])


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_benchmark_runs_at_its_smallest_size(name, tmp_path):
    args, keys = CASES[name]
    out = subprocess.run([sys.executable, str(BENCH / f"{name}.py"), *args], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    data = _last_json(out.stdout)
    missing = [k for k in keys if k not in data]
    assert not missing, (missing, sorted(data))
    if name == "diff_speed":  # the two dumps differ in every other record
        assert data["status"] == "diverged"
