"""Parameter records: each optimizer step's `param`, `grad` and `update` records.

At level module or mix (``"params": true``) every optimizer step of a dumped step makes, per
parameter it steps, in this order: the parameter's value before the step (``param``), the
gradient the optimizer read (``grad``) and the step's change, after minus before (``update``),
named ``{parameter}.optimizer.{call}.{direction}.0``. A step that ends without an optimizer step
(a skipped scaler step, an explicit `Dumper.step()` with no optimizer, a step cut short) gets
its ``param`` and ``grad`` records at its end instead, and no ``update``.

The values before the step are copied when the optimizer step begins, into buffers kept from one
optimizer step to the next (a fresh copy page-faults its memory in every time); where the fused
kernel copies the dtype it measures the copy on the way, and the update is measured from the two
tensors without being made unless its bytes are kept. The kernels are storage's: the Dumper
hands them in (`Kernels`), so capture stays free of storage.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

from tracer.capture._module_hooks import ModuleTracker

# bumps a tensor's version counter after a write torch did not see (the fused kernels')
_increment_version = getattr(getattr(torch.autograd, "graph", None), "increment_version",
                             None) or torch._C._increment_version


class Kernels(NamedTuple):
    """The fused statistics kernels the parameter records use (tracer.storage's)."""

    copy_stats: Callable[[torch.Tensor, torch.Tensor], dict | None]
    """``copy_stats(dst, src)``: copy and measure in one pass, or None where it cannot."""
    difference_stats: Callable[..., dict | None]
    """``difference_stats(a, b, out=None)``: the statistics of ``a - b``, written to ``out``
    when given, or None where it cannot."""
    difference_sketch: Callable[[torch.Tensor, torch.Tensor], Any]
    """``difference_sketch(a, b)``: the sketch of ``a - b`` without making it."""


class ParamRecord(NamedTuple):
    """One parameter record, ready for the writer."""

    name: str
    """the record name, ``fc1.weight.optimizer.0.update.0``"""
    module: str
    """the module that owns the parameter"""
    direction: str
    """``param``, ``grad`` or ``update``"""
    tensor: torch.Tensor
    """its values; with `stats` given and no bytes kept, it stands in for dtype and shape"""
    stats: dict | None
    """its statistics where a fused kernel measured them already (`Writer.add`'s `stats`)"""


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose memory holds `t`'s values on this rank: a DTensor's (FSDP2, tensor
    parallel) local shard, else `t`. The statistics kernels read memory through a data
    pointer, which a tensor subclass does not have."""
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
        return t
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


class ParamRecords:
    """The parameter records of one Dumper: which parameters, their copies before each
    optimizer step, and the records made of them."""

    def __init__(self, tracker: ModuleTracker, kernels: Kernels) -> None:
        self._tracker = tracker
        self._kernels = kernels
        # id(parameter) -> (its copy before this optimizer step, the copy's statistics or None)
        self._snapshots: dict[int, tuple[torch.Tensor, dict | None]] = {}
        # id(parameter) -> the buffer its copy reuses from one optimizer step to the next while
        # steps are dumped; CPU parameters only (see `_snapshot`)
        self._buffers: dict[int, torch.Tensor] = {}
        self.taken = False
        """The open step's records were taken at an optimizer step (none are due at its end)."""

    def begin_step(self) -> None:
        """A dumped step begins: its records are still to be taken."""
        self.taken = False

    def release(self) -> None:
        """Let go of the copy buffers (memory the size of the model) while no step is dumped."""
        self._buffers = {}

    def wanted(self, optimizer: torch.optim.Optimizer | None = None) -> list:
        """(name, owning module, parameter) of each parameter the config selects, in the
        model's order; only those `optimizer` steps when given."""
        entries = self._tracker.param_names()
        if optimizer is not None:
            ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
            entries = [e for e in entries if id(e[2]) in ids]
        return [e for e in entries if self._tracker.wants(e[1])]

    def before_step(self, params: list,
                    same_bytes: Callable[[torch.Tensor, torch.Tensor], None] | None) -> None:
        """Copy `params` ((name, owner, parameter) each) before the optimizer changes them.
        `same_bytes(copy, parameter)`: told that each copy holds its parameter's values now
        (`Writer.same_bytes`), where the writer holds the step open."""
        self._snapshots = {id(p): self._snapshot(p, same_bytes) for _, _, p in params}

    def forget(self) -> None:
        """Drop this optimizer step's copies (their records are taken, or will not be)."""
        self._snapshots.clear()

    def records(self, params: list, call: int, *, with_update: bool, keep_bytes: bool,
                sketch: bool) -> Iterator[ParamRecord]:
        """The param, grad and update records of `params`, in that order per parameter.

        Lazily: a parameter's update is made once its param record has been handed on (where
        bytes are kept, the difference is written into the copy that record held).
        `with_update`: an optimizer step ran (the copies `before_step` took are the before);
        else the records are the parameters as they are, with no update. `keep_bytes`: the
        writer keeps tensor bytes, so the update's values are made. `sketch`: the writer keeps
        a sketch of each record, so an update measured without its values gets its own."""
        prefix = f".optimizer.{call}."
        for name, owner, p in params:
            before, before_stats = (self._snapshots.get(id(p), (None, None)) if with_update
                                    else (None, None))
            value = before if before is not None else local_shard(p.detach())
            yield ParamRecord(f"{name}{prefix}param.0", owner, "param", value, before_stats)
            if p.grad is not None:
                yield ParamRecord(f"{name}{prefix}grad.0", owner, "grad",
                                  local_shard(p.grad.detach()), None)
            if before is None:
                continue
            after = local_shard(p.detach())
            update, stats = self._update(after, before, keep_bytes)
            if stats is not None and not keep_bytes and sketch:
                # `update` is `before` standing in for dtype and shape: its sketch from the two
                stats["sketch"] = self._kernels.difference_sketch(after, before)
            yield ParamRecord(f"{name}{prefix}update.0", owner, "update", update, stats)

    def _snapshot(self, param: torch.Tensor,
                  same_bytes: Callable[[torch.Tensor, torch.Tensor], None] | None
                  ) -> tuple[torch.Tensor, dict | None]:
        """A copy of `param` before the optimizer changes it, and, when the fused kernel made
        the copy, its statistics (the param record's, taken while the bytes are in cache)."""
        p = local_shard(param.detach())
        if not p.is_cpu:  # a side-stream copy of last step's buffer may still be in flight
            snap, stats = p.clone(), None
        else:
            buf = self._buffers.get(id(param))
            if buf is None or (buf.shape, buf.dtype, buf.stride()) != (p.shape, p.dtype,
                                                                        p.stride()):
                buf = self._buffers[id(param)] = torch.empty_like(p)
            stats = self._kernels.copy_stats(buf, p)
            if stats is None:
                snap = buf.copy_(p)
            else:
                _increment_version(buf)  # the kernel wrote it behind torch's back
                snap = buf
        if same_bytes is not None:
            # the param record then shares the bytes of the op record that read the weight
            same_bytes(snap, p)
        return snap, stats

    def _update(self, p: torch.Tensor, before: torch.Tensor, keep_bytes: bool
                ) -> tuple[torch.Tensor, dict | None]:
        """The parameter update `p - before` and, from the fused kernel, its statistics.

        On CPU the difference goes into `before`: its param record is already taken
        (statistics computed, bytes copied in the hook). The kernel reads both tensors once and
        computes the statistics on the way; unless `keep_bytes`, it writes nothing, and
        `before` (unchanged) stands in for the update's dtype and shape only. On a device the
        async writer may still be copying `before` on a side stream, so the update is a new
        tensor there."""
        if not before.is_cpu:
            return p - before, None
        stats = self._kernels.difference_stats(p, before, out=before if keep_bytes else None)
        if stats is None:
            return torch.sub(p, before, out=before), None
        if keep_bytes:
            _increment_version(before)  # the kernel wrote it behind torch's back
        return before, stats
