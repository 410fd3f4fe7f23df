"""Tiny models for the irdump tests (importable by subprocesses through PYTHONPATH)."""
from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.fc(self.ln(x)))


class TinyNet(nn.Module):
    """Two residual blocks and a head: enough structure for clusters, nothing slow."""

    def __init__(self, width: int = 16, out: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(width) for _ in range(2)])
        self.head = nn.Linear(width, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x).softmax(-1)


class Branchy(nn.Module):
    """Data-dependent control flow: torch.export refuses it, the traced call does not."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.a(x)
        return self.b(x) * 2


class Deep(nn.Module):
    """Modules nested `levels` deep, each holding a Linear: for collapsing."""

    def __init__(self, levels: int = 4, width: int = 4) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.inner = Deep(levels - 1, width) if levels > 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.fc(x))
        return self.inner(x) if self.inner is not None else x


def make_tiny() -> TinyNet:
    torch.manual_seed(0)
    return TinyNet()


def make_branchy() -> Branchy:
    torch.manual_seed(0)
    return Branchy()
