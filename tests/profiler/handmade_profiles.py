"""Hand-made profiles for `profiler.diff_profiles`: the parts of `profiler.Profile` the diff
reads, built from a few numbers, so that a rule, not a machine's mood, is under test."""
from __future__ import annotations

import pandas as pd


class Profile:
    """The parts of `profiler.Profile` the diff reads: one rank, one op table, no modules."""

    def __init__(self, name: str, steps_us: list[float], ops: list[tuple[str, int, float]]):
        self.name = name
        self.steps = pd.DataFrame({"rank": 0, "window": 0, "step": range(len(steps_us)),
                                   "step_us": steps_us, "data_us": 0.0, "forward_us": 0.0,
                                   "backward_us": 0.0, "optimizer_us": 0.0,
                                   "other_us": steps_us, "comm_us": 0.0, "tools_us": 0.0})
        n = len(steps_us)
        self.ops = pd.DataFrame([{"name": op, "input_shapes": "[[8]]", "module": "",
                                  "source": "", "calls": calls * n, "cpu_self_us": us * n,
                                  "cpu_total_us": us * n, "device_us": 0.0}
                                 for op, calls, us in ops])
        self.modules = pd.DataFrame(columns=["module", "type", "source", "calls",
                                             "forward_self_us", "backward_self_us",
                                             "forward_total_us", "backward_total_us",
                                             "forward_device_us", "backward_device_us"])
        self.memory = pd.DataFrame(columns=["device", "allocated_bytes"])
        self.gpu = pd.DataFrame()
        self.host = pd.DataFrame()
        self.summary = {"ranks": 1}
        self.traces = []


def steps(median: float) -> list[float]:
    return [median * f for f in (0.99, 1.0, 1.01, 0.995, 1.005, 1.0, 0.998, 1.002)]


def with_sites(p: Profile, rows: list[tuple[str, str, str, int, float]]) -> Profile:
    """`p` with an op table of (name, input shapes, source, calls a step, us a step) rows."""
    n = len(p.steps)
    p.ops = pd.DataFrame([{"name": op, "input_shapes": shapes, "module": "", "source": src,
                           "calls": calls * n, "cpu_self_us": us * n, "cpu_total_us": us * n,
                           "device_us": 0.0} for op, shapes, src, calls, us in rows])
    return p
