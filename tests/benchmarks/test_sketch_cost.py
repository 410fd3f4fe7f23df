"""benchmarks/sketch_cost.py at its smallest size: its JSON and its arithmetic."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

WHERE = Path(__file__).resolve().parents[2] / "benchmarks"


def _load():
    sys.path.insert(0, str(WHERE))  # it imports tracer_ablation and tracer_overhead beside it
    try:
        spec = importlib.util.spec_from_file_location("sketch_cost_under_test",
                                                      WHERE / "sketch_cost.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(WHERE))
    return module


@pytest.mark.slow
def test_smallest_run_reports_cost_and_accuracy(capsys):
    bench = _load()
    assert bench.main(["--rounds", "1", "--steps", "1", "--workloads", "gpt"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["benchmark"] == "sketch_cost" and out["goal_pct"] == 5.0
    for condition in ("module_statistics", "op_statistics"):
        row = out["cost"][condition]["gpt"]
        lo, hi = row["spread"]
        assert lo == hi and abs(row["cost_pct"] - 100 * (lo - 1)) < 0.11  # one round
    acc = out["accuracy"]
    assert acc["records"] > 10
    # 128 of each tensor's elements: the cosine within a few percent, the error within 2x
    assert acc["cosine_abs_error"]["median"] < 0.05
    assert 0.5 < acc["rel_error_ratio"]["median"] < 2
