"""What the diff reads off its rows: the execution order over several steps (each step's
records only B has are placed after the record that precedes them in B in that step: seq counts
from each step's start, so the records without a partner right before a first divergence are
that step's), and what was compared (a tensor of no elements is neither tensor nor statistics).
"""
from __future__ import annotations

import torch
from torch import nn

import tracer
from tracer.analysis import diff
from tracer.analysis._diff_result import _ordered


def _row(step: int, seq: int, b_seq: int, name: str) -> dict:
    verdict = "only_b" if seq < 0 else ("only_a" if b_seq < 0 else "same")
    return {"step": step, "seq": seq, "b_seq": b_seq, "name": name, "verdict": verdict,
            "phase": "forward", "direction": "output"}


def test_records_only_b_has_stay_in_their_own_step_after_their_predecessor():
    # step 0's A made five records B does not before its first paired one
    rows = [*(_row(0, k, -1, f"s0.only_a{k}") for k in range(5)),
            _row(0, 5, 0, "s0.a"), _row(0, 6, 3, "s0.b"), _row(0, -1, 1, "s0.cast.in"),
            _row(0, -1, 2, "s0.cast.out"),
            _row(2, 0, 0, "s2.a"), _row(2, 1, 3, "s2.b"), _row(2, -1, 1, "s2.cast.in"),
            _row(2, -1, 2, "s2.cast.out")]
    order = [r["name"] for r in _ordered(rows)]
    assert order == [*(f"s0.only_a{k}" for k in range(5)), "s0.a", "s0.cast.in", "s0.cast.out", "s0.b",
                     "s2.a", "s2.cast.in", "s2.cast.out", "s2.b"]


class _Cached(nn.Module):
    """A forward that concatenates onto an empty cache (as Hugging Face's DynamicCache
    starts): a tensor of no elements, which has no bytes in any mode."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cache = torch.zeros(x.shape[0], 0, 8)
        return self.fc(torch.cat([cache, x[:, None, :]], dim=1)[:, 0])


def test_a_tensor_dump_with_an_empty_tensor_is_compared_as_tensors(tmp_path):
    for run in ("a", "b"):
        torch.manual_seed(0)
        model = _Cached()
        with tracer.Dumper(model, {"path": str(tmp_path / run), "level": "op",
                                   "mode": "tensor", "writer": "sync"}):
            model(torch.randn(4, 8, generator=torch.Generator().manual_seed(1))).sum().backward()
    res = diff(tmp_path / "a", tmp_path / "b")
    assert res.status == "same" and res.compared == "tensor", (res.compared, res.notes)
    assert "empty" in set(res.records.compared)
