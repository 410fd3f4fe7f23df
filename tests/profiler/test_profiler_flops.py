"""FLOPs counted from a trace's recorded shapes agree with torch's FlopCounterMode, op by op."""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils.flop_counter import FlopCounterMode

from profiler._flops import count_flops
from profiler._trace import load_trace


class Mixed(nn.Module):
    """Linear (addmm; mm in backward), a convolution, a bmm and an elementwise tail."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, stride=2, padding=1)
        self.fc = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x).flatten(1)  # (2, 4*4*4)
        y = self.fc(h)
        return torch.bmm(y.unsqueeze(2), y.unsqueeze(1)).sum() + nn.functional.silu(y).sum()


def step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).backward()


def test_counts_match_flop_counter_mode(tmp_path):
    torch.manual_seed(0)
    model, x = Mixed(), torch.randn(2, 3, 8, 8)
    with FlopCounterMode(display=False) as mode:
        step(model, x)
    want = {str(k): v for k, v in mode.get_flop_counts()["Global"].items()}
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for i in range(2):
            with record_function(f"ProfilerStep#{i}"):
                step(model, x)
            with record_function("sleuth.tool::summary"):  # a tool's own matmul: not counted
                torch.mm(torch.randn(64, 64), torch.randn(64, 64))
    prof.export_chrome_trace(str(tmp_path / "t.json"))
    got = count_flops(load_trace(tmp_path / "t.json"), [0, 1])
    assert got["flop_counts"] == want and got["flops_unpriced"] == 0
    assert got["flops_per_step"] == mode.get_total_flops() > 0


def test_no_shapes_no_count(tmp_path):
    model, x = Mixed(), torch.randn(2, 3, 8, 8)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
        with record_function("ProfilerStep#0"):
            step(model, x)
    prof.export_chrome_trace(str(tmp_path / "t.json"))
    assert count_flops(load_trace(tmp_path / "t.json"), [0]) == {}
