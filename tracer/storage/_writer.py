"""The dump writers' shared API and the synchronous writer.

The capture side (tracer._dumper) calls `begin_step`, `add(meta, tensor)` per record and
`end_step`; it never knows which writer it has. `SyncWriter` does all work in the calling thread
and a step file is complete when `end_step` returns; `AsyncWriter` (tracer.storage._async) only
snapshots and enqueues. Both decide what a record needs the same way (`ReuseIndex.decide`,
tracer.storage._reuse) and make its row in `Writer._record`, so both write the same content.

Records of a step are buffered (rows in a list, tensor bytes in memory or spilled to a side file)
and written once at `end_step`: one `/records` table per step file, see tracer.storage._format.
"""
from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any, Callable

import torch

from sleuth.common import describe_error, go_off
from tracer._config import STOPPED_BY, DumpConfig
from tracer._errors import DumpWriteError, TracerError
from tracer.storage._batcher import make_deferred, record_batch
from tracer.storage._elements import dense_span
from tracer.storage._format import RecordMeta, RecordRow, root_attrs, step_path
from tracer.storage._lock import claim_rank
from tracer.storage._reuse import SAME_LAYOUT, ReuseIndex, Within
from tracer.storage._sampling import sketch_of
from tracer.storage._snapshot import StagingPool, StoredBytes, stored_bytes
from tracer.storage._staging import Pending, sketch_layout, take_now
from tracer.storage._sketch import offsets as sketch_offsets
from tracer.storage._stat_fields import _DTYPE_NAMES, _SHAPE_STRS, dtype_name, \
    empty_stats, shape_str
from tracer.storage import _stats
from tracer.storage._stats import _STATS_CODES, _kernel, host_stats
from tracer.storage._step_file import StepFile

