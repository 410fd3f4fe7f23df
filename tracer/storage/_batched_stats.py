"""Statistics and sketches of many device tensors in one multi-tensor kernel launch.

A record's statistics on a GPU cost host time, not device time: each kernel launch and each
staging copy is tens of microseconds of Python and driver work, while reading a recorded tensor
once from HBM takes a fraction of that. So the records of a step are described in a table
(one row each: the address of element 0, the element count, the collapsed sizes and strides of
a view, the row it fills in the output slab) and one launch per dtype covers every record of
that dtype in the batch; each program of the launch finds its record by a search over the
table's program column, reads its share of that record's elements (in C order, through the
strides: a view or a slice is never copied) and writes one row of partial statistics. The
first program of each record also gathers the record's sketch (tracer.storage._sketch: the
positions come from a splitmix64 hash of the element count, computed in the kernel). One
combine launch then reduces each record's partials in a fixed order, so the result is the same
from run to run (no float atomics), into the output slab: per record the packed vector of
`device_stats` (min, max, mean and norm as float64 bits, the NaN, +Inf, -Inf and zero counts,
the checksum widened to int64) followed by the sketch's float64 bits. `decode` turns the slab,
copied to the host once, into the statistics dicts `decode_packed` gives.

Agreement with the torch-op reference (`device_stats` with Triton switched off): min, max,
counts, checksum and sketch exactly; mean and norm to float64 rounding (the sums are taken in
float64 in another order; docs/tracer.md, "Statistics on a GPU").

Under `TRITON_INTERPRET=1` the same kernels run on CPU tensors (the tests); the kernels are
built for whichever mode the environment names when they are first used.
"""
from __future__ import annotations

import os
import struct
from typing import Any, NamedTuple

import numpy as np
import torch

from tracer.storage._sketch import SKETCH_SIZE

# elements each program reads per loop turn, loop turns per chunk; a record of n elements has
# ceil(n / CHUNK) chunks, spread over at most _MAX_PROGRAMS programs (each takes every
# programs-th chunk, in order)
BLOCK = 1024
TURNS = 8
_MAX_PROGRAMS = 512
_DIMS = 4  # a view's dimensions after collapsing; a view with more is copied first
_FIELDS = 16  # int64 columns of a table row
_STATS = 9  # the packed vector: 4 float64 bits, 4 counts, the checksum
_COMBINE_BLOCK = 128
_GOLDEN = 0x9E3779B97F4A7C15

# table columns; _DTYPE is the host's (the record's dtype code), the kernels do not read it
_ADDR, _NUMEL, _FIRST, _PROGRAMS, _CONTIGUOUS, _S1, _S2, _S3, _T0, _T1, _T2, _T3, _SLOT, _DTYPE = \
    range(14)
_ROW = struct.Struct(f"<{_DTYPE + 1}q")  # columns _ADDR.._DTYPE of one row, as numpy lays them

# dtype -> (its raw bits' Triton type, how a value is read from them, its value type)
# kinds: 0 a float (bitcast), 1 a signed integer, 2 uint8, 3 bool, 4 float8_e4m3fn,
# 5 float8_e5m2
_KINDS: dict[torch.dtype, tuple[str, int, str]] = {
    torch.float32: ("int32", 0, "float32"),
    torch.float16: ("int16", 0, "float16"),
    torch.bfloat16: ("int16", 0, "bfloat16"),
    torch.float64: ("int64", 0, "float64"),
    torch.int64: ("int64", 1, "int64"),
    torch.int32: ("int32", 1, "int32"),
    torch.int16: ("int16", 1, "int16"),
    torch.int8: ("int8", 1, "int8"),
    torch.uint8: ("int8", 2, "uint8"),
    torch.bool: ("int8", 3, "int8"),
}
for _name, _kind, _tl_name in (("float8_e4m3fn", 4, "float8e4nv"), ("float8_e5m2", 5, "float8e5")):
    if hasattr(torch, _name):
        _KINDS[getattr(torch, _name)] = ("int8", _kind, _tl_name)
DTYPES = frozenset(_KINDS)
"""The dtypes the kernel reads."""
_CODES = {d: i for i, d in enumerate(_KINDS)}
_BY_CODE = tuple(_KINDS)
_WIDTH_BITS = {d: (8 if d == torch.bool else d.itemsize * 8) for d in _KINDS}

def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def kernels() -> tuple[Any, Any]:
    """The two kernels (for the interpreter when TRITON_INTERPRET is set); raises ImportError
    where Triton is missing."""
    import importlib

    from tracer.storage import _batched_kernels as module

    if module.INTERPRETED != _interpreted():
        module = importlib.reload(module)
    return module.partials, module.combine


