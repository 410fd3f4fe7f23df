"""One record on its way into a step file: its row's identity (`Pending`, what
`Writer._record` takes), and its statistics and snapshot, taken now (`take_now`) for the
records that the sync writer, or the async writer's training thread, makes on the spot, or
staged for the async writer's thread (`ThreadStager`). What a record needs is decided once for
both writers (`ReuseIndex.stage`); this is how it is taken.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from tracer.storage._device_stats import decode_packed, device_stats, element_bits
from tracer.storage._format import RecordMeta
from tracer.storage._reuse import Within
from tracer.storage._sampling import with_sketch
from tracer.storage._snapshot import (StagingPool, StoredBytes, snapshot, snapshot_bytes,
                                      snapshot_stats)
from tracer.storage._stat_fields import empty_stats
from tracer.storage._stats import host_stats


class Pending(NamedTuple):
    """A record on its way into a step file: what its row holds besides its statistics and
    bytes, and what it still needs (`ReuseIndex.decide`). `Writer._record` makes the row of one
    `Pending`, in the training thread or in the async writer's."""

    step: int
    seq: int
    meta: RecordMeta
    dtype: torch.dtype
    shape: tuple
    numel: int
    share: list | None = None
    """the reuse holder the record fills or reads (`ReuseIndex.plan`)"""
    shared: str | Within | None = None
    """where its bytes are when it stores none of its own (`ReuseIndex.plan`)"""
    measure: bool = False
    """it needs statistics of its own"""
    copy: bool = False
    """it needs a snapshot of its bytes"""


def take_now(t: torch.Tensor, rec: Pending, stats: dict | None, pool: StagingPool,
             sketch: bool = False) -> tuple[dict | None, Any, Callable[[], None] | None]:
    """(statistics, snapshot, its release) of record `rec` of `t`, made now, as it needs:
    nothing for a record that reuses an earlier one's; the caller's `stats` and, in
    tensor/full mode, a snapshot of the bytes; or statistics and snapshot taken here."""
    if not rec.measure:
        if rec.copy and not t.is_meta:
            snap, release = snapshot_bytes(t, pool)
            return stats, snap, release
        return stats, None, None
    return _capture_now(t, rec.copy, pool, sketch)


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
    """Statistics now, and a snapshot when bytes are kept (one host sync on CUDA); on a device
    the `sketch` comes with the statistics (on CPU `Writer._record_tensor` takes it)."""
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


class ThreadStager:
    """What the async writer queues for its thread to make a record of, where the training
    thread does not make it on the spot: the statistics (given, or packed on a CUDA device and
    being copied to the host on a side stream), a snapshot to take them from, or nothing when
    the record reuses one queued earlier. Queue items: ("ready", statistics or None, snapshot or
    None, its release or None), or ("cuda", event, packed statistics on the host, snapshot)."""

    def __init__(self, pool: StagingPool, *, keep_bytes: bool, sketch: bool) -> None:
        self._pool = pool
        self.keep_bytes = keep_bytes
        self.sketch = sketch
        self._streams: dict[torch.device, Any] = {}

    def stage(self, tensor: torch.Tensor, rec: Pending, stats: dict | None
              ) -> tuple[tuple, int, Pending]:
        """(what the writer thread gets to make the record, the bytes it holds, the record) for
        a record that needs the writer thread: its statistics, or a snapshot to take them
        from, or nothing when it reuses a queued record's."""
        if stats is not None:  # not on CPU, in tensor/full mode: the bytes are needed
            if not rec.copy:  # they are queued already (`same_bytes`)
                return ("ready", stats, None, None), 0, rec
            snap, release = snapshot(tensor, self._pool)
            return ("ready", stats, snap, release), snap.nbytes, rec
        if not rec.measure:
            if not (self.sketch and needs_own_sketch(tensor)):
                # the same tensor (or bytes), unchanged, is already queued: no snapshot, and
                # the writer thread takes the statistics (and byte range) that record leaves
                # in `share`
                return ("ready", None, None, None), 0, rec
            # the same memory read in another order (a transpose): the statistics are the
            # same, the sketch is not; a snapshot gives both (without the kernel only)
            staged, nbytes = self._snapshot(tensor)
            return staged, nbytes, rec._replace(share=None)
        if type(rec.shared) is Within:  # its bytes are queued already: statistics only
            return ("ready", host_stats(tensor), None, None), 0, rec
        staged, nbytes = self._snapshot(tensor)
        return staged, nbytes, rec

    def _snapshot(self, t: torch.Tensor) -> tuple[tuple, int]:
        """Snapshot `t` for the writer thread; returns (staged, bytes it holds)."""
        if t.is_meta:
            return ("ready", empty_stats(), None, None), 0
        if t.is_cuda:
            return self._cuda(t)
        snap, release = snapshot(t, self._pool)  # CPU copy, or blocking from an accelerator
        return ("ready", None, snap, release), snap.numel() * snap.element_size()

    def _cuda(self, t: torch.Tensor) -> tuple[tuple, int]:
        """Statistics on the device and, with bytes kept, a copy to pinned memory, both on a
        side stream; the writer thread waits on the copy's event."""
        device = t.device
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        packed = device_stats(t)  # on the current stream, no sync
        if self.sketch:
            packed = with_sketch(packed, t)
        src = t.detach().resolve_conj().resolve_neg()
        if self.keep_bytes:
            src = src.contiguous()
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            host_packed = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host_packed.copy_(packed, non_blocking=True)
            snap = None
            if self.keep_bytes:
                snap = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
                snap.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        # the caching allocator must not hand these blocks out before the copies ran
        packed.record_stream(stream)
        src.record_stream(stream)
        nbytes = snap.numel() * snap.element_size() if snap is not None else 0
        return ("cuda", done, host_packed, snap), nbytes
