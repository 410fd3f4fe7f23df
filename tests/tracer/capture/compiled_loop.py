"""The training loop the compiled-step tests share: steps of a loss, torch's compile warnings
kept out of the test's output, then the dumper closed."""
from __future__ import annotations

import warnings

import torch


def train_steps(loss_of, opt, steps: int, dumper) -> list[float]:
    """`steps` optimizer steps of the loss `loss_of()` makes, then `dumper` (or None) closed;
    the losses."""
    torch.manual_seed(1)
    losses = []
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        for _ in range(steps):
            loss = loss_of()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        if dumper is not None:
            dumper.close()
    return losses
