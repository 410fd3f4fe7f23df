"""What the diff says it compared: a tensor of no elements has no bytes in any mode, so it
makes a tensor dump's comparison neither statistics nor mixed."""
from __future__ import annotations

import torch
from torch import nn

import tracer
from tracer.analysis import diff


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
