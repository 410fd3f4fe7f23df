"""The dump writers' shared API and the synchronous writer.

The capture side (tracer._dumper) calls `begin_step`, `add(meta, tensor)` per record and
`end_step`; it never knows which writer it has. `SyncWriter` does all work in the calling thread
and a step file is complete when `end_step` returns; `AsyncWriter` (tracer.storage._async) only
snapshots and enqueues. Both go through `Writer._record`, so both write the same content.

Records of a step are buffered (rows in a list, tensor bytes in memory or spilled to a side file)
and written once at `end_step`: one `/records` table per step file, see tracer.storage._format.
"""
from __future__ import annotations

import functools
import threading
import weakref
from collections import deque
from pathlib import Path
from typing import Any, Callable, NamedTuple

import numpy as np
import torch

from tracer._config import DumpConfig
from tracer._errors import DumpWriteError, TracerError, warn
from tracer.storage._format import RecordMeta, RecordRow, StepFile, root_attrs, step_path
from tracer.storage._batcher import make_deferred, record_batch
from tracer.storage._layout import stored_extent
from tracer.storage._sampling import sketch_of, with_sketch
from tracer.storage._lock import claim_rank
from tracer.storage._stats import (copy_stats_into, decode_packed, dense_span, device_stats,
                                   dtype_name, element_bits, empty_stats, host_stats, memory_span,
                                   shape_str)


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


def reuse_key(t: torch.Tensor, version: int | None = None) -> tuple[tuple, tuple] | None:
    """(where, state): records whose `where` and `state` are equal hold the same statistics.

    A tensor that the statistics read as one dense span of memory (contiguous, or on CPU a
    transpose/permutation of a dense block, read in memory order: see `_stats._flat`) is found
    by its span, so a view (`aten.view`, `aten.t`, ...) of a tensor recorded earlier reuses its
    statistics; any other by its identity. `state` is the version counter, shared by a tensor
    and all its views and bumped by every in-place op, plus shape and strides for identity
    keys. None for tensors without a version counter (inference mode) or plain storage: those
    are always computed afresh. A conjugate or negative view shares its base's memory but not
    its values, so it is only ever found by identity. `version` replaces `t._version`: a view
    made inside a dispatch mode gets its base's version counter only after the mode returns,
    so the mode passes the base's version (see `Writer.add_view`)."""
    try:
        if t.layout != _STRIDED or t.is_inference() or t.is_meta:
            return None
        v = t._version if version is None else version
        dtype = t.dtype
        # the conjugate bit exists only on complex tensors; the negative bit on real ones
        # only through torch._neg_view, rare enough to test after is_contiguous
        if (t.is_contiguous() or (t.is_cpu and dense_span(t))) and not (
                (dtype.is_complex and t.is_conj()) or t.is_neg()):
            return ("span", t.data_ptr(), t.numel(), dtype, t.device), (v,)
        return ("id", id(t)), (v, t.data_ptr(), dtype, tuple(t.shape), t.stride())
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


SAME_LAYOUT = "="
"""`shared` of a record that is the very tensor of the record it shares bytes with."""

# how many of the step's latest CPU span records a strided tensor's containing span is looked
# for among (see `Writer._within`): a slice is nearly always taken right after its base is made
_RECENT_SPANS = 64


def _storage_of(t: torch.Tensor) -> Any:
    """`t`'s untyped storage (one Python object while any tensor uses it), or None for a
    tensor without one (a wrapper subclass)."""
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _partial(t: torch.Tensor, storage: Any) -> bool:
    """True when dense `t` covers only part of `storage`, its own (a piece of a larger
    tensor)."""
    return bool(t.storage_offset()) or storage.nbytes() > t.numel() * t.element_size()


def span_strides(t: torch.Tensor) -> str:
    """The strides a record of span `t` reads the span's stored bytes with (memory order): ""
    when contiguous, else (on CPU, a dense permutation) its own."""
    strided = not t.is_contiguous() and memory_span(t) is not None
    return shape_str(t.stride()) if strided else ""


