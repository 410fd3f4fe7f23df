"""benchmarks/record_host_cost.py at its smallest size: its JSON and its arithmetic."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path


def _load():
    where = Path(__file__).resolve().parents[2] / "benchmarks" / "record_host_cost.py"
    spec = importlib.util.spec_from_file_location("record_host_cost_under_test", where)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smallest_run_reports_microseconds_a_record_per_level(capsys):
    bench = _load()
    assert bench.main(["--rounds", "1", "--steps", "1", "--layers", "4", "--profile"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["benchmark"] == "record_host_cost" and out["device"] == "cpu"
    for level in ("module", "op"):
        row = out[level]
        assert row["records_per_step"] > 20
        assert row["spread"][0] <= row["us_per_record"] <= row["spread"][1]
        assert set(row["split"]) == {"capture", "writer_add", "step_file"}
        assert row["split"]["writer_add"] > 0 and row["split"]["step_file"] > 0
    assert out["op"]["records_per_step"] > out["module"]["records_per_step"]
    assert out["batch_add_us"] > 0
    for level in ("module", "op"):  # where the time goes, by source file
        shares = out["profile_percent"][level]
        # named by the file under the repository; the Dumper's own share is split over its
        # parts (tracer/_dumper*.py), each too small to be sure of a place in the top 12
        assert 0 < sum(shares.values()) <= 100.5
        assert any(name.startswith("tracer/storage/") for name in shares)
        functions = out["profile_functions"][level]  # and by function: file:line(name)
        assert 0 < sum(functions.values()) <= 100.5
        assert any(name.startswith("tracer/") and name.endswith(")") for name in functions)