_STRIDED = torch.strided
_CPU = torch.device("cpu")
_sample = getattr(_kernel, "sample", None)
_NOT_PLAIN = object()
"""`Writer._plain`'s answer for a record it leaves to the general path."""
_NO_BYTES = (-1, 0, "")
# (shape, strides) -> the sketch's element offsets (`_sketch.offsets`), without its lru_cache's
# Python call
_OFFSETS: dict[tuple, bytes] = {}


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
        # what this step's records hold for the next ones (tracer.storage._reuse)
        self._reuse = ReuseIndex(self.keep_bytes)
        self._seq = 0  # the step's next record number (`next_seq`)
        # statistics mode: CUDA records wait in a batch for one multi-tensor launch
        # (tracer.storage._batcher)
        self._deferred = make_deferred(config.mode, config.level, self.sketch)
        # plain CPU records are made in one call (`_plain`): statistics mode, with the C
        # kernel's statistics and sampling built (the kernel as its module has it now: an
        # ablation or a test takes it away there)
        self._plain_ok = not self.keep_bytes and _sample is not None \
            and getattr(_stats._kernel, "record", None) is not None

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
        `Dumper.emit`). `version`: the output of a view op seen inside a dispatch mode, which
        torch gives its base's version counter only after the mode returned: the base's
        version, standing in for its own until then. `stats`: the record's statistics, already
        computed (by the statistics kernel's copy or difference that produced the values, see
        `Dumper._record_params`); `tensor` is then a CPU tensor that supplies dtype and shape,
        and its bytes only with mode tensor/full; such a record takes no part in reuse, but for
        the bytes `same_bytes` pointed it at."""
        raise NotImplementedError

    @property
    def next_seq(self) -> int:
        """The `seq` the next record of the step gets."""
        return self._seq

    def forget(self, tensors: list[torch.Tensor]) -> None:
        """Drop what the step knew of these tensors' values: they are being changed by an op
        that may not bump their version counter. Called from the training thread."""
        if self._deferred is not None and self._deferred.pending:
            self.launch_pending()  # measured before they change
        self._reuse.forget(tensors)

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

    def set_attr(self, key: str, value: str) -> None:
        """Set a root attribute of the current step's file (the step's `setup`), written with
        it."""
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
        optimizer changes it): its next record points at the bytes of this step's record of
        `source`, where there is one (`ReuseIndex.same_bytes`)."""
        self._reuse.same_bytes(snapshot, source)

    def _stage(self, seq: int, meta: RecordMeta, tensor: torch.Tensor, stable: bool,
               version: int | None, stats: dict | None) -> Pending | None:
        """`add`'s record and what it needs (`ReuseIndex.decide`), or None when a CUDA
        statistics batch took it (tracer.storage._batcher): the one decision both writers
        make."""
        deferred = self._deferred
        if deferred is not None and stats is None and deferred.takes(tensor):
            self._batch_launched(deferred.add(self._reuse.plan, seq, meta, tensor, stable,
                                              version))
            return None
        share, shared, measure, copy = self._reuse.decide(tensor, stable, version,
                                                          stats is not None)
        return Pending(self._step, seq, meta, tensor.dtype, tuple(tensor.shape), tensor.numel(),
                       share, shared, measure, copy)

    def _plain(self, target: Any, seq: int, meta: RecordMeta, t: torch.Tensor, stable: bool,
               version: int | None, stats: dict | None) -> dict | None | object:
        """The record of a plain tensor in statistics mode, made in one call: what `_stage`,
        `take_now` and `_record_tensor` do for it, with the same result (the same reuse entry,
        statistics, sketch and row), without their generality. Plain: a non-empty CPU tensor
        of a dtype the C kernel reads whose elements fill one dense block (contiguous, or a
        transpose or permutation of one: `dense_span`), no bytes kept (an inference tensor,
        which has no version counter, only where it is not offered for reuse); nearly every
        record of a step. `stats`: the caller's (a parameter record's),
        which takes no part in reuse (`ReuseIndex.decide`). Returns what `_record` returns,
        or `_NOT_PLAIN` (nothing done) for any other record, which takes the general path.
        `target` has `rows` and `sketches` lists (a StepFile or the async writer's
        RowBuffer)."""
        dtype = t.dtype
        code = _STATS_CODES.get(dtype)
        if code is None or not t.is_cpu or t.layout is not _STRIDED or t.is_neg():
            return _NOT_PLAIN
        n = t.numel()
        if not n:
            return _NOT_PLAIN
        contiguous = t.is_contiguous()
        if not contiguous and not dense_span(t):
            return _NOT_PLAIN
        ptr = t.data_ptr()  # a dense block's lowest address: its memory order starts here
        holder = None
        hit = False
        if stats is None and stable:
            # `ReuseIndex.lookup` of a span key, inline (the key as `reuse_key` makes it)
            try:
                state = (t._version if version is None else version,)
            except RuntimeError:  # an inference tensor: no version counter, no reuse
                return _NOT_PLAIN
            where = ("span", ptr, n, dtype, _CPU)
            storage = t.untyped_storage()
            seen = self._reuse.seen
            entry = seen.get(where)
            if entry is not None and entry[1] == state and entry[0]() is storage:
                holder = entry[2]
                stats = holder[0]
                if stats is None:  # measured in the async writer's thread: not yet
                    return _NOT_PLAIN
                hit = True
            else:
                holder = [None, None]
                seen[where] = (weakref.ref(storage), state, holder)
        shape = t.shape
        sketch = None
        if stats is None:
            # the statistics as the row holds them and the sketch, in one kernel call (the
            # kernel through its module, where host_stats finds it)
            layout = None
            offsets = None
            if self.sketch:  # the sketch's element offsets for this layout, made once
                strides = t.stride()
                key = (shape, strides)
                offsets = _OFFSETS.get(key)
                if offsets is None:
                    offsets = sketch_offsets(tuple(shape), strides)
                    if len(_OFFSETS) < 4096:
                        _OFFSETS[key] = offsets
                if not contiguous:
                    layout = (tuple(shape), strides)
            mn, mx, mean, norm, nan, posinf, neginf, zeros, checksum, sketch = \
                _stats._kernel.record(ptr, n, code, offsets)
            stats = {"min": mn, "max": mx, "mean": mean, "norm": norm, "nan": nan,
                     "posinf": posinf, "neginf": neginf, "zeros": zeros, "checksum": checksum}
            if sketch is not None:
                stats["sketch"] = sketch
                stats["sketch_layout"] = layout
            if holder is not None:
                holder[0] = stats
        else:
            mn, mx, mean, norm, nan, posinf, neginf, zeros, checksum = (
                stats["min"], stats["max"], stats["mean"], stats["norm"], stats["nan"],
                stats["posinf"], stats["neginf"], stats["zeros"], stats["checksum"])
            if self.sketch:  # as `_record_tensor` gives it
                layout = None if contiguous else (tuple(shape), t.stride())
                if hit:
                    if stats.get("sketch_layout") != layout:
                        # statistics of the same memory read in another order (a transpose):
                        # the statistics are the same, the sketch is not
                        stats = {**stats, "sketch": self._sketch_of(t, ptr, code),
                                 "sketch_layout": layout}
                elif "sketch" not in stats:
                    stats["sketch"] = self._sketch_of(t, ptr, code)
                    stats["sketch_layout"] = layout
                sketch = stats.get("sketch")
        if holder is not None and holder[1] is None:
            holder[1] = _NO_BYTES
        shape_text = _SHAPE_STRS.get(shape)
        if shape_text is None:
            shape_text = shape_str(tuple(shape))
        name, module, op, phase, direction, index, call, source, caller = meta
        row = tuple.__new__(RecordRow, (
            seq, name, module, op, phase, direction, index, call,
            _DTYPE_NAMES.get(dtype) or dtype_name(dtype), shape_text, n,
            mn, mx, mean, norm, nan, posinf, neginf, zeros, checksum, source, -1, 0, "", caller))
        target.rows.append(row)
        if sketch is not None:
            target.sketches.append((seq, sketch))
        for sink in self.row_sinks:
            sink(row, self._step)
        return row.as_dict(step=self._step, rank=self.rank) if self.observers else None

    @staticmethod
    def _sketch_of(t: torch.Tensor, ptr: int, code: int) -> bytes:
        """`sketch_of(t)` for `_plain`'s tensor (at `ptr`, of kernel dtype `code`), as the
        kernel's bytes (SKETCH_SIZE float64): the step file reads a step's sketches into one
        array at its end (`StepFile.sketches_table`), not one array a record."""
        key = (t.shape, t.stride())
        offsets = _OFFSETS.get(key)
        if offsets is None:
            offsets = sketch_offsets(tuple(t.shape), t.stride())
            if len(_OFFSETS) < 4096:
                _OFFSETS[key] = offsets
        return _sample(ptr, code, offsets)

    def _new_file(self, step: int) -> StepFile:
        attrs = root_attrs(rank=self.rank, world_size=self.world_size, step=step,
                           level=self.config.level, mode=self.config.mode,
                           config=self._config_dict, run_id=self.run_id)
        return StepFile(step_path(self.run_dir, self.rank, step), attrs,
                        spill_bytes=self._spill_bytes)

    def _record(self, file: Any, rec: Pending, stats: dict | None,
                snap: torch.Tensor | StoredBytes | None,
                release: Callable[[], None] | None = None) -> dict | None:
        """Add the row (and bytes) of record `rec` to `file` (a StepFile, or the async writer's
        row buffer) and hand it to the row sinks; returns it as a dict for the observers, or
        None when there are none.

        `stats` None means: take them from `rec.share` when an earlier record filled it, else
        compute them from `snap` (the CPU snapshot; `StoredBytes` only with `stats`) here.
        `release` is called once `snap` is no longer needed (its bytes written, or not kept).
        An empty `rec.share` is filled with them and with where this record's bytes are.
        `rec.shared` (not None): store no bytes, point at those of the record that filled
        `share`, read with these strides (see `ReuseIndex.plan`).
        """
        step, seq, meta, dtype, shape, numel, share, shared, _, _ = rec  # one unpacking
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

    def _record_tensor(self, target: Any, rec: Pending, tensor: torch.Tensor,
                       stats: dict | None, snap: torch.Tensor | StoredBytes | None,
                       release: Callable[[], None] | None) -> dict | None:
        """`_record` of a record made while its `tensor` is at hand, which gives its sketch
        where `stats` lacks one."""
        share = rec.share
        if self.sketch:
            if stats is not None:
                if "sketch" not in stats:
                    stats["sketch"] = sketch_of(tensor)
                    stats["sketch_layout"] = sketch_layout(tensor)
            elif share is not None and share[0] is not None \
                    and share[0].get("sketch_layout") != (layout := sketch_layout(tensor)):
                # statistics reused from a record of the same memory (they do not see order),
                # but this one reads it in another order (a transpose): its own sketch
                stats = {**share[0], "sketch": sketch_of(tensor), "sketch_layout": layout}
        return self._record(target, rec, stats, snap, release)

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

    def _storage_error(self, e: BaseException, doing: str) -> None:
        """Apply on_error to a failure of the dump itself (not of an observer): `doing` failed."""
        self._disabled = True
        self._failure = f"{doing} failed: {describe_error(e)}"
        go_off(e, tool=f"the tensor dump of rank {self.rank}", doing=doing,
               off=f"the tensor dump of rank {self.rank} is off for the rest of the run",
               raise_as=DumpWriteError, raises=self.config.raises(), stopped_by=STOPPED_BY,
               stacklevel=3)


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
        self._reuse.reset()
        self._file = self._new_file(self._step)

    def add(self, meta: RecordMeta, tensor: torch.Tensor, stable: bool = True,
            version: int | None = None, stats: dict | None = None) -> None:
        if self._disabled or self._closed:  # `enabled`, inline: this runs for every record
            return
        if self._file is None:
            raise TracerError("Writer.add() outside a step: call begin_step(step) first")
        seq = self._seq
        self._seq += 1
        try:
            row = _NOT_PLAIN
            if self._plain_ok and (self._deferred is None or not self._deferred.takes(tensor)):
                row = self._plain(self._file, seq, meta, tensor, stable, version, stats)
            if row is _NOT_PLAIN:
                row = self._capture(seq, meta, tensor, stable, version, stats)
        except Exception as e:  # noqa: BLE001 - on_error decides
            self._abort()
            self._storage_error(e, f"recording {meta.name!r} at step {self._step}")
            return
        if row is not None:  # `_deliver`, inline
            self._notify(row)

    def _capture(self, seq: int, meta: RecordMeta, tensor: torch.Tensor, stable: bool,
                 version: int | None, stats: dict | None) -> dict | None:
        """`add`'s record: its statistics and bytes now (or an earlier record's, see
        `ReuseIndex.decide`), its row in the step file."""
        rec = self._stage(seq, meta, tensor, stable, version, stats)
        if rec is None:  # in a batch, measured at its launch
            return None
        stats, snap, release = take_now(tensor, rec, stats, self._pool, self.sketch)
        return self._record_tensor(self._file, rec, tensor, stats, snap, release)

    def add_hit(self, hit: dict) -> None:
        if self.enabled and self._file is not None:
            self._file.add_hit(hit)

    def add_call(self, seq: int, name: str, spec: str) -> None:
        if self.enabled and self._file is not None:
            self._file.add_call(seq, name, spec)

    def set_attr(self, key: str, value: str) -> None:
        if self.enabled and self._file is not None:
            self._file.attrs[key] = value

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
