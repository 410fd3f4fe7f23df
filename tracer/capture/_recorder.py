"""`Recorder`: what the capture hooks need of the object they record for, `tracer.Dumper`.

The hooks and the dispatch mode call back into the Dumper for every record; the Dumper builds
them. Described here as a Protocol, the hooks depend on these few members instead of on the
Dumper's module, which imports theirs.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from tracer._config import DumpConfig


class Recorder(Protocol):
    """The members of `tracer.Dumper` that capture uses."""

    config: DumpConfig
    capturing: bool
    """True while the hooks of a selected step are installed."""
    _busy: bool
    """True while the Dumper runs its own work on tensors (handing records to the writer,
    the parameter records), which the hooks must not record as the user's."""

    def emit(self, scope: str, module: str, op: str, phase: str, direction: str, index: int,
             call: int, source: str, tensor: torch.Tensor, stable: bool = True,
             version: int | None = None, stats: dict | None = None) -> None:
        """Record one tensor under its record name."""

    def emit_all(self, scope: str, module: str, op: str, phase: str, direction: str,
                 call: int, source: str, tensors: Sequence[torch.Tensor], stable: bool = True,
                 version: int | None = None, first: int = 0, stats: dict | None = None
                 ) -> None:
        """Record several tensors of one call, indexed from `first`."""

    def emit_call(self, name: str, func: object, args: tuple, kwargs: dict) -> None:
        """Record what re-running an op call needs (tracer.capture._calls)."""

    def model_called(self, root: str, args: tuple, kwargs: dict | None) -> None:
        """A top-level call of the model (`root`, its record name) with its arguments: the
        step's batch (tracer.capture._setup)."""

    def forget(self, tensors: list[torch.Tensor]) -> None:
        """These tensors are about to be written in place."""

    def _fail(self, error: Exception) -> None:
        """A hook's own work failed: raise `error` where the config says failures stop the run,
        else switch the dump off with one warning (the hook then returns, and the model's call
        goes on)."""
