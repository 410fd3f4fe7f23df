"""The statistics-mode record in one function: the path most records of a statistics dump take.

`Writer.add` (tracer.storage._writer, tracer.storage._async) is general: it plans shared bytes,
snapshots and device copies, in five or six calls per record. In statistics mode,
for a contiguous CPU tensor of a dtype the C kernel reads (float32, bfloat16, float16, the
integers, bool), none of that applies: the record reuses the statistics of an earlier record
of the same memory at the same version, or the kernel computes them, and its row is made. Most
of a step's records are such (the forward, backward and parameter records of a float model
on CPU). In the training step, where the model's ops have just cooled the caches, the writer's
part of a record costs 11.9-13.0 us this way against 13.8-16.4 the general way (sync writer;
benchmarks/record_cost.py): most of what is left is calling into the writer at all, and the
interpreter's and torch's attribute lookups missing the cache. Every other record goes the
general way (`NOT_HERE`), and both ways make the same rows: the reuse entries they leave in
`Writer._seen` have one shape, so either finds the other's. Statistics come from the kernel's
result as `host_stats` makes them (`_stats._fused_dict`).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Protocol

import torch

from tracer.storage import _stats
from tracer.storage._format import RecordMeta
from tracer.storage._stats import _STATS_CODES, _fused_dict, dtype_name, shape_str


class WriterState(Protocol):
    """What the fast path reads of a writer (tracer.storage._writer.Writer, which imports this
    module, so it is described here rather than imported)."""

    rank: int
    keep_bytes: bool
    row_sinks: list[Callable[[tuple, int], None]]
    observers: list[Callable[[dict], None]]
    _seen: dict

NOT_HERE = object()
"""`stats_row`'s answer for a record it does not take (the caller goes the general way)."""

_STRIDED = torch.strided
_CPU = torch.device("cpu")  # equal, and equal in hash, to every CPU tensor's `device`
_NO_BYTES = (-1, 0, "")  # a statistics-mode record's (data_offset, data_nbytes, strides)


_ENABLED = True
"""False sends every record the general way (benchmarks/tracer_ablation.py measures the
difference); read when a writer is made."""


def available(writer: WriterState) -> bool:
    """True when `writer`'s records may take `stats_row`: statistics mode, the kernel built."""
    return _ENABLED and not writer.keep_bytes and _stats._fused is not None


def stats_row(writer: WriterState, target: Any, step: int, seq: int, meta: RecordMeta,
              t: torch.Tensor, stable: bool, version: int | None, stats: dict | None) -> Any:
    """Make the row of record `seq` (tensor `t`, name and origin `meta`) in `target` (a step
    file or the async writer's rows) and hand it to the row sinks; returns the row as a dict
    for the observers (None when there are none), or NOT_HERE, with nothing done, for a
    record the general path must take. `stats`: computed by the caller (a parameter record,
    see `Writer.add`); `t` then gives dtype and shape only. The caller has checked that the
    writer is `available` and enabled."""
    dtype, n = t.dtype, t.numel()
    if stats is None:
        code = _STATS_CODES.get(dtype)
        if code is None or not n or not t.is_cpu or t.layout is not _STRIDED \
                or not t.is_contiguous() or t.is_neg():
            return NOT_HERE
        ptr = t.data_ptr()
        if not ptr:  # a wrapper subclass: no memory of its own to read
            return NOT_HERE
        holder = None
        if stable and not t.is_inference():
            # the span key of `reuse_key`, valid while the storage lives (see Writer._reuse)
            storage = t.untyped_storage()
            where = ("span", ptr, n, dtype, _CPU)
            state = (t._version if version is None else version,)
            entry = writer._seen.get(where)
            if entry is not None and entry[1] == state and entry[0]() is storage:
                stats = entry[2][0]
                if stats is None:  # not known yet (the writer thread takes them): the general way
                    return NOT_HERE
            else:
                holder = [None, _NO_BYTES]
                writer._seen[where] = (weakref.ref(storage), state, holder)
        if stats is None:
            stats = _fused_dict(_stats._fused.stats(ptr, n, code), n, code)
            if holder is not None:
                holder[0] = stats
    name, module, op, phase, direction, index, call, source, caller = meta
    row = (seq, name, module, op, phase, direction, index, call, dtype_name(dtype),
           shape_str(t.shape), n, stats["min"], stats["max"], stats["mean"],
           stats["norm"], stats["nan"], stats["posinf"], stats["neginf"], stats["zeros"],
           stats["checksum"], source, -1, 0, "", caller)
    return put_row(writer, target, step, row)


def put_row(writer: WriterState, target: Any, step: int, row: tuple) -> dict | None:
    """Add a /records row (RECORD_FIELDS order) to `target` and hand it to the writer's row
    sinks; returns it as the observers' dict, or None when there are none (both paths)."""
    target.add_row(row)
    for sink in writer.row_sinks:
        sink(row, step)
    if not writer.observers:
        return None
    return observer_dict(writer, step, row)


def observer_dict(writer: WriterState, step: int, row: tuple) -> dict:
    """A /records row as the observers' dict (with `step` and `rank`)."""
    # a dict display: ~3x faster than dict(zip(RECORD_FIELDS, row))
    (seq, name, module, op, phase, direction, index, call, dtype, shape, numel, mn, mx, mean,
     norm, nan, posinf, neginf, zeros, checksum, source, offset, nbytes, strides, caller) = row
    return {"seq": seq, "name": name, "module": module, "op": op, "phase": phase,
            "direction": direction, "index": index, "call": call, "dtype": dtype,
            "shape": shape, "numel": numel, "min": mn, "max": mx, "mean": mean, "norm": norm,
            "nan": nan, "posinf": posinf, "neginf": neginf, "zeros": zeros,
            "checksum": checksum, "source": source, "data_offset": offset,
            "data_nbytes": nbytes, "strides": strides, "caller": caller, "step": step,
            "rank": writer.rank}
