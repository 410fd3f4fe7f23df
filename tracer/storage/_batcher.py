"""Batched statistics records on a CUDA device: a record appends a descriptor; one multi-tensor
launch measures many (tracer.storage._batched_stats); the writer decodes the slab later.

Statistics mode only (tensor and full modes copy each record's bytes anyway). A CUDA record of
a dtype the kernel reads is not measured when it is made: `Deferred.add` plans it as every record
is planned (`ReuseIndex.plan`: a tensor recorded again unchanged takes the first record's
statistics), writes the tensor's descriptor row into the batch's preallocated table
(`_batched_stats.Table`: one packing call, no object a record), keeps a reference to the
tensor's storage, and appends the record itself, in seq order, to the pending batch. Every
`max_records` records or `max_bytes` of referenced tensors the batch is flushed: the kernels are
queued on the current stream, the output slab is copied to pinned host memory once, and an
event is recorded after the copy; the storages are then let go (the caching allocator hands
their memory out again only to work queued after the kernels on that stream). The writer
resolves a flushed `Batch` (`record_batch`: wait for its event, decode, one `Writer._record` per
record in seq order, so reused statistics are filled before they are taken) at the step's end
(sync writer) or in its writer thread (async writer). No record waits for the device, and no
record copies alone.

Memory this holds (docs/tracer.md, "Statistics on a GPU"): the tensors of the pending batch,
less than `max_bytes` beyond what the step holds anyway (a tensor that takes the batch past
`max_bytes` is flushed with it at once), plus per flushed batch a device slab and a pinned host
slab of 8 * (9 + 128) bytes a record (9 words without sketches), and a device scratch of 72
bytes per kernel program (at most 512 programs a record); the table, 8 * 16 bytes a record of
`max_records`, is allocated once.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, NamedTuple

import torch

from tracer._errors import TracerError
from tracer.storage import _batched_stats as kernel
from tracer.storage._staging import Pending
from tracer.storage._stat_fields import empty_stats

MAX_RECORDS = 512
"""Records a batch holds before it is flushed."""
MAX_BYTES = 256 << 20
"""Bytes of tensors a batch references before it is flushed."""
_EMPTY = -2  # slot of a record without elements
_new_tuple = tuple.__new__
_REUSED = -1  # slot of a record that takes an earlier record's statistics


class Record(NamedTuple):
    """A record waiting for its batch: what `Writer._record` needs besides its statistics."""

    seq: int
    meta: Any
    dtype: torch.dtype
    shape: tuple
    numel: int
    share: list | None
    shared: Any
    slot: int


class Batch:
    """A flushed batch: its records in seq order, and the host slab that its kernels' output is
    being copied into (ready once `event` has passed; None on CPU, where it is at once)."""

    def __init__(self, records: list[Record], dtypes: list[torch.dtype], host: torch.Tensor | None,
                 event: Any) -> None:
        self.records = records
        self.dtypes = dtypes
        self.host = host
        self.event = event
        self.nbytes = 1024 * len(records)
        """What the async writer's queue counts for it (its records' floor)."""

    def resolve(self) -> Iterator[tuple[Record, dict | None]]:
        """(record, its statistics or None when it takes an earlier record's), in seq order;
        waits for the device once."""
        decoded: list[dict] = []
        if self.host is not None:
            if self.event is not None:
                self.event.synchronize()
            decoded = kernel.decode(self.host.numpy(), self.dtypes)
        for record in self.records:
            if record.slot >= 0:
                yield record, decoded[record.slot]
            elif record.slot == _EMPTY:
                yield record, empty_stats()
            else:
                yield record, None


class Deferred:
    """The pending batch of one writer (see the module docstring)."""

    device_type = "cuda"
    """The tensors it takes: those on CUDA (the tests set "cpu" under Triton's interpreter)."""

    def __init__(self, sketch: bool, *, copy: bool = False, max_records: int | None = None,
                 max_bytes: int | None = None) -> None:
        self.sketch = sketch
        self.copy = copy
        """Copy each tensor on the device when it is recorded (see `make_deferred`)."""
        self.max_records = MAX_RECORDS if max_records is None else max_records
        self.max_bytes = MAX_BYTES if max_bytes is None else max_bytes
        self._usable: bool | None = None  # Triton importable; decided at the first record
        # the pending records' descriptor rows, written in place as records arrive
        self._table = kernel.Table(self.max_records)
        self._clear()

    def _clear(self) -> None:
        self.records: list[Record] = []
        # the storages the pending rows read: alive (not handed out again) until the launch
        self._keep: list[Any] = []
        self._table.clear()
        self._bytes = 0

    def takes(self, t: torch.Tensor) -> bool:
        """Whether `t`'s record goes through the batch: a tensor on the device, of a dtype the
        kernel reads, with Triton there."""
        if not (t.is_cuda if self.device_type == "cuda" else t.device.type == self.device_type):
            return False  # (is_cuda: the common CPU record pays one attribute read)
        if t.dtype not in kernel.DTYPES or t.layout is not torch.strided:
            return False
        if self._usable is None:
            try:
                kernel.kernels()
                self._usable = True
            except ImportError:  # no Triton: the torch ops, as before
                self._usable = False
        return self._usable

    def add(self, plan: Callable, seq: int, meta: Any, t: torch.Tensor, stable: bool,
            version: int | None) -> Batch | None:
        """Append `t`'s record (planned by `plan`, `ReuseIndex.plan`) and, where the batch is
        full now, flush it: returns the flushed batch, else None."""
        share, shared, skip = plan(t, stable, version)
        n = t.numel()
        shape = tuple(t.shape)
        if skip and self.sketch and not t.is_contiguous():
            skip = False  # the same memory in another order (a CPU transpose): its own sketch
        if skip:
            slot = _REUSED
        elif not n:
            slot = _EMPTY
        else:
            src = t
            if self.copy:
                # its values now: nothing tells this writer of a later in-place write
                src = t.detach().clone(memory_format=torch.contiguous_format)
            elif t.is_neg():
                src = t.detach().resolve_neg()  # its memory does not hold its values
            table = self._table
            slot = table.count
            if not table.append(src, shape):  # more than four dimensions after collapsing
                src = src.detach().contiguous()
                table.append(src, shape)
            # its storage, not a detached tensor (a new object a record): what keeps the
            # memory from being handed out again before the launch
            self._keep.append(src.untyped_storage())
            self._bytes += n * t.element_size()
        # tuple.__new__: a NamedTuple's own __new__ is Python that parses its arguments
        self.records.append(_new_tuple(Record, (seq, meta, t.dtype, shape, n, share, shared,
                                                slot)))
        if self._table.count >= self.max_records or self._bytes >= self.max_bytes \
                or not (stable or self.copy):
            # not stable: an argument of an in-place op, recorded right before it writes
            return self.flush()
        return None

    def flush(self) -> Batch | None:
        """Queue the kernels of the pending records and the slab's copy to the host; returns
        their batch (None when nothing is pending). Raises TracerError while the current CUDA
        stream is being captured into a graph (docs/tracer.md)."""
        if not self.records:
            return None
        records, keep, table = self.records, self._keep, self._table
        try:
            if not table.count:
                return Batch(records, [], None, None)
            dtypes = table.dtypes()
            device = keep[0].device
            host = event = None
            if device.type == "cuda":
                if torch.cuda.is_current_stream_capturing():
                    raise TracerError("a dumped step is being captured into a CUDA graph: the "
                                      "tracer cannot record inside a capture; dump the step "
                                      "eagerly (docs/tracer.md, 'Statistics on a GPU')")
                with torch.cuda.device(device):
                    out = kernel.launch(table, device, self.sketch)
                    host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
                    host.copy_(out, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record()
            else:  # Triton's interpreter: CPU tensors, done on return
                host = kernel.launch(table, device, self.sketch)
            return Batch(records, dtypes, host, event)
        finally:
            # queued: their memory may be handed out to later work on this stream
            del keep
            self._clear()

    @property
    def pending(self) -> bool:
        """Whether records wait for a launch."""
        return bool(self.records)

    def drop(self) -> None:
        """Forget the pending records (the step is dropped)."""
        self._clear()


def record_batch(writer: Any, file: Any, step: int, batch: Batch) -> list[dict | None]:
    """Write `batch`'s records into `file` (`Writer._record`, in seq order); returns their rows
    for the observers."""
    rows = []
    for record, stats in batch.resolve():
        rec = Pending(step, record.seq, record.meta, record.dtype, record.shape, record.numel,
                      record.share, record.shared)
        rows.append(writer._record(file, rec, stats, None, None))
    return rows


def make_deferred(mode: str, level: str, sketch: bool) -> Deferred | None:
    """The pending batch of a writer in `mode` at `level`: statistics mode only (the other modes
    copy every record's bytes, and take their statistics with them).

    A batch measures its tensors when it is launched, so none may be written in place between
    its record and the launch. With the dispatch mode (levels op and mix) every aten op that
    writes an argument tells the writer first (`Writer.forget`), which launches the pending
    batch then; the optimizer's step launches it too (`Writer.launch_pending`, from the
    Dumper's optimizer hook). Module hooks see no such write (an in-place activation, a
    residual added in place to a recorded output), so at level module each tensor is copied on
    the device when recorded (one copy kernel, no host wait) and the batch measures the
    copies."""
    if mode != "statistics" or not batched_enabled():
        return None
    return Deferred(sketch, copy=level == "module")


def batched_enabled() -> bool:
    """Whether `$SLEUTH_BATCHED_STATS` is "1". Until the batched path has passed the cuda tests
    and the GPU ablation on a device (scripts/device_check.sh), a CUDA record keeps the
    per-record kernels, which have; the batch is opt-in."""
    import os

    return os.environ.get("SLEUTH_BATCHED_STATS", "").strip() == "1"

