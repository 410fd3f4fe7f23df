"""The Triton kernels of tracer.storage._batched_stats (its docstring says what they compute).

Imported only when first used, and imported again where `TRITON_INTERPRET` changed since: Triton
decides at decoration time whether a kernel is compiled or interpreted.
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
"""Whether these kernels run in Triton's interpreter (on CPU tensors)."""


# Reductions are written as tl.reduce over Triton's own combine functions: tl.sum, tl.min and
# tl.max are library functions made compiled or interpreted when triton is first imported (a test
# process may import it before it sets TRITON_INTERPRET), while tl.reduce is a builtin, and the
# interpreter reduces these combine functions with numpy at once, not element by element
_add = tl.standard._sum_combine
_min = tl.standard._elementwise_min
_max = tl.standard._elementwise_max


@triton.jit
def offsets(idx, contiguous, s1, s2, s3, t0, t1, t2, t3):
    # C-order element index -> element offset from element 0, through the view's strides
    if contiguous != 0:
        out = idx
    else:
        i3 = idx % s3
        q = idx // s3
        i2 = q % s2
        q = q // s2
        out = (q // s1) * t0 + (q % s1) * t1 + i2 * t2 + i3 * t3
    return out


@triton.jit
def value(raw, KIND: tl.constexpr, VALUE: tl.constexpr, WIDE: tl.constexpr):
    # the element's value in the dtype statistics are taken in (float32 for floats of 32
    # bits or fewer, float64 for float64 and integers: what device_stats casts to)
    if KIND == 0:
        out = raw.to(VALUE, bitcast=True).to(WIDE)
    elif KIND == 1:
        out = raw.to(tl.float64)
    elif KIND == 2:
        out = raw.to(tl.uint8, bitcast=True).to(tl.float64)
    elif KIND == 4:
        # float8_e4m3fn: no infinities, NaN is S.1111.111; NaN (and e5m2's infinities) are
        # read from the bits: not every conversion (Triton's interpreter) maps them
        out = tl.where((raw & 0x7F) == 0x7F, float("nan"),
                       raw.to(VALUE, bitcast=True).to(WIDE))
    elif KIND == 5:
        # float8_e5m2: S.11111.00 is an infinity, S.11111.xx else NaN
        mag = raw & 0x7F
        out = tl.where(mag > 0x7C, float("nan"),
                       tl.where(mag == 0x7C, tl.where(raw < 0, float("-inf"), float("inf")),
                                raw.to(VALUE, bitcast=True).to(WIDE)))
    else:
        out = (raw != 0).to(tl.float64)
    return out


@triton.jit(do_not_specialize=["records", "pid_base"])
def partials(table_ptr, part_ptr, out_ptr, records, pid_base,
             RAW: tl.constexpr, KIND: tl.constexpr, VALUE: tl.constexpr,
             WIDE: tl.constexpr, RECS: tl.constexpr, BLOCK: tl.constexpr,
             TURNS: tl.constexpr, SKETCH: tl.constexpr, WIDTH: tl.constexpr,
             FIELDS: tl.constexpr):
    pid = pid_base + tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, RECS)
    starts = tl.load(table_ptr + rows * FIELDS + 2, mask=rows < records, other=4611686018427387904)
    rec = tl.reduce((starts <= pid).to(tl.int32), 0, _add) - 1
    row = table_ptr + rec.to(tl.int64) * FIELDS
    base = tl.load(row).to(tl.pointer_type(RAW))
    n = tl.load(row + 1)
    local = pid - tl.load(row + 2)
    programs = tl.load(row + 3)
    contiguous = tl.load(row + 4)
    s1 = tl.load(row + 5)
    s2 = tl.load(row + 6)
    s3 = tl.load(row + 7)
    t0 = tl.load(row + 8)
    t1 = tl.load(row + 9)
    t2 = tl.load(row + 10)
    t3 = tl.load(row + 11)
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    lo = tl.full([BLOCK], float("inf"), WIDE)
    hi = tl.full([BLOCK], float("-inf"), WIDE)
    total = tl.full([BLOCK], 0, tl.float64)
    squares = tl.full([BLOCK], 0, tl.float64)
    nan = tl.full([BLOCK], 0, tl.int32)
    posinf = tl.full([BLOCK], 0, tl.int32)
    neginf = tl.full([BLOCK], 0, tl.int32)
    zeros = tl.full([BLOCK], 0, tl.int32)
    checksum = tl.full([BLOCK], 0, tl.int64)
    chunks = (n + BLOCK * TURNS - 1) // (BLOCK * TURNS)
    for chunk in range(local, chunks, programs):
        for turn in tl.static_range(TURNS):
            idx = chunk * (BLOCK * TURNS) + turn * BLOCK + lanes
            inside = idx < n
            where = offsets(idx, contiguous, s1, s2, s3, t0, t1, t2, t3)
            raw = tl.load(base + where, mask=inside, other=0)
            checksum += raw.to(tl.int64)
            x = value(raw, KIND, VALUE, WIDE)
            lo = tl.minimum(lo, tl.where(inside, x, float("inf")))
            hi = tl.maximum(hi, tl.where(inside, x, float("-inf")))
            wide = x.to(tl.float64)
            total += wide
            squares += wide * wide
            if KIND == 0 or KIND >= 4:
                nan += (x != x).to(tl.int32)
                posinf += (x == float("inf")).to(tl.int32)
                neginf += (x == float("-inf")).to(tl.int32)
            zeros += (inside & (x == 0)).to(tl.int32)
    part = part_ptr + pid * 9
    tl.store(part, tl.reduce(lo, 0, _min).to(tl.float64).to(tl.int64, bitcast=True))
    tl.store(part + 1, tl.reduce(hi, 0, _max).to(tl.float64).to(tl.int64, bitcast=True))
    tl.store(part + 2, tl.reduce(total, 0, _add).to(tl.int64, bitcast=True))
    tl.store(part + 3, tl.reduce(squares, 0, _add).to(tl.int64, bitcast=True))
    tl.store(part + 4, tl.reduce(nan.to(tl.int64), 0, _add))
    tl.store(part + 5, tl.reduce(posinf.to(tl.int64), 0, _add))
    tl.store(part + 6, tl.reduce(neginf.to(tl.int64), 0, _add))
    tl.store(part + 7, tl.reduce(zeros.to(tl.int64), 0, _add))
    tl.store(part + 8, tl.reduce(checksum, 0, _add))
    if SKETCH:
        if local == 0:
            # tracer.storage._sketch.positions, here: one element in each of SKETCH_SIZE
            # equal slices at a hashed offset (every element of a smaller tensor)
            j = tl.arange(0, 128).to(tl.int64)
            slice_lo = j * n // 128
            width = (j + 1) * n // 128 - slice_lo
            mixed = (tl.full([128], 0, tl.uint64) + n.to(tl.uint64)) * 0x9E3779B97F4A7C15
            mixed = mixed + j.to(tl.uint64)
            mixed = (mixed ^ (mixed >> 30)) * 0xBF58476D1CE4E5B9
            mixed = (mixed ^ (mixed >> 27)) * 0x94D049BB133111EB
            mixed = mixed ^ (mixed >> 31)
            pick = (mixed % tl.maximum(width, 1).to(tl.uint64)).to(tl.int64)
            pos = tl.where(n > 128, slice_lo + pick, j)
            valid = pos < n
            where = offsets(pos, contiguous, s1, s2, s3, t0, t1, t2, t3)
            raw = tl.load(base + where, mask=valid, other=0)
            sampled = value(raw, KIND, VALUE, WIDE).to(tl.float64)
            sampled = tl.where(valid, sampled, float("nan"))
            slot = tl.load(row + 12)
            tl.store(out_ptr + slot * WIDTH + 9 + j, sampled.to(tl.int64, bitcast=True))