def supported(t: torch.Tensor) -> bool:
    """Whether the kernel reads `t`: a strided tensor with elements, of a dtype it knows (not
    complex, not a float8 variant other than e4m3fn and e5m2), whose memory holds its values
    (no negative view)."""
    return t.dtype in _KINDS and t.layout is torch.strided and t.numel() > 0 \
        and not t.is_neg()


_LAYOUTS: dict[tuple, tuple | None] = {}
_DENSE = (1, 1, 1, 1, 0, 0, 0, 1)


def layout(shape: tuple, strides: tuple) -> tuple | None:
    """(contiguous, s1, s2, s3, t0, t1, t2, t3) of a view: its dimensions of size 1 dropped and
    neighbours that step evenly merged, padded in front to four; None where more than four
    are left (the caller copies such a view). Cached: a step repeats a few layouts."""
    key = (shape, strides)
    found = _LAYOUTS.get(key, False)
    if found is not False:
        return found
    dims: list[list[int]] = []
    for size, stride in zip(shape, strides):
        if size == 1:
            continue
        if dims and dims[-1][1] == stride * size:
            dims[-1] = [dims[-1][0] * size, stride]
        else:
            dims.append([size, stride])
    if not dims or (len(dims) == 1 and dims[0][1] == 1):
        out: tuple | None = _DENSE
    elif len(dims) > _DIMS:
        out = None
    else:
        dims = [[1, 0]] * (_DIMS - len(dims)) + dims
        out = (0, dims[1][0], dims[2][0], dims[3][0], *(d[1] for d in dims))
    if len(_LAYOUTS) < 65536:
        _LAYOUTS[key] = out
    return out


def width(sketch: bool) -> int:
    """int64 words per record in the output slab."""
    return _STATS + (SKETCH_SIZE if sketch else 0)


class Descriptor(NamedTuple):
    """What the kernel needs of one record: the address of its element 0, its element count,
    dtype and `layout`."""

    address: int
    numel: int
    dtype: torch.dtype
    layout: tuple


def describe(t: torch.Tensor) -> Descriptor | None:
    """`t`'s descriptor, or None where its view has more than four dimensions after
    collapsing (copy it first). `t` is `supported`."""
    found = layout(tuple(t.shape), t.stride())
    if found is None:
        return None
    return Descriptor(t.data_ptr(), t.numel(), t.dtype, found)


