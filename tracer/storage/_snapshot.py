"""Snapshots: a CPU copy of a tensor's bytes as they are when it is recorded, that later
in-place changes do not touch, taken into reused buffers (`StagingPool`); where the C kernel
copies the dtype, the copy and the statistics are one pass (`snapshot_stats`). Both writers
snapshot here; `stored_bytes` gives the bytes a step file stores for a snapshot.
"""
from __future__ import annotations

import functools
import threading
from typing import Callable, NamedTuple

import numpy as np
import torch

from tracer.storage._elements import dense_span, memory_span
from tracer.storage._stat_fields import shape_str
from tracer.storage._stats import copy_stats_into


class StagingPool:
    """Reusable host buffers for CPU snapshots.

    A fresh 1 MiB allocation is page-faulted in on every snapshot: copying into it ran at 0.9
    ms/MiB here, into a reused buffer at 0.27. Buffers come in power-of-two sizes from 64 KiB
    (smaller copies are cheap anyway) and go back when their bytes are on disk; at most
    `max_bytes` are kept. Taken in the training thread, returned by whichever thread wrote them.
    """

    MIN_BYTES = 64 << 10

    def __init__(self, max_bytes: int) -> None:
        self._free: dict[int, list[np.ndarray]] = {}
        self._kept = 0
        self._max = max_bytes
        self._lock = threading.Lock()

    def get(self, nbytes: int) -> np.ndarray | None:
        """A uint8 buffer of at least `nbytes`, or None when too small to be worth pooling."""
        if nbytes < self.MIN_BYTES:
            return None
        size = 1 << (nbytes - 1).bit_length()
        with self._lock:
            free = self._free.get(size)
            if free:
                self._kept -= size
                return free.pop()
        return np.empty(size, dtype=np.uint8)

    def put(self, buf: np.ndarray) -> None:
        with self._lock:
            if self._kept + buf.nbytes <= self._max:
                self._free.setdefault(buf.nbytes, []).append(buf)
                self._kept += buf.nbytes


def snapshot(t: torch.Tensor, pool: StagingPool | None = None
             ) -> tuple[torch.Tensor, Callable[[], None] | None]:
    """A CPU copy of `t` that later in-place changes to `t` do not touch, and the callback
    that hands its buffer back to `pool` (None when it did not come from the pool).

    The copy is contiguous, or, when `t` is a transpose or permutation of a dense block, has
    `t`'s strides (a plain memcpy of the block instead of a strided copy; statistics read it in
    the same memory order as `t`, and `stored_bytes` keeps that order, with the strides)."""
    snap, release, _ = snapshot_stats(t, pool, measure=False)
    return snap, release


def snapshot_bytes(t: torch.Tensor, pool: StagingPool | None = None
                   ) -> tuple[torch.Tensor | StoredBytes, Callable[[], None] | None]:
    """`snapshot` for a record whose statistics the caller has (parameter and update records):
    where the C kernel copies this dtype, its copy as `StoredBytes` (the statistics it takes on
    the way are not used), with no tensor made of it and none turned back into bytes by
    `stored_bytes`: 5-13 us a small parameter against 24-37 us."""
    snap, release, _ = snapshot_stats(t, pool)
    return snap, release


_STRIDED = torch.strided


class StoredBytes(NamedTuple):
    """A snapshot already in the form a step file stores (see `stored_bytes`): its bytes in
    memory order, as uint8, and its strides ("" for C order)."""

    data: np.ndarray
    strides: str


def snapshot_stats(t: torch.Tensor, pool: StagingPool | None = None, *, measure: bool = True
                   ) -> tuple[torch.Tensor | StoredBytes, Callable[[], None] | None,
                              dict | None]:
    """`snapshot`, plus the copy's statistics (`host_stats` of it exactly) when `measure` and
    the C kernel copies this dtype (float32, bfloat16, float16 on CPU, one dense span): the
    copy and the statistics are then one pass over memory, taken while the tensor is in cache,
    and the snapshot comes as `StoredBytes` (no tensor is made of it: the statistics were all
    it was needed for besides its bytes). Else the statistics are None (the caller computes
    them from the snapshot, a tensor)."""
    # a plain CPU tensor (the hot path) needs no detach and no resolve: only its memory is read
    if t.layout != _STRIDED or not t.is_cpu or t.is_conj() or t.is_neg():
        t = t.detach()
        if t.layout != _STRIDED:
            t = t.to_dense()
        t = t.resolve_conj().resolve_neg()
        if not t.is_cpu:
            return t.to("cpu", memory_format=torch.contiguous_format), None, None
    n = t.numel()
    if not n:
        return t.detach().clone(memory_format=torch.contiguous_format), None, None
    strides = None
    if not t.is_contiguous():
        if not dense_span(t):
            return t.detach().clone(memory_format=torch.contiguous_format), None, None
        strides = t.stride()
    nbytes = n * t.element_size()
    buf = pool.get(nbytes) if pool is not None else None
    if buf is None:
        dst = np.empty(nbytes, dtype=np.uint8)
        release = None
    else:
        dst = buf[:nbytes]
        release = functools.partial(pool.put, buf)  # type: ignore[union-attr]
    # the span starts at t.data_ptr(): no stride is negative, so element 0 has the lowest
    # address of a dense span
    if measure:
        stats = copy_stats_into(dst, t.data_ptr(), n, t.dtype)
        if stats is not None:
            return StoredBytes(dst, "" if strides is None else shape_str(strides)), release, \
                stats
    # a single-threaded memcpy: torch's parallel copy collapsed (6x slower) when the cores
    # were busy, and the hook runs while training uses them
    np.copyto(dst, memory_span(t).view(torch.uint8).numpy())  # type: ignore[union-attr]
    flat = torch.from_numpy(dst).view(t.dtype)
    if strides is not None:
        return flat.as_strided(t.shape, strides), release, None
    return flat.view(t.shape), release, None


def stored_bytes(c: torch.Tensor) -> tuple[np.ndarray, str]:
    """The bytes to store for a CPU snapshot and their strides: a contiguous tensor's bytes
    (C order, strides ""), a dense permutation's bytes in memory order with its strides
    ("1,256"), anything else copied to C order. Returns (uint8 numpy array, strides)."""
    span = memory_span(c)
    if span is None:
        return c.contiguous().reshape(-1).view(torch.uint8).numpy(), ""
    return span.view(torch.uint8).numpy(), "" if c.is_contiguous() else shape_str(c.stride())
