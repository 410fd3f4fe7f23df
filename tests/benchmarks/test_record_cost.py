"""benchmarks/record_cost.py: both writers' records are timed inside training steps."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tracer.storage._stats import kernel_available
from tracer.storage._writer import SyncWriter


def _load():
    where = Path(__file__).resolve().parents[2] / "benchmarks"
    sys.path.insert(0, str(where))  # it imports tracer_overhead beside it
    try:
        spec = importlib.util.spec_from_file_location("record_cost_under_test",
                                                      where / "record_cost.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(where))
    return module


@pytest.mark.skipif(not kernel_available(), reason="the benchmark times the kernel's records")
def test_both_writers_are_timed(tmp_path):
    bench = _load()
    real_add = SyncWriter.add
    result = bench.measure(rounds=1, steps=2, work=tmp_path)
    assert SyncWriter.add is real_add  # the timer is taken off again
    assert result["records_per_step"] == 204  # the tiny preset at module level
    for writer in ("sync", "async"):
        r = result[writer]
        assert r["us_per_record"] > 0 and 0 < r["share_of_step"] < 1
