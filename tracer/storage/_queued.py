"""Records whose statistics the kernel's helper thread computes while training goes on.

In statistics mode the writers take each record's statistics in the hook, so the training thread
waits for them. For two kinds of record it need not:

- a module's backward record (level `module`), the gradient autograd hands to a tensor hook.
  Once the hooks have seen it, autograd does not write it again: it accumulates into a gradient
  buffer in place only when nobody else holds it (the queued record does), and the backward
  formulas that consume it make new tensors. The Dumper settles the queue when the backward
  pass ends (an autograd engine callback). Not at level `op`/`mix`: holding gradients changes
  which ops autograd runs (it copies a gradient instead of taking it over), so op records would
  differ from run to run.
- a parameter's gradient at step end (any level): `Dumper._record_params` queues it, measures
  the update meanwhile, and settles the queue before returning to user code.

The Dumper marks such records (`defer`); the writers also settle the queue before a step file is
written. While anything is queued, every later record of the step waits behind it (its
statistics already taken, or taken from an earlier record's), so rows are made and observers
see them in record order, and a record that reuses a queued record's statistics finds them. A
queued tensor whose version counter moved before its statistics were collected was changed in
place (by user code outside autograd's rules): that is warned about once, naming the record.
Queued tensors are held until their statistics are computed; beyond `MAX_QUEUED_BYTES` the hook
waits. Only when torch leaves a core free (`tracer.storage._stats.STATS_THREADS` is 2): otherwise
the helper would compete with torch's own threads. `SLEUTH_DEFER_STATS=0` takes every statistic in
the hook.
"""
from __future__ import annotations

import warnings
from collections import deque
from typing import Any, Callable

import torch

from tracer._config import env_switch
from tracer.storage import _stats
from tracer.storage._format import RecordMeta
from tracer.storage._stats import collect_stats, host_stats, stats_ready, submit_stats

ENABLED = env_switch("SLEUTH_DEFER_STATS")
MIN_ELEMENTS = 1 << 16
"""Smaller tensors are measured in the hook (tracer.storage._fastpath): the kernel there (~16 us for
64K float32) costs less than queueing a record, waiting for it and making its row later
(~10-15 us of Python with the caches a training step leaves)."""
MAX_QUEUED_BYTES = 256 << 20


class QueuedRows:
    """The queue of one writer: records waiting for statistics, in record order."""

    def __init__(self, record: Callable[..., dict | None],
                 deliver: Callable[[dict | None], None]) -> None:
        # the writer's `_record` and `_deliver`, passed in rather than the writer itself, which
        # imports this module
        self._record = record
        self._deliver = deliver
        # (target, step, seq, meta, tensor, version, ticket, stats, share, shared)
        self._entries: deque[tuple] = deque()
        self._bytes = 0
        self._warned = False

    def __bool__(self) -> bool:
        return bool(self._entries)

    @staticmethod
    def wanted(tensor: torch.Tensor) -> bool:
        """True when `submit` would try to queue `tensor`'s statistics (a deferred record that
        is not: its statistics are taken in the hook)."""
        return ENABLED and tensor.is_cpu and tensor.numel() >= MIN_ELEMENTS \
            and _stats.STATS_THREADS >= 2

    @staticmethod
    def submit(tensor: torch.Tensor) -> tuple | None:
        """Queue `tensor`'s statistics if it is worth it; the ticket, or None (measure it now)."""
        if not QueuedRows.wanted(tensor):
            return None
        return submit_stats(tensor)

    def add(self, target: Any, step: int, seq: int, meta: RecordMeta, tensor: torch.Tensor,
            ticket: tuple | None, stats: dict | None, share: list | None,
            shared: str | None) -> None:
        """Queue one record behind the others; `ticket` (from `submit`) or `stats` (taken
        already), or neither when it reuses an earlier record's statistics (`share`)."""
        version = tensor._version if ticket is not None else None
        self._entries.append((target, step, seq, meta, tensor, version, ticket, stats, share,
                              shared))
        if ticket is not None:
            self._bytes += tensor.numel() * tensor.element_size()
            if self._bytes > MAX_QUEUED_BYTES:
                self.settle(block=True)

    def settle(self, block: bool = True) -> None:
        """Make the rows of queued records, in order: all of them (waiting for the helper), or
        with `block` False only those whose statistics are ready. Rows go to the writer's
        `_deliver`; an observer's exception propagates (the rest stay queued)."""
        entries = self._entries
        while entries:
            target, step, seq, meta, tensor, version, ticket, stats, share, shared = entries[0]
            if ticket is not None:
                if not block and not stats_ready(ticket):
                    return
                stats = collect_stats(ticket)
                self._bytes -= tensor.numel() * tensor.element_size()
                if stats is None:  # lost (queued before a fork): measure it here
                    stats = host_stats(tensor)
                elif tensor._version != version:
                    self._warn(meta.name)
            entries.popleft()
            row = self._record(target, step, seq, meta, tensor.dtype, tuple(tensor.shape),
                               tensor.numel(), stats, None, None, share, shared)
            self._deliver(row)

    def drop(self) -> None:
        """Forget every queued record (its step is being dropped); waits for the helper to be
        done with their memory."""
        entries, self._entries = self._entries, deque()
        self._bytes = 0
        for entry in entries:
            if entry[6] is not None:
                collect_stats(entry[6])

    def _warn(self, name: str) -> None:
        if self._warned:
            return
        self._warned = True
        warnings.warn(f"sleuth dump: {name!r} was changed in place after it was recorded, "
                      f"while its statistics were being taken on the helper thread; they may "
                      f"mix old and new values. SLEUTH_DEFER_STATS=0 takes every statistic in "
                      f"the hook", RuntimeWarning, stacklevel=4)
