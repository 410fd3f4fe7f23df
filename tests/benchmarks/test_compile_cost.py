"""benchmarks/compile_cost.py at its smallest size: its JSON and its arithmetic."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

WHERE = Path(__file__).resolve().parents[2] / "benchmarks" / "compile_cost.py"


@pytest.mark.slow
def test_smallest_run_reports_every_condition(capsys):
    pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("compile_cost_under_test", WHERE)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--rounds", "1", "--steps", "1", "--backend", "aot_eager",
                       "--size", "tiny"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["benchmark"] == "compile_cost" and out["step_ms"] > 0
    assert set(out["conditions"]) == set(bench.CONDITIONS)
    for row in out["conditions"].values():
        lo, hi = row["spread"]
        assert lo == hi == row["ratio"] > 0  # one round: its one ratio
