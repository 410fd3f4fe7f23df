"""The asynchronous dump writer: the hook snapshots and enqueues; one thread writes.

Hot path (`add`), a CPU tensor with the C kernel built: the record is made right there. In
statistics mode the kernel measures the tensor in one pass; in tensor/full mode it copies it
into a reused buffer and measures the copy in the same pass (`snapshot_stats`). The row is made
in the hook too, and the training thread assigns each record's place in /tensors: rows reach
the writer thread in one queue item when the step ends, tensor bytes in chunks of about 16 MiB.
So the writer thread runs no Python per record (if it did, the training thread would wait for
the GIL, up to the 5 ms switch interval each time: measured 195 us per small op, against 39 us
now). Otherwise (CUDA, or no kernel): a snapshot of the tensor is queued and the writer thread
computes the statistics from it (GIL released in the kernel) and stores its bytes where the
training thread counted them. A tensor recorded again unchanged in the same step (an op's
output that is the next op's input, a view of it) is not read again: its record takes the first
record's statistics and byte range. On CUDA, statistics are computed on the device into one
packed int64 vector (no host sync), and it and, with mode tensor/full, the tensor are copied
into pinned host memory on a side stream; the writer thread waits on that copy's event. Every
path runs the same `Writer._record` as the sync writer, so both write the same content.
Observers see a row in the thread that made it.

Files (tracer.storage._pipeline): when a step ends, a second thread (the flusher) writes its
metadata and bytes while the writer thread goes on with the next step, and a third (the syncer)
fsyncs and renames it while the flusher writes the next one, so disk waits overlap both; one file at
a time is being written (memory stays bounded), at most four written files wait for their fsync,
and `flush()` and `close()` return once every file is renamed. The HDF5 part of each step file
(metadata, /records, /hits) is written by a helper process (tracer.storage._file_process), so h5py's
GIL-holding work does not stall the training thread; a file without tensor bytes is written
there entirely. One helper serves the process's writers one after another; until it has
started, the flusher writes the files itself.

Back-pressure: the queue is bounded in BYTES (`async_max_queued_mb`); `add` waits while it is
full and never drops a record. One record larger than the bound is let through alone.

Errors: a failure in the writer thread is raised in the training thread at its next
`add`/`end_step`/`flush`/`close` (on_error='raise') or warned once (on_error='warn'), after which
dumping is off, and `close()` raises again that the dump is incomplete. The writer thread keeps
draining so producers never block on a dead writer. The files are at most one step behind: the
end of step S+1 (or the next step boundary, dumped or not: `step_boundary`) waits until step S's
file is written, fsynced and renamed, so a failure to write step S (disk full) is raised there,
naming the step and its cause, not many queued steps later.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

import torch

from tracer._config import DumpConfig
from tracer._errors import DumpWriteError, TracerError
from tracer.storage._batcher import record_batch
from tracer.storage._device_stats import decode_packed, element_bits
from tracer.storage._file_process import shared_file_process
from tracer.storage._pipeline import Barrier, FileFailure, FilePipeline
from tracer.storage._format import RecordMeta
from tracer.storage._row_buffer import RowBuffer
from tracer.storage._staging import ThreadStager, take_now
from tracer.storage._stats import kernel_available
from tracer.storage._step_file import StepFile
from tracer.storage._writer import _NOT_PLAIN, Writer

_STOP = ("stop",)

_RECORD_FLOOR_BYTES = 1024  # what a queued record costs besides its tensor bytes, roughly
# tensor bytes snapshotted in the training thread go to the writer thread in chunks this large:
# one queue item (and one wake-up of the writer thread, which then takes the GIL) per chunk, not
# per record (tiny preset, op tensor, same-process A/B: 4 MiB 4.51x, 16 MiB 4.26x)
_BYTES_CHUNK = 16 << 20


class AsyncWriter(Writer):
    """Writer whose `add` only stages and enqueues; see the module docstring."""

    def __init__(self, config: DumpConfig, *, rank: int, world_size: int) -> None:
        super().__init__(config, rank=rank, world_size=world_size)
        self._cap = config.async_max_queued_mb << 20
        self._cond = threading.Condition()
        self._queue: deque[tuple[tuple, int]] = deque()
        self._queued = 0
        self.blocked_s = 0.0
        """Seconds `add` spent waiting for queue space (back-pressure)."""
        self._error: BaseException | None = None  # storage failure in the writer thread
        self._observer_error: BaseException | None = None
        self._error_reported = False
        # one per ended step, oldest first: its file is on disk once the barrier is passed
        self._barriers: deque[Barrier] = deque()
        self._in_step = False
        self._step = -1
        # records made in the writer thread: what it gets of them (tracer.storage._staging)
        self._stager = ThreadStager(self._pool, keep_bytes=self.keep_bytes, sketch=self.sketch)
        self._kernel = kernel_available()
        # step files' HDF5 part is written by a helper process (tracer.storage._file_process),
        # one per training process, kept from writer to writer
        self._file_process = shared_file_process(self.rank) if config.file_process else None
        if self._file_process is not None:
            self._file_process.start()
        # rows and bytes made in the training thread (see `add`)
        self._rows = RowBuffer(min(_BYTES_CHUNK, max(1, self._cap // 4)))
        # writer-thread state
        self._wfile: StepFile | None = None
        self._wstep = -1
        self._files = FilePipeline(self.rank, self._file_process, self.files_written)
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"sleuth-dump-writer-rank{self.rank}")
        self._thread.start()

    # -- training thread -----------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        self._raise_pending()
        if not self.enabled:
            return
        self._claim()
        if self._in_step:
            self._close_step(complete=False)
        self._step, self._seq, self._in_step = int(step), 0, True
        self._rows.reset()
        self._reuse.reset()
        self._put(("begin", self._step), 0)

    def add(self, meta: RecordMeta, tensor: torch.Tensor, stable: bool = True,
            version: int | None = None, stats: dict | None = None) -> None:
        self._raise_pending()
        if not self.enabled:
            return
        if not self._in_step:
            raise TracerError("Writer.add() outside a step: call begin_step(step) first")
        seq = self._seq
        self._seq += 1
        try:
            row = _NOT_PLAIN
            if self._plain_ok and (self._deferred is None or not self._deferred.takes(tensor)):
                # a plain CPU record, made here in one call (`Writer._plain`)
                row = self._plain(self._rows, seq, meta, tensor, stable, version, stats)
            inline = row is not _NOT_PLAIN
            if not inline:
                rec = self._stage(seq, meta, tensor, stable, version, stats)
                if rec is None:  # a CUDA statistics record: a descriptor now, one launch a batch
                    return
                # made here (inline): records on CPU (or meta) with the kernel built, and records
                # whose statistics the caller computed; the writer thread gets their bytes in
                # chunks
                inline = (stats is not None and not self.keep_bytes) or (
                    (self._kernel or stats is not None) and (tensor.is_cpu or tensor.is_meta))
                if inline:
                    # the one-pass kernel (statistics, or copy and statistics) costs no more
                    # than a snapshot, and the row is made here too, so the writer thread has
                    # nothing to do per record (a writer thread running Python per record makes
                    # the training thread wait for the GIL, up to the 5 ms switch interval each
                    # time)
                    stats, snap, release = take_now(tensor, rec, stats, self._pool)
                    row = self._record_tensor(self._rows, rec, tensor, stats, snap, release)
                else:
                    staged, nbytes, rec = self._stager.stage(tensor, rec, stats)
        except Exception as e:  # noqa: BLE001 - on_error decides
            self._fail_staging(e, meta)
            return
        if inline:
            if self._rows.pending_bytes >= self._rows.chunk:  # checked here: the hot path
                self._hand_over_bytes()
            self._deliver(row)
            return
        # the writer thread stores this record's bytes after the chunks made before it
        self._hand_over_bytes()
        if self.keep_bytes:
            self._rows.reserve(nbytes)
        # a floor per record keeps a statistics-only queue bounded too
        self._put(("rec", rec, staged), max(nbytes, _RECORD_FLOOR_BYTES))

    def _batch_launched(self, batch: Any) -> None:
        """Hand a flushed batch (tracer.storage._batcher) to the writer thread, which waits for
        its slab and writes its records."""
        if batch is not None:
            self._put(("batch", self._step, batch), batch.nbytes)

    def _fail_staging(self, e: Exception, meta: RecordMeta) -> None:
        """Drop the half-made step and apply on_error to `e`, raised staging `meta`'s record."""
        self._drop_step()
        self._storage_error(e, f"staging {meta.name!r} at step {self._step}")

    def _hand_over_bytes(self) -> None:
        """Queue the tensor bytes made in the training thread, if any, for the writer thread."""
        if self._rows.pending_bytes:
            self._put(*self._rows.take())

    def _deliver(self, row: dict | None) -> None:
        if row is None:
            return
        try:
            self._notify(row)
        except Exception as e:  # noqa: BLE001 - raised in the training thread
            if self._observer_error is None:
                self._observer_error = e

    def _close_step(self, *, complete: bool, reason: str | None = None) -> None:
        """Hand the rows made in the training thread to the writer thread, and end the step's
        file there (marked complete or not, and why)."""
        if self._deferred is not None:
            try:
                self._batch_launched(self._deferred.flush())
            except Exception as e:  # noqa: BLE001 - on_error decides
                self._drop_step()
                self._storage_error(e, f"recording the batched statistics of step {self._step}")
                return
        self._hand_over_bytes()
        if self._rows.rows:
            rows, self._rows.rows = self._rows.rows, []
            sketches, self._rows.sketches = self._rows.sketches, []
            self._put(("rows", rows, sketches), 0)
        self._put(("end", complete, reason), 0)

    def _drop_step(self) -> None:
        """Forget the open step: nothing of it is written."""
        self._rows.reset()
        if self._deferred is not None:
            self._deferred.drop()
        self._put(("end", None, None), 0)
        self._in_step = False

    def add_hit(self, hit: dict) -> None:
        if threading.get_ident() == self._thread.ident:
            # an observer running in the writer thread: its record's step is the open file
            if self._wfile is not None:
                self._wfile.add_hit(hit)
            return
        if self.enabled and self._in_step:
            self._put(("hit", dict(hit)), 0)

    def add_call(self, seq: int, name: str, spec: str) -> None:
        if self.enabled and self._in_step:
            self._put(("call", seq, name, spec), 0)

    def set_attr(self, key: str, value: str) -> None:
        if self.enabled and self._in_step:
            self._put(("attr", key, value), 0)

    def end_step(self, status_reason: str | None = None, *, drop: bool = False) -> None:
        self._raise_pending()
        if self.enabled and self._in_step:
            if drop:
                self._drop_step()
                return
            self._in_step = False
            self._close_step(complete=status_reason is None, reason=status_reason)
            barrier = Barrier(self._step)
            self._put(("barrier", barrier), 0)
            self._barriers.append(barrier)
            # this step's file is written while the next step trains; the one before must be
            # on disk now, or its error raised here
            self._await_barriers(keep=1)

    def step_boundary(self) -> None:
        """A step ended that was not dumped: wait until every ended step's file is on disk,
        and raise a pending error (the Dumper calls it at each step boundary)."""
        if self._barriers:
            self._await_barriers(keep=0)
        self._raise_pending()

    def _await_barriers(self, keep: int) -> None:
        """Wait until at most `keep` ended steps' files may still be in flight; a failure to
        write one of them is raised as a DumpWriteError naming the step (see on_error)."""
        while len(self._barriers) > keep:
            barrier = self._barriers.popleft()
            try:
                barrier.wait()
            except BaseException as e:  # noqa: BLE001 - reported as the writer's error
                with self._cond:
                    if self._error is None:
                        self._error = e
            self._raise_pending()

    def flush(self) -> None:
        """Wait until everything queued so far is written; raise a pending error."""
        if self._thread.is_alive():
            done = threading.Event()
            self._put(("flush", done), 0)
            done.wait()
        self._raise_pending()

    def close(self) -> None:
        if self._closed:
            return
        try:
            if self.enabled and self._in_step:
                self._close_step(complete=False)
            self._in_step = False
        finally:
            self._closed = True
            self._put(_STOP, 0)
            self._thread.join()
            self._barriers.clear()
            self._release_lock()
        reported = self._error_reported
        self._raise_pending()
        if reported and self.config.raises() and self._error is not None:
            # raised at a step boundary already: the caller went on (or is unwinding); the
            # dump is still incomplete, and close() returning would say otherwise
            raise DumpWriteError(f"the dump of rank {self.rank} under {self.run_dir} is "
                                 f"incomplete: {self._failure}") from self._error

    @property
    def queued_bytes(self) -> int:
        """Bytes staged and not yet written."""
        return self._queued

    def _put(self, item: tuple, nbytes: int) -> None:
        with self._cond:
            if nbytes and self._queued and self._queued + nbytes > self._cap:
                start = time.perf_counter()
                while (self._queued and self._queued + nbytes > self._cap
                       and self._error is None):
                    self._cond.wait()
                self.blocked_s += time.perf_counter() - start
            self._queue.append((item, nbytes))
            self._queued += nbytes
            self._cond.notify_all()

    def _raise_pending(self) -> None:
        err = self._observer_error
        if err is not None:
            self._observer_error = None
            raise err
        if self._error is not None and not self._error_reported:
            self._error_reported = True
            error = self._error
            if isinstance(error, FileFailure):
                self._storage_error(error.cause, f"writing step {error.step} ({error.path})")
            else:
                self._storage_error(error, "the writer thread")

    # -- writer thread -------------------------------------------------------------------------
    def _run(self) -> None:
        stop = False
        while not stop:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                item, nbytes = self._queue.popleft()
            try:
                if item is _STOP:
                    stop = True
                    self._finish_file(complete=False)
                    self._files.wait_all()
                elif item[0] == "flush":
                    try:
                        self._files.wait_all()
                    finally:
                        item[1].set()
                elif item[0] == "barrier":
                    # the step's file is being written: the training thread waits for it at
                    # the next step's end, while this thread goes on
                    self._files.mark(item[1])
                elif self._error is None:
                    self._process(item)
            except BaseException as e:  # noqa: BLE001 - handed to the training thread
                if self._error is None:
                    self._error = e
                if self._wfile is not None:
                    self._wfile.abort()
                    self._wfile = None
            finally:
                with self._cond:
                    self._queued -= nbytes
                    self._cond.notify_all()
        self._files.shutdown()

    def _process(self, item: tuple) -> None:
        kind = item[0]
        if kind == "rec":
            _, rec, staged = item
            release = staged[3] if staged[0] == "ready" else None
            if self._wfile is None:  # its step was dropped after an error
                if release is not None:
                    release()
                return
            if staged[0] == "cuda":
                _, done, host_packed, snap = staged
                done.synchronize()
                stats = decode_packed(host_packed.tolist(), element_bits(rec.dtype))
            else:  # ("ready", statistics or None: from the snapshot, snapshot, its release)
                _, stats, snap, _ = staged
            row = self._record(self._wfile, rec, stats, snap, release)
            self._deliver(row)
        elif kind == "batch":
            if self._wfile is not None:  # else its step was dropped after an error
                for row in record_batch(self, self._wfile, item[1], item[2]):
                    self._deliver(row)
        elif kind == "begin":
            self._finish_file(complete=False)
            self._wstep = item[1]
            self._wfile = self._new_file(self._wstep)
        elif kind == "end":
            if item[1] is None:
                if self._wfile is not None:
                    self._wfile.abort()
                    self._wfile = None
            else:
                self._finish_file(complete=item[1], reason=item[2])
        elif kind == "bytes":
            _, offset, pending = item
            if self._wfile is None:  # its step was dropped after an error
                for _, on_written in pending:
                    if on_written is not None:
                        on_written()
                return
            if self._wfile.nbytes != offset:  # pragma: no cover - internal invariant
                raise AssertionError(f"tensor bytes out of order: the training thread placed "
                                     f"them at {offset}, the file is at {self._wfile.nbytes}")
            for view, on_written in pending:
                self._wfile.add_bytes(view, on_written)
        elif kind == "rows":
            if self._wfile is not None:
                self._wfile.rows.extend(item[1])
                self._wfile.sketches.extend(item[2])
        elif kind == "hit":
            if self._wfile is not None:
                self._wfile.add_hit(item[1])
        elif kind == "attr":
            if self._wfile is not None:
                self._wfile.attrs[item[1]] = item[2]
        elif kind == "call":
            if self._wfile is not None:
                self._wfile.add_call(item[1], item[2], item[3])
        else:  # pragma: no cover - internal invariant
            raise AssertionError(f"unknown queue item {kind!r}")

    def _finish_file(self, *, complete: bool, reason: str | None = None) -> None:
        """Hand the open step file, with why it ended when not normally, to the file pipeline
        (tracer.storage._pipeline)."""
        file, self._wfile = self._wfile, None
        if file is not None:
            if reason:
                file.attrs["status_reason"] = reason
            self._files.finish(file, complete)