@triton.jit
def combine(table_ptr, part_ptr, out_ptr, WIDTH: tl.constexpr, FIELDS: tl.constexpr,
            BLOCK: tl.constexpr):
    row = table_ptr + tl.program_id(0).to(tl.int64) * FIELDS
    n = tl.load(row + 1)
    first = tl.load(row + 2)
    programs = tl.load(row + 3)
    slot = tl.load(row + 12)
    lo = tl.full([BLOCK], float("inf"), tl.float64)
    hi = tl.full([BLOCK], float("-inf"), tl.float64)
    total = tl.full([BLOCK], 0, tl.float64)
    squares = tl.full([BLOCK], 0, tl.float64)
    counts = tl.full([BLOCK, 8], 0, tl.int64)
    col = tl.arange(0, 8)
    for start in range(0, programs, BLOCK):
        k = start + tl.arange(0, BLOCK)
        inside = k < programs
        part = part_ptr + (first + k) * 9
        lo = tl.minimum(lo, tl.load(part, mask=inside, other=0x7FF0000000000000)
                        .to(tl.float64, bitcast=True))
        hi = tl.maximum(hi, tl.load(part + 1, mask=inside, other=-0x10000000000000)
                        .to(tl.float64, bitcast=True))
        total += tl.load(part + 2, mask=inside, other=0).to(tl.float64, bitcast=True)
        squares += tl.load(part + 3, mask=inside, other=0).to(tl.float64, bitcast=True)
        counts += tl.load(part[:, None] + 4 + col[None, :],
                          mask=inside[:, None] & (col[None, :] < 5), other=0)
    summed = tl.reduce(counts, 0, _add)  # nan, +inf, -inf, zeros, checksum, then padding
    nan = tl.reduce(tl.where(col == 0, summed, 0), 0, _add)
    floats = tl.where(col == 0, tl.reduce(lo, 0, _min), 0.0)
    floats = tl.where(col == 1, tl.reduce(hi, 0, _max), floats)
    floats = tl.where(col == 2, tl.reduce(total, 0, _add) / n.to(tl.float64), floats)
    floats = tl.where(col == 3, tl.sqrt(tl.reduce(squares, 0, _add)), floats)
    # min, max, mean and norm are NaN where any element is (as device_stats gives them)
    floats = tl.where(nan > 0, float("nan"), floats)
    out = out_ptr + slot * WIDTH
    tl.store(out + col, floats.to(tl.int64, bitcast=True), mask=col < 4)
    tl.store(out + 4 + col, summed, mask=col < 5)