class Within(NamedTuple):
    """`shared` of a record whose elements lie inside an earlier record's stored span, in
    tensor/full mode: it stores no bytes and points into that record's (docs/dump-format.md,
    3.0), while its statistics are its own."""

    holder: list
    """the holder of the record whose bytes hold this one's elements (`Writer._reuse`)"""
    delta: int
    """bytes from the start of that record's bytes to this tensor's first element"""
    nbytes: int
    """bytes from this tensor's first element to the end of its last one"""
    strides: str
    """this tensor's element strides over those bytes"""


def stored_bytes(c: torch.Tensor) -> tuple[np.ndarray, str]:
    """The bytes to store for a CPU snapshot and their strides: a contiguous tensor's bytes
    (C order, strides ""), a dense permutation's bytes in memory order with its strides
    ("1,256"), anything else copied to C order. Returns (uint8 numpy array, strides)."""
    span = memory_span(c)
    if span is None:
        return c.contiguous().reshape(-1).view(torch.uint8).numpy(), ""
    return span.view(torch.uint8).numpy(), "" if c.is_contiguous() else shape_str(c.stride())


class Writer:
    """Base of SyncWriter and AsyncWriter: step bookkeeping, rows, observers, error policy."""

    def __init__(self, config: DumpConfig, *, rank: int, world_size: int) -> None:
        self.config = config
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.observers: list[Callable[[dict], None]] = []
        """Called with each record's statistics row (a dict of the /records columns plus
        `step` and `rank`) once it is computed: in the training thread for the sync writer and
        for the async writer's CPU records (with the C kernel built), else in the async
        writer's thread.
        An observer's exception reaches the training thread whatever `on_error` says (from
        the writer thread: at the next add/end_step/close)."""
        self.row_sinks: list[Callable[[tuple, int], None]] = []
        """Called with each record's /records row (a `RecordRow`) and its step, where
        observers would be; no dict is built for them (the flight recorder)."""
        self.keep_bytes = config.mode in ("tensor", "full")
        # statistics mode: each record keeps a sketch (tracer.storage._sketch); with its bytes
        # kept a record needs none
        self.sketch = config.sketch and not self.keep_bytes
        self.run_dir = config.run_dir()
        # one writer per rank, and only into a dump of this run (tracer.storage._lock): taken at the
        # first step, so a writer that never writes claims nothing
        self.run_id = ""
        self._rank_lock: Any = None
        self._config_dict = config.to_dict()
        # as much as the queue may hold: a step's snapshots reuse the previous step's buffers
        # instead of faulting fresh memory in (slow on a VM's first touch)
        self._pool = StagingPool(config.async_max_queued_mb << 20)
        # beyond this many bytes a step's tensor data goes to a side file instead of memory
        self._spill_bytes = max(1 << 20, config.async_max_queued_mb * (1 << 20) // 2)
        self._disabled = False
        self._closed = False
        self._failure = ""  # what failed, once a storage error switched dumping off
        # elements per torch call in host_stats, in blocks (the result is the same for any):
        # one block keeps each kernel single-threaded; parallel reductions were 7x slower, not
        # faster, whenever the cores were busy with anything else. With one torch thread every
        # kernel is single-threaded anyway, and bigger chunks cut the Python work per MiB
        # (which holds the GIL against the training thread) by 2x.
        self._stats_blocks = 8 if torch.get_num_threads() == 1 else 1
        self.files_written: list[Path] = []
        # reuse_key "where" -> (weak reference, "state", holder) of this step's records (the
        # reference: to the storage of a span, to the tensor of an identity key): a
        # tensor recorded again unchanged (an op's output is the next op's input, a
        # module's output the next module's input, a view of either) reuses the first record's
        # statistics, and, when both are contiguous (the same bytes in C order), its stored
        # bytes. The holder, [stats or None, (data_offset, data_nbytes) or None], is filled
        # where the first record is written (the writer thread for async, in queue order).
        self._seen: dict[int, tuple] = {}
        # the `where` of this step's latest CPU span entries, newest last, in tensor/full mode
        # (None otherwise): where a strided slice's elements may already be stored (`_within`)
        self._recent: deque | None = deque(maxlen=_RECENT_SPANS) if self.keep_bytes else None
        # id(snapshot) -> (weak reference, its version, holder, strides) (`same_bytes`)
        self._same: dict[int, tuple] = {}
        self._seq = 0  # the step's next record number (`next_seq`)
        # statistics mode: CUDA records wait in a batch for one multi-tensor launch
        # (tracer.storage._batcher)
        self._deferred = make_deferred(config.mode, config.level, self.sketch)

    # -- API ---------------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        """Start collecting records of optimizer step `step`; an unfinished step is written
        first, marked incomplete."""
        raise NotImplementedError

    def add(self, meta: RecordMeta, tensor: torch.Tensor, stable: bool = True,
            version: int | None = None, stats: dict | None = None) -> None:
        """Record one tensor: statistics always, an exact copy with mode tensor/full.

        `stable` False: the tensor is an argument of an in-place op, whose version counter is
        bumped only after the op ran, so it is neither matched to nor offered for reuse (see
        `Dumper.emit`). `version`: see `add_view`. `stats`: the record's statistics, already
        computed (by a fused kernel that produced the values, see `Dumper._record_params`);
        `tensor` is then a CPU tensor that supplies dtype and shape, and its bytes only with
        mode tensor/full; such a record takes no part in reuse."""
        raise NotImplementedError

    @property
    def next_seq(self) -> int:
        """The `seq` the next record of the step gets."""
        return self._seq

    def add_unstable(self, meta: RecordMeta, tensor: torch.Tensor) -> None:
        """`add` for an input or output of an in-place op (see `add`'s `stable`)."""
        self.add(meta, tensor, stable=False)

    def add_view(self, meta: RecordMeta, tensor: torch.Tensor, version: int) -> None:
        """`add` for the output of a view op seen inside a dispatch mode: torch shares the
        base's version counter with it only after the mode returned, so `version` (the base's)
        stands in for its own until then."""
        self.add(meta, tensor, True, version)

    def forget(self, tensors: list[torch.Tensor]) -> None:
        """Drop what the step knew of these tensors' values: they are being changed by an op
        that may not bump their version counter. Called from the training thread."""
        if self._deferred is not None and self._deferred.pending:
            self.launch_pending()  # measured before they change
        seen = self._seen
        for t in tensors:
            seen.pop(("id", id(t)), None)
            key = reuse_key(t)
            if key is not None:
                seen.pop(key[0], None)

    def launch_pending(self) -> None:
        """Tensors recorded so far may be written in place now (the optimizer steps): launch
        the statistics of the pending batch (tracer.storage._batcher), if any."""
        if self._deferred is not None and self._deferred.pending:
            self._batch_launched(self._deferred.flush())

    def _batch_launched(self, batch: Any) -> None:
        """Keep a flushed batch for its records' writing (each writer its way)."""
        raise NotImplementedError

    def add_hit(self, hit: dict) -> None:
        """Record a watchpoint hit (keys of /hits: seq, name, condition, value, source) in the
        current step's file."""
        raise NotImplementedError

    def add_call(self, seq: int, name: str, spec: str) -> None:
        """Record what re-running an op call needs (/calls: its records' stem `name`, the seq
        of its first record, the JSON `spec`) in the current step's file."""
        raise NotImplementedError

    def end_step(self, status_reason: str | None = None, *, drop: bool = False) -> None:
        """Finish the current step: sync, the file exists on return; async, it is queued.

        `status_reason`: the step was cut short (an exception, a signal, the process exiting):
        its file is written with what it holds, `complete` 0, `status` "interrupted" and this
        reason. `drop`: the step is not a step (records made after the run's last optimizer
        step, see `Dumper.close`): nothing of it is written."""
        raise NotImplementedError

    def flush(self) -> None:
        """Wait until every record added so far is written (a no-op for the sync writer)."""

    def close(self) -> None:
        """Write what is pending, stop, and raise the first error not yet raised. Idempotent."""
        raise NotImplementedError

    @property
    def enabled(self) -> bool:
        """False once an error switched dumping off (on_error='warn') or after close()."""
        return not (self._disabled or self._closed)

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- shared work ---------------------------------------------------------------------------
    def same_bytes(self, snapshot: torch.Tensor, source: torch.Tensor) -> None:
        """`snapshot` is a copy of `source` as `source` is now (a parameter's value before the
        optimizer changes it). In tensor/full mode, where a record of this step stores
        `source`'s memory unchanged (the op that read the weight in forward), the next record
        of `snapshot`, which comes with its statistics (`add`'s `stats`), points at those bytes
        instead of storing the same ones again; without statistics (no kernel), it takes that
        record's too. Forgotten once used, or once `snapshot` is written (its version
        changes)."""
        if self._recent is None:
            return
        holder, hit, kind, _ = self._reuse(source, True, insert=False)
        if hit and kind == "span":
            self._same[id(snapshot)] = (weakref.ref(snapshot), snapshot._version, holder,
                                        span_strides(source))

    def _take_same(self, t: torch.Tensor) -> tuple[list, str] | None:
        """(holder, strides) that `same_bytes` left for this snapshot, once."""
        entry = self._same.pop(id(t), None)
        if entry is None or entry[0]() is not t or entry[1] != t._version:
            return None
        return entry[2], entry[3]

    def _reset_reuse(self) -> None:
        """Forget the step's records (a new step begins)."""
        self._seen.clear()
        self._same.clear()
        if self._recent is not None:
            self._recent.clear()

    def _reuse(self, t: torch.Tensor, stable: bool, version: int | None = None,
               insert: bool = True) -> tuple[list | None, bool, str | None, Any]:
        """(holder, hit, kind, storage): the holder of an earlier identical record's statistics
        and bytes (hit True), or a new empty holder that this record fills (hit False; with
        `insert` False, None and nothing is noted), or None when not reusable. On a hit the
        earlier record's stored bytes are this record's too: a span is always stored in memory
        order, and this record reads it with its own strides (docs/dump-format.md, /tensors).
        `kind`: "span" (found by its memory) or "id" (by identity: on a hit, the same tensor
        object, stored in whatever layout its first record chose), None when not reusable.
        `storage`: `t`'s, for a span key (None otherwise)."""
        key = reuse_key(t, version) if stable else None
        if key is None:
            return None, False, None, None
        where, state = key
        kind = where[0]
        storage = None
        if kind == "span":
            # the storage is alive (a tensor uses it), so the span's memory is still its: the
            # record that made the entry may have died (a saved output, an mm output that
            # _unsafe_view made matmul's result of, a gradient detach()ed into p.grad).
            # Inline, not _storage_of: this runs for every record
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError, TypeError):
                return None, False, None, None
        entry = self._seen.get(where)
        if entry is not None and entry[1] == state:
            owner = entry[0]()
            # for an identity key: the very tensor (its id may have been given to another)
            if owner is (storage if kind == "span" else t):
                return entry[2], True, kind, storage
        if not insert:
            return None, False, kind, storage
        holder: list = [None, None]
        self._seen[where] = (weakref.ref(storage if kind == "span" else t), state, holder)
        if kind == "span" and self._recent is not None and where[4].type == "cpu":
            self._recent.append(where)
        return holder, False, kind, storage

    def _within(self, t: torch.Tensor, version: int | None, own: list | None, storage: Any
                ) -> Within | None:
        """Where an earlier record of this step already stores all of `t`'s elements, `t` a
        strided CPU tensor (a slice, a view of one, an expansion, a dense piece of a larger
        tensor): among the latest CPU span records, one of the same dtype and storage (alive,
        so the memory is still its) whose memory holds `t`'s, at the same version (unchanged
        since). Such a span is stored as its memory, in memory order, so `t` is read from it at
        its own offset with its own strides. `own`: the holder `t`'s record just made, which
        is not a candidate; `storage`: `t`'s, or None when not looked up yet."""
        if not t.is_cpu or t.is_neg() or (t.dtype.is_complex and t.is_conj()):
            return None
        if not t.numel():
            return None
        if storage is None and (storage := _storage_of(t)) is None:
            return None
        size = t.element_size()
        strides = t.stride()
        lo = t.data_ptr()
        hi = lo + size * stored_extent(tuple(t.shape), strides)
        dtype = t.dtype
        state = (t._version if version is None else version,)
        seen = self._seen
        for where in reversed(self._recent):  # type: ignore[arg-type]
            start = where[1]
            if start <= lo and where[3] is dtype and hi <= start + where[2] * size:
                entry = seen.get(where)
                if entry is not None and entry[1] == state and entry[2] is not own \
                        and entry[0]() is storage:
                    return Within(entry[2], lo - start, hi - lo,
                                  "" if t.is_contiguous() else shape_str(strides))
        return None

    def _plan(self, t: torch.Tensor, stable: bool, version: int | None = None
              ) -> tuple[list | None, str | Within | None, bool]:
        """(holder, shared, skip) for one record, the decision both writers make the same way:
        `shared` is None, or, when the record points at an earlier record's bytes, its strides
        over them ("" for C order), or a `Within` (its statistics are still to be taken, but
        no snapshot); `skip` when it needs no snapshot and no statistics of its own (it reuses
        them, and either shares bytes or stores none)."""
        if self._same and (same := self._take_same(t)) is not None:
            # a parameter snapshot without the kernel's statistics (`same_bytes`): the record
            # holding the parameter's memory has its statistics and bytes
            return same[0], same[1], True
        holder, hit, kind, storage = self._reuse(t, stable, version)
        if not hit:
            # a strided slice, or a dense piece of a larger storage (x[i], x[:2], a chunk): its
            # elements may be stored already (a tensor owning all of its storage never is)
            if self._recent and (kind == "id" or (kind == "span" and _partial(t, storage))):
                return holder, self._within(t, version, holder, storage), False
            return holder, None, False
        if not self.keep_bytes:
            return holder, None, True
        if kind == "id":
            return holder, SAME_LAYOUT, True
        # a span hit: contiguous, or (on CPU) a dense permutation of the span, which is stored
        # in memory order
        return holder, span_strides(t), True

    def _new_file(self, step: int) -> StepFile:
        attrs = root_attrs(rank=self.rank, world_size=self.world_size, step=step,
                           level=self.config.level, mode=self.config.mode,
                           config=self._config_dict, run_id=self.run_id)
        return StepFile(step_path(self.run_dir, self.rank, step), attrs,
                        spill_bytes=self._spill_bytes)

    def _record(self, file: StepFile, step: int, seq: int, meta: RecordMeta, dtype: torch.dtype,
                shape: tuple, numel: int, stats: dict | None,
                snap: torch.Tensor | StoredBytes | None,
                release: Callable[[], None] | None = None, share: list | None = None,
                shared: str | None = None) -> dict | None:
        """Add one record's row (and bytes) to `file` and hand it to the row sinks; returns it
        as a dict for the observers, or None when there are none.

        `stats` None means: take them from `share` when an earlier record filled it, else
        compute them from `snap` (the CPU snapshot; `StoredBytes` only with `stats`) here.
        `release` is called once `snap` is no longer needed (its bytes written, or not kept).
        An empty `share` is filled with them and with where this record's bytes are. `shared`
        (not None): store no bytes, point at those of the record that filled `share`, read with
        these strides (see `_plan`).
        """
        if stats is None and share is not None:
            stats = share[0]
        if stats is None:
            if snap is None and share is not None:  # pragma: no cover - internal invariant
                raise AssertionError("reused statistics were never computed")
            stats = (host_stats(snap, blocks_per_op=self._stats_blocks) if snap is not None
                     else empty_stats())
        if share is not None and share[0] is None:
            share[0] = stats
        if self.sketch and "sketch" not in stats and snap is not None \
                and type(snap) is not StoredBytes:
            stats["sketch"] = sketch_of(snap)  # the writer thread's records, from the snapshot
        offset, nbytes, strides = -1, 0, ""
        if type(shared) is Within:
            stored = shared.holder[1]
            if stored is None or stored[0] < 0:  # pragma: no cover - internal invariant
                raise AssertionError("the containing record's bytes were never stored")
            # no snapshot was taken for it (nothing to release): its bytes are stored already
            offset, nbytes, strides = stored[0] + shared.delta, shared.nbytes, shared.strides
            if share is not None and share[1] is None:
                share[1] = (offset, nbytes, strides)
        elif shared is not None and self.keep_bytes:
            if share is None or share[1] is None:  # pragma: no cover - internal invariant
                raise AssertionError("shared bytes were never stored")
            offset, nbytes, strides = share[1]
            if shared != SAME_LAYOUT:
                strides = shared
            if release is not None:
                release()
        else:
            if self.keep_bytes and snap is not None:
                data, strides = snap if type(snap) is StoredBytes else stored_bytes(snap)
                nbytes = int(data.nbytes)
                offset = file.add_bytes(data, release)
            elif release is not None:
                release()
            if share is not None and share[1] is None:
                share[1] = (offset, nbytes, strides)
        row = RecordRow.make(seq, meta, dtype_name(dtype), shape_str(shape), numel, stats,
                             offset, nbytes, strides)
        file.add_row(row)
        if self.sketch and (sketch := stats.get("sketch")) is not None:
            file.add_sketch(seq, sketch)
        for sink in self.row_sinks:
            sink(row, step)
        return row.as_dict(step=step, rank=self.rank) if self.observers else None

    def _record_tensor(self, target: Any, step: int, seq: int, meta: RecordMeta,
                       tensor: torch.Tensor, stats: dict | None,
                       snap: torch.Tensor | StoredBytes | None,
                       release: Callable[[], None] | None, share: list | None,
                       shared: str | None) -> dict | None:
        """`_record` of a tensor's record (dtype, shape and size read from `tensor`, and its
        sketch, where `stats` lacks one)."""
        if self.sketch:
            if stats is not None:
                if "sketch" not in stats:
                    stats["sketch"] = sketch_of(tensor)
                    stats["sketch_layout"] = _sketch_layout(tensor)
            elif share is not None and share[0] is not None \
                    and share[0].get("sketch_layout") != (layout := _sketch_layout(tensor)):
                # statistics reused from a record of the same memory (they do not see order),
                # but this one reads it in another order (a transpose): its own sketch
                stats = {**share[0], "sketch": sketch_of(tensor), "sketch_layout": layout}
        return self._record(target, step, seq, meta, tensor.dtype, tuple(tensor.shape),
                            tensor.numel(), stats, snap, release, share, shared)

    def _deliver(self, row: dict | None) -> None:
        """Show a row to the observers, if it was made for them (see `_record`); the async
        writer keeps their exception for the training thread's next call."""
        if row is not None:
            self._notify(row)

    def _notify(self, row: dict) -> None:
        for observer in tuple(self.observers):  # another thread may remove one meanwhile
            observer(row)

    def _claim(self) -> None:
        """Take this rank's lock and check that the dump there is this run's (tracer.storage._lock),
        once, before the first step file: raises DumpLockedError or OtherRunError."""
        if self._rank_lock is None:
            self.run_id, self._rank_lock = claim_rank(
                self.run_dir, self.rank, self.world_size, overwrite=self.config.overwrite)

    def _release_lock(self) -> None:
        """Let the next writer of this rank in (at close)."""
        if self._rank_lock is not None:
            self._rank_lock.release()

    def _storage_error(self, e: BaseException, where: str) -> None:
        """Apply on_error to a failure of the dump itself (not of an observer)."""
        self._disabled = True
        self._failure = f"failed {where}: {type(e).__name__}: {e}"
        if self.config.raises():
            raise DumpWriteError(f"sleuth dump (rank {self.rank}) {self._failure}; dumping is "
                                 f"off for the rest of the run") from e
        warn(f"the dump of rank {self.rank} {self._failure}; dumping is off for the rest of "
             f"the run, and the run goes on without it (SLEUTH_STRICT=1 stops the run "
             f"instead)", stacklevel=3)


class SyncWriter(Writer):
    """Does everything in the calling thread; `end_step` returns with the file on disk."""

    def __init__(self, config: DumpConfig, *, rank: int, world_size: int) -> None:
        super().__init__(config, rank=rank, world_size=world_size)
        self._file: StepFile | None = None
        self._step = -1
        self._batches: list = []  # the step's flushed batches, resolved at its end

    def begin_step(self, step: int) -> None:
        if not self.enabled:
            return
        self._claim()
        if self._file is not None:
            self._finish(complete=False)
        self._step, self._seq = int(step), 0
        self._reset_reuse()
        self._file = self._new_file(self._step)

    def add(self, meta: RecordMeta, tensor: torch.Tensor, stable: bool = True,
            version: int | None = None, stats: dict | None = None) -> None:
        if not self.enabled:
            return
        if self._file is None:
            raise TracerError("Writer.add() outside a step: call begin_step(step) first")
        seq = self._seq
        self._seq += 1
        try:
            row = self._capture(seq, meta, tensor, stable, version, stats)
        except Exception as e:  # noqa: BLE001 - on_error decides
            self._abort()
            self._storage_error(e, f"recording {meta.name!r} at step {self._step}")
            return
        self._deliver(row)

    def _capture(self, seq: int, meta: RecordMeta, tensor: torch.Tensor, stable: bool,
                  version: int | None, stats: dict | None) -> dict | None:
        """`add`'s record: its statistics and bytes now (or an earlier record's, see
        `Writer._plan`), its row in the step file."""
        deferred = self._deferred
        if deferred is not None and stats is None and deferred.takes(tensor):
            self._batch_launched(deferred.add(self._plan, seq, meta, tensor, stable, version))
            return None
        if stats is not None:  # computed by the caller (see Writer.add)
            same = self._take_same(tensor) if self._same else None
            share, shared = same if same is not None else (None, None)
            snap, release = (snapshot_bytes(tensor, self._pool)
                             if self.keep_bytes and same is None else (None, None))
        else:
            share, shared, skip = self._plan(tensor, stable, version)
            if skip:
                snap, release = None, None
            else:  # a `Within` record's bytes are stored already: statistics only
                stats, snap, release = _capture_now(tensor, self.keep_bytes and shared is None,
                                                    self._pool, self.sketch)
        return self._record_tensor(self._file, self._step, seq, meta, tensor, stats, snap, release,
                         share, shared)

    def add_hit(self, hit: dict) -> None:
        if self.enabled and self._file is not None:
            self._file.add_hit(hit)

    def add_call(self, seq: int, name: str, spec: str) -> None:
        if self.enabled and self._file is not None:
            self._file.add_call(seq, name, spec)

    def end_step(self, status_reason: str | None = None, *, drop: bool = False) -> None:
        if self.enabled and self._file is not None:
            if drop:
                self._abort()
                return
            self._finish(complete=status_reason is None, reason=status_reason)

    def close(self) -> None:
        if self._closed:
            return
        try:
            if self.enabled and self._file is not None:
                self._finish(complete=False)
        finally:
            self._closed = True
            self._release_lock()

    def _finish(self, *, complete: bool, reason: str | None = None) -> None:
        if self._deferred is not None and not self._record_batches(complete, reason):
            return
        file, self._file = self._file, None
        assert file is not None
        if reason:
            file.attrs["status_reason"] = reason
        try:
            self.files_written.append(file.finish(complete=complete))
        except Exception as e:  # noqa: BLE001 - on_error decides
            file.abort()
            self._storage_error(e, f"writing {file.path}")

    def _batch_launched(self, batch: Any) -> None:
        if batch is not None:
            self._batches.append(batch)

    def _record_batches(self, complete: bool, reason: str | None) -> bool:
        """The step's batched records into its file, with one wait for the device
        (tracer.storage._batcher), and to the observers, before the file is finished (their
        hits go into it); False when that failed and on_error let the run go on. An observer's
        exception is raised once the file is written."""
        try:
            batch = self._deferred.flush()
            batches, self._batches = self._batches + ([batch] if batch else []), []
            rows = [row for b in batches for row in record_batch(self, self._file, self._step, b)]
        except Exception as e:  # noqa: BLE001 - on_error decides
            self._abort()
            self._storage_error(e, f"recording the batched statistics of step {self._step}")
            return False
        try:
            for row in rows:
                self._deliver(row)
        except BaseException:
            self._finish(complete=complete, reason=reason)  # nothing is pending now
            raise
        return True

    def _abort(self) -> None:
        self._batches = []
        if self._deferred is not None:
            self._deferred.drop()
        if self._file is not None:
            self._file.abort()
            self._file = None


def _sketch_layout(t: torch.Tensor) -> tuple | None:
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
    on a device the `sketch` comes with the statistics (on CPU `_record_tensor` takes it)."""
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
