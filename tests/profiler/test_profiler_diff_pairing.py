"""profiler._diff_pairs pairs an op across runs whose input shapes alone changed (a hidden size of 128
against 1024): one row, its contribution the change in its time, not two rows each blamed for
all of one side's time."""
from __future__ import annotations

import pandas as pd

from profiler._diff_pairs import op_diff

COLS = ["name", "input_shapes", "source", "module", "calls", "cpu_total_us", "cpu_self_us",
        "device_us"]


def _ops(*rows):
    return pd.DataFrame([dict(zip(COLS, r)) for r in rows], columns=COLS)


def test_an_op_whose_shapes_alone_changed_is_one_row():
    a = _ops(("aten::addmm", "[[16,128]]", "net.py:14", "fc1", 8, 80.0, 80.0, 0.0),
             ("aten::relu", "[[16,128]]", "net.py:14", "", 8, 8.0, 8.0, 0.0),
             ("aten::mm", "[[4,4]]", "net.py:20", "", 8, 8.0, 8.0, 0.0),
             ("aten::mm", "[[5,5]]", "net.py:20", "", 8, 8.0, 8.0, 0.0))
    b = _ops(("aten::addmm", "[[16,1024]]", "net.py:14", "fc1", 8, 800.0, 800.0, 0.0),
             ("aten::relu", "[[16,1024]]", "other.py:3", "", 8, 16.0, 16.0, 0.0),
             ("aten::mm", "[[6,6]]", "net.py:20", "", 8, 8.0, 8.0, 0.0),
             ("aten::mm", "[[7,7]]", "net.py:20", "", 8, 8.0, 8.0, 0.0))
    d = op_diff(a, b, 8, 8, stacks=True)
    mm = d[d["name"] == "aten::addmm"]
    assert len(mm) == 1, d
    row = mm.iloc[0]
    assert row["side"] == "both"
    assert (row["input_shapes_a"], row["input_shapes_b"]) == ("[[16,128]]", "[[16,1024]]")
    assert row["delta_us"] == 90.0 and row["from_calls_us"] == 0.0  # 10 -> 100 us a step
    # another line: another call, not this one's new shape
    assert sorted(d[d["name"] == "aten::relu"]["side"]) == ["A only", "B only"]
    # two shapes on each side at one line: the same two calls, paired smallest with smallest,
    # never "in A only" and "in B only"
    mm = d[d["name"] == "aten::mm"].sort_values("input_shapes_a")
    assert list(mm["side"]) == ["both", "both"]
    assert list(zip(mm["input_shapes_a"], mm["input_shapes_b"])) == [("[[4,4]]", "[[6,6]]"),
                                                                     ("[[5,5]]", "[[7,7]]")]
    # three shapes in B against two in A at one line cannot be paired call for call: each
    # side summed into one row found in both, never "in A only" and "in B only"
    c = op_diff(a, _ops(*[("aten::mm", f"[[{k},{k}]]", "net.py:20", "", 8, 8.0, 8.0, 0.0)
                          for k in (6, 7, 8)]), 8, 8, stacks=True)
    mm = c[c["name"] == "aten::mm"]
    assert len(mm) == 1, mm
    row = mm.iloc[0]
    assert row["side"] == "both" and (row["calls_a"], row["calls_b"]) == (2.0, 3.0)
    assert row["input_shapes_a"] == "[[4,4]] + [[5,5]]"
    assert row["input_shapes_b"] == "[[6,6]] + [[7,7]] + [[8,8]]"
    assert row["self_a_us"] == 2.0 and row["self_b_us"] == 3.0
    assert row["from_calls_us"] == 1.0  # one more call a step, at the time of one


def test_without_lines_nothing_ties_the_shapes():
    a = _ops(("aten::addmm", "[[16,128]]", "", "", 8, 80.0, 80.0, 0.0))
    b = _ops(("aten::addmm", "[[16,1024]]", "", "", 8, 800.0, 800.0, 0.0))
    d = op_diff(a, b, 8, 8, stacks=False)
    assert sorted(d["side"]) == ["A only", "B only"]