class Table:
    """The kernel's table for one batch, preallocated: each record writes its row (address,
    element count, `layout`, slab row, dtype) into it when it is made, one packing call and no
    object of its own; `grouped` orders the rows by dtype for the launches. Reused from batch
    to batch (`clear`): `grouped` copies what a launch reads."""

    __slots__ = ("_buf", "count", "rows")

    def __init__(self, capacity: int) -> None:
        self.rows = np.zeros((max(1, capacity), _FIELDS), dtype=np.int64)
        self._buf = memoryview(self.rows).cast("B")
        self.count = 0
        """Rows written: record i fills slab row i."""

    @classmethod
    def of(cls, descriptors: list[Descriptor]) -> Table:
        """A table holding `descriptors`' rows, in their order."""
        tab = cls(len(descriptors))
        for d in descriptors:
            tab._write(d.address, d.numel, d.layout, d.dtype)
        return tab

    def append(self, t: torch.Tensor, shape: tuple) -> bool:
        """Write `t`'s row (`shape`: its shape, as a tuple); False, with nothing written, where
        its view has more than four dimensions after collapsing (copy it first). `t` is
        `supported` and the table not full."""
        found = layout(shape, t.stride())
        if found is None:
            return False
        self._write(t.data_ptr(), t.numel(), found, t.dtype)
        return True

    def _write(self, address: int, numel: int, found: tuple, dtype: torch.dtype) -> None:
        i = self.count
        _ROW.pack_into(self._buf, i * _FIELDS * 8, address, numel, 0, 0, *found, i,
                       _CODES[dtype])
        self.count = i + 1

    def clear(self) -> None:
        self.count = 0

    def dtypes(self) -> list[torch.dtype]:
        """The dtype of each row, in row (slab) order."""
        return [_BY_CODE[c] for c in self.rows[:self.count, _DTYPE].tolist()]

    def grouped(self, *, block: int = BLOCK, turns: int = TURNS
                ) -> tuple[np.ndarray, list[tuple[torch.dtype, int, int, int]], int]:
        """A copy of the rows grouped by dtype (in row order within a dtype), with each row's
        programs and first program filled in; per dtype (dtype, first row, rows, first partial
        row); and the partial rows in all. Numpy only: no device work."""
        count = self.count
        if not count:
            return np.zeros((0, _FIELDS), dtype=np.int64), [], 0
        rows = self.rows[:count]
        order = np.argsort(rows[:, _DTYPE], kind="stable")
        tab = rows[order]
        programs = np.minimum(-(-tab[:, _NUMEL] // (block * turns)), _MAX_PROGRAMS)
        tab[:, _PROGRAMS] = programs
        first = np.cumsum(programs) - programs
        tab[:, _FIRST] = first
        codes = tab[:, _DTYPE]
        starts = np.flatnonzero(np.concatenate(([True], codes[1:] != codes[:-1]))).tolist()
        ends = starts[1:] + [count]
        groups = [(_BY_CODE[int(codes[a])], a, b - a, int(first[a])) for a, b in zip(starts, ends)]
        return tab, groups, int(programs.sum())


def table(descriptors: list[Descriptor], *, block: int = BLOCK, turns: int = TURNS
          ) -> tuple[np.ndarray, list[tuple[torch.dtype, int, int, int]], int]:
    """`Table.grouped` of a table holding `descriptors` (record i fills slab row i)."""
    return Table.of(descriptors).grouped(block=block, turns=turns)


def launch(records: Table | list[Descriptor], device: torch.device, sketch: bool, *,
           block: int = BLOCK, turns: int = TURNS) -> torch.Tensor:
    """Queue the statistics of `records` (a `Table`, or descriptors) on `device`'s current
    stream: one partials launch per dtype, one combine launch; returns the output slab there
    (int64, one row of `width(sketch)` words per record, in row order). The tensors they
    describe must stay alive until this returns (the kernels then run in stream order before
    any later use of their memory). The table goes to the device through pinned memory on
    CUDA; with Triton's interpreter everything stays on the CPU."""
    import triton.language as tl

    partials, combine = kernels()
    if not isinstance(records, Table):
        records = Table.of(records)
    tab, groups, programs = records.grouped(block=block, turns=turns)
    count = len(tab)
    words = width(sketch)
    scratch = torch.empty(count * _FIELDS + programs * 9 + count * words, dtype=torch.int64,
                          device=device)
    dev_table = scratch[:count * _FIELDS].view(count, _FIELDS)
    part = scratch[count * _FIELDS: count * _FIELDS + programs * 9]
    out = scratch[count * _FIELDS + programs * 9:].view(count, words)
    host = torch.from_numpy(tab)
    if device.type == "cuda":
        host = host.pin_memory()
    dev_table.copy_(host, non_blocking=True)
    for dtype, row, rows, pid_base in groups:
        raw, kind, value_type = _KINDS[dtype]
        wide = "float32" if kind in (0, 4, 5) and dtype != torch.float64 else "float64"
        sub = dev_table[row:row + rows]
        group_programs = int(tab[row:row + rows, _PROGRAMS].sum())
        partials[(group_programs,)](
            sub, part, out, rows, pid_base, RAW=getattr(tl, raw), KIND=kind,
            VALUE=getattr(tl, value_type), WIDE=getattr(tl, wide),
            RECS=max(2, 1 << (rows - 1).bit_length()), BLOCK=block, TURNS=turns,
            SKETCH=sketch, WIDTH=words, FIELDS=_FIELDS)
    combine[(count,)](dev_table, part, out, WIDTH=words, FIELDS=_FIELDS,
                      BLOCK=_COMBINE_BLOCK)
    return out


def _wrap(values: np.ndarray, bits: np.ndarray) -> np.ndarray:
    """Each int64 wrapped into a signed integer of its width in bits (two's complement)."""
    out = values.copy()
    narrow = bits < 64
    if narrow.any():
        b = bits[narrow].astype(np.uint64)
        v = values[narrow].view(np.uint64) & ((np.uint64(1) << b) - np.uint64(1))
        sign = (v >> (b - np.uint64(1))) & np.uint64(1)
        out[narrow] = v.astype(np.int64) - (sign.astype(np.int64) << b.astype(np.int64))
    return out


def decode(slab: np.ndarray, dtypes: list[torch.dtype]) -> list[dict]:
    """The statistics dicts (`decode_packed`'s: STAT_FIELDS, and "sketch" where the slab has
    one) of an output slab copied to the host, one per row; `dtypes` are the records'."""
    from tracer.storage._stat_fields import STAT_FIELDS

    slab = np.ascontiguousarray(slab, dtype=np.int64)
    floats = slab[:, :4].view(np.float64).tolist()
    bits = np.array([_WIDTH_BITS[d] for d in dtypes], dtype=np.int64)
    checksums = _wrap(slab[:, 8], bits).tolist()
    counts = slab[:, 4:8].tolist()
    sketches = slab[:, _STATS:].view(np.float64) if slab.shape[1] > _STATS else None
    out = []
    names = STAT_FIELDS
    for i in range(len(slab)):
        f, c = floats[i], counts[i]
        row = {names[0]: f[0], names[1]: f[1], names[2]: f[2], names[3]: f[3],
               "nan": c[0], "posinf": c[1], "neginf": c[2], "zeros": c[3],
               "checksum": checksums[i]}
        if sketches is not None:
            row["sketch"] = sketches[i].copy()
        out.append(row)
    return out
