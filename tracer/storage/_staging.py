"""One record on its way into a step file: its row's identity (`Pending`, what
`Writer._record` takes), and its statistics and snapshot taken now (`take_now`) for the
records that the sync writer, or the async writer's training thread, makes on the spot. What a
record needs is decided once for both writers (`ReuseIndex.stage`); this is how it is taken.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from tracer.storage._format import RecordMeta
from tracer.storage._reuse import Staging, Within
from tracer.storage._sampling import with_sketch
from tracer.storage._snapshot import (StagingPool, StoredBytes, snapshot, snapshot_bytes,
                                      snapshot_stats)
from tracer.storage._stats import decode_packed, device_stats, element_bits, empty_stats, host_stats


class Pending(NamedTuple):
    """What a record's row holds besides its statistics and bytes: `Writer._record` makes the
    row of one `Pending`, in the training thread or in the async writer's."""

    step: int
    seq: int
    meta: RecordMeta
    dtype: torch.dtype
    shape: tuple
    numel: int
    share: list | None = None
    """the reuse holder the record fills or reads (`Plan.share`)"""
    shared: str | Within | None = None
    """where its bytes are when it stores none of its own (`Plan.shared`)"""

    @classmethod
    def of(cls, step: int, seq: int, meta: RecordMeta, t: torch.Tensor,
           staging: Staging) -> Pending:
        """The record of tensor `t`, planned as `staging` says."""
        return cls(step, seq, meta, t.dtype, tuple(t.shape), t.numel(), staging.share,
                   staging.shared)


def take_now(t: torch.Tensor, staging: Staging, stats: dict | None, pool: StagingPool,
             sketch: bool = False) -> tuple[dict | None, Any, Callable[[], None] | None]:
    """(statistics, snapshot, its release) of a record made now, as `staging` asks: nothing
    for a record that reuses an earlier one's; the caller's `stats` and, in tensor/full mode,
    a snapshot of the bytes; or statistics and snapshot taken here."""
    if not staging.measure:
        if staging.copy and not t.is_meta:
            snap, release = snapshot_bytes(t, pool)
            return stats, snap, release
        return stats, None, None
    return _capture_now(t, staging.copy, pool, sketch)


def sketch_layout(t: torch.Tensor) -> tuple | None:
    """What a sketch taken from `t` depends on besides its memory: None for a contiguous
    tensor (its C order is its memory order, whatever its shape), else its shape and strides."""
    return None if t.is_contiguous() else (tuple(t.shape), t.stride())


def needs_own_sketch(t: torch.Tensor) -> bool:
    """Whether a record of `t` that reuses an earlier record's statistics may need a sketch
    of its own (`t` a permutation of that record's memory)."""
    return t.is_cpu and not t.is_contiguous()


def _capture_now(t: torch.Tensor, keep_bytes: bool, pool: StagingPool, sketch: bool = False
                 ) -> tuple[dict | None, torch.Tensor | StoredBytes | None,
                            Callable[[], None] | None]:
    """Sync path: statistics now, and a snapshot when bytes are kept (one host sync on CUDA);
    on a device the `sketch` comes with the statistics (on CPU `Writer._record_tensor` takes it)."""
    if t.is_meta:
        return empty_stats(), None, None
    if t.is_cpu:
        if keep_bytes:
            # statistics taken in the copy's pass where the kernel can, else from the
            # snapshot in _record
            snap, release, stats = snapshot_stats(t, pool)
            return stats, snap, release
        return host_stats(t), None, None
    packed = with_sketch(device_stats(t), t) if sketch else device_stats(t)
    if not t.is_cuda:  # other accelerators: plain blocking copies
        snap = snapshot(t)[0] if keep_bytes else None
        return decode_packed(packed.cpu().tolist(), element_bits(t.dtype)), snap, None
    # CUDA: queue both copies into pinned memory, then wait once
    host_packed = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
    host_packed.copy_(packed, non_blocking=True)
    snap = None
    if keep_bytes:
        src = t.detach().resolve_conj().resolve_neg().contiguous()
        snap = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
        snap.copy_(src, non_blocking=True)
    torch.cuda.current_stream(t.device).synchronize()  # the one host sync of this record
    return decode_packed(host_packed.tolist(), element_bits(t.dtype)), snap, None
