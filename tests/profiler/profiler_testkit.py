"""A tiny GPT-like model and a training loop with (or without) the trainer's phase labels."""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.profiler import record_function


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(x)


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(layers)])
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def train(steps: int, collector=None, labels: bool = True, seed: int = 0):
    """Run `steps` optimizer steps of TinyGPT on batch (4, 16); returns (model, optimizer)."""
    torch.manual_seed(seed)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 64, (4, 16))
    for _ in range(steps):
        if labels:
            with record_function("sleuth.data"):
                batch = x.clone()
            with record_function("sleuth.forward"):
                loss = nn.functional.cross_entropy(model(batch).flatten(0, 1), batch.flatten())
            with record_function("sleuth.backward"):
                loss.backward()
            with record_function("sleuth.optimizer"):
                opt.step()
                opt.zero_grad()
        else:
            loss = nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
        if collector is not None:
            collector.step()
    return model, opt
