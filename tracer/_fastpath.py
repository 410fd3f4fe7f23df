"""The statistics-mode record in one function: the path most records of a statistics dump take.

`Writer.add` (tracer._writer, tracer._async) is general: it plans shared bytes, snapshots,
queued statistics and device copies, in five or six calls per record. In statistics mode, for
a contiguous CPU tensor of a dtype the C kernel reads (float32, bfloat16, float16, the
integers, bool), none of that applies: the record reuses the statistics of an earlier record
of the same memory at the same version, or the kernel computes them, and its row is made. Most
of a step's records are such (all 204 forward, backward and parameter records of the trainer's
tiny preset at module level but the large gradients queued to the helper thread). In the
training step, where the model's ops have just cooled the caches, the writer's part of a record
costs 13.0 us this way against 16.4 the general way (sync writer; benchmarks/RESULTS.md, ninth
session): most of what is left is the interpreter's and torch's own attribute lookups missing
the cache. Every other record goes the general way
(`NOT_HERE`), and both ways make the same rows: the reuse entries they leave in `Writer._seen`
have one shape, so either finds the other's.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from tracer import _stats
from tracer._stats import _STATS_CODES, dtype_name, shape_str

if TYPE_CHECKING:
    from tracer._writer import RecordMeta, Writer

NOT_HERE = object()
"""`stats_row`'s answer for a record it does not take (the caller goes the general way)."""

_STRIDED = torch.strided
_CPU = torch.device("cpu")  # equal, and equal in hash, to every CPU tensor's `device`
_CODE_BITS = _stats._CODE_BITS
_NAN = math.nan
_sqrt = math.sqrt
_weakref = __import__("weakref").ref
_NO_BYTES = (-1, 0, "")  # a statistics-mode record's (data_offset, data_nbytes, strides)


def available(writer: Writer) -> bool:
    """True when `writer`'s records may take `stats_row`: statistics mode, the kernel built."""
    return not writer.keep_bytes and _stats._fused is not None


def stats_row(writer: Writer, target: Any, step: int, seq: int, meta: RecordMeta,
              t: torch.Tensor, stable: bool, version: int | None,
              stats: dict | None = None) -> Any:
    """Make the row of record `seq` (tensor `t`, name and origin `meta`) in `target` (a step
    file or the async writer's rows) and hand it to the row sinks; returns the row as a dict
    for the observers (None when there are none), or NOT_HERE, with nothing done, for a
    record the general path must take. `stats`: computed by the caller (a parameter record,
    see `Writer.add`); `t` then gives dtype and shape only. The caller has checked that the
    writer is `available`, that it is enabled, and that no record waits for queued statistics
    (rows are made in record order)."""
    dtype = t.dtype
    if stats is not None:
        return _row(writer, target, step, seq, meta, dtype, t.shape, t.numel(), stats["min"],
                    stats["max"], stats["mean"], stats["norm"], stats["nan"], stats["posinf"],
                    stats["neginf"], stats["zeros"], stats["checksum"])
    code = _STATS_CODES.get(dtype)
    if code is None or not t.is_cpu or t.layout is not _STRIDED or not t.is_contiguous() \
            or t.is_neg() or (writer._same and id(t) in writer._same):
        return NOT_HERE
    n = t.numel()
    if not n:
        return NOT_HERE
    ptr = t.data_ptr()
    holder = None
    if stable and not t.is_inference():
        # the span key of `reuse_key`, valid while the storage lives (see Writer._reuse)
        storage = t.untyped_storage()
        where = ("span", ptr, n, dtype, _CPU)
        state = (t._version if version is None else version,)
        seen = writer._seen
        entry = seen.get(where)
        if entry is not None and entry[1] == state and entry[0]() is storage:
            stats = entry[2][0]
            if stats is None:  # its statistics are queued (a deferred record): wait in line
                return NOT_HERE
        else:
            holder = [None, _NO_BYTES]
            seen[where] = (_weakref(storage), state, holder)
    if stats is None:
        mn, mx, total, sq, zeros, nan, posinf, neginf, checksum = _stats._fused.stats(
            ptr, n, code, _stats.STATS_THREADS)
        if nan:
            mn = mx = mean = norm = _NAN
        else:
            mean, norm = total / n, _sqrt(sq)
        checksum &= (1 << _CODE_BITS[code]) - 1
        if checksum >> (_CODE_BITS[code] - 1):
            checksum -= 1 << _CODE_BITS[code]
        if holder is not None:
            holder[0] = {"min": mn, "max": mx, "mean": mean, "norm": norm, "nan": nan,
                         "posinf": posinf, "neginf": neginf, "zeros": zeros,
                         "checksum": checksum}
    else:
        mn, mx, mean, norm = stats["min"], stats["max"], stats["mean"], stats["norm"]
        nan, posinf, neginf = stats["nan"], stats["posinf"], stats["neginf"]
        zeros, checksum = stats["zeros"], stats["checksum"]
    return _row(writer, target, step, seq, meta, dtype, t.shape, n, mn, mx, mean, norm, nan,
                posinf, neginf, zeros, checksum)


def _row(writer: Writer, target: Any, step: int, seq: int, meta: RecordMeta,
         dtype: torch.dtype, shape: Any, n: int, mn: float, mx: float, mean: float, norm: float,
         nan: int, posinf: int, neginf: int, zeros: int, checksum: int) -> dict | None:
    """The row of a statistics-mode record (no bytes) into `target` and the row sinks; the
    observers' dict, or None without observers (the general path's `Writer._record`)."""
    name, module, op, phase, direction, index, call, source = meta
    dtype_s, shape_s = dtype_name(dtype), shape_str(shape)
    row = (seq, name, module, op, phase, direction, index, call, dtype_s, shape_s, n, mn, mx,
           mean, norm, nan, posinf, neginf, zeros, checksum, source, -1, 0, "")
    return put_row(writer, target, step, row)


def put_row(writer: Writer, target: Any, step: int, row: tuple) -> dict | None:
    """Add a /records row (RECORD_FIELDS order) to `target` and hand it to the writer's row
    sinks; returns it as the observers' dict, or None when there are none (both paths)."""
    target.add_row(row)
    for sink in writer.row_sinks:
        sink(row, step)
    if not writer.observers:
        return None
    # a dict display: ~3x faster than dict(zip(RECORD_FIELDS, row))
    (seq, name, module, op, phase, direction, index, call, dtype, shape, numel, mn, mx, mean,
     norm, nan, posinf, neginf, zeros, checksum, source, offset, nbytes, strides) = row
    return {"seq": seq, "name": name, "module": module, "op": op, "phase": phase,
            "direction": direction, "index": index, "call": call, "dtype": dtype,
            "shape": shape, "numel": numel, "min": mn, "max": mx, "mean": mean, "norm": norm,
            "nan": nan, "posinf": posinf, "neginf": neginf, "zeros": zeros,
            "checksum": checksum, "source": source, "data_offset": offset,
            "data_nbytes": nbytes, "strides": strides, "step": step, "rank": writer.rank}
