"""The callback contract: how tools attach to the trainer without the trainer importing them.

The loop calls, in order: `on_run_start`; per step `on_step_begin`, then per micro-batch
`on_after_backward`, then `on_before_optimizer_step`, `on_after_optimizer_step`, `on_step_end`;
`on_eval` after each evaluation; `on_run_end` once, also when the run fails.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass
class TrainState:
    """What a callback sees. Mutated in place by the loop; do not keep references across steps."""

    step: int
    """0-based optimizer step being run."""
    micro_step: int
    """0-based micro-batch within the step."""
    model: torch.nn.Module
    """The unwrapped model (not the DDP wrapper)."""
    optimizer: torch.optim.Optimizer
    """The AdamW optimizer over the trainable parameters."""
    run_dir: Path
    """The run directory (run.json, metrics.jsonl, checkpoints/, and the tools' folders)."""
    rank: int
    """This process's rank (0 without torchrun)."""
    world_size: int
    """Number of processes."""
    config: Any
    """The TrainConfig of the run."""
    example_batch: dict[str, torch.Tensor]
    """A batch dict the model can be called with: `model(**example_batch)`."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Filled at step end: loss, lr, grad_norm, tokens_per_s, step_time_s, tokens."""
    history: list[dict[str, float]] = field(default_factory=list)
    """Every step's metrics (and eval results) of this invocation, in order."""


class Callback:
    """Base class with no-op methods; override the ones you need."""

    def on_run_start(self, state: TrainState) -> None: ...

    def on_step_begin(self, state: TrainState) -> None: ...

    def on_after_backward(self, state: TrainState) -> None: ...

    def on_before_optimizer_step(self, state: TrainState) -> None: ...

    def on_after_optimizer_step(self, state: TrainState) -> None: ...

    def on_step_end(self, state: TrainState) -> None: ...

    def on_eval(self, state: TrainState, metrics: dict[str, float]) -> None: ...

    def on_run_end(self, state: TrainState) -> None: ...


class _CallbackList:
    """Fans each event out to the callbacks in the order they were given."""

    def __init__(self, callbacks: list[Callback]) -> None:
        self.callbacks = callbacks

    def __getattr__(self, event: str):
        def fire(*args: Any) -> None:
            for cb in self.callbacks:
                getattr(cb, event)(*args)
        return fire
