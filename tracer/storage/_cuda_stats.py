"""Statistics of a CUDA float32, bfloat16 or float16 tensor in two Triton kernel launches.

`device_stats` in plain torch ops queues about forty kernels per record (each statistic, its
casts, the stacking), and each launch costs the host time that a short GPU step cannot hide
(benchmarks/RESULTS.md, "The tracer on a GPU"). Here one pass over the elements computes every
statistic per block of elements, and a second launch combines the blocks' partials in a fixed
order, so the result is the same from run to run (no float atomics). The packed vector is
`device_stats`'s: min, max, mean and norm as float64 bits, then the NaN, +Inf, -Inf and zero
counts and the widened checksum.

Triton ships with torch's CUDA builds for Linux. Where it is missing, or its first compile
fails (it needs a C compiler for its launcher), `packed_stats` returns None and the caller
keeps the torch ops; that decision is taken once per process.
"""
from __future__ import annotations

import torch

# elements each program reads per loop turn, and loop turns per program
_BLOCK = 1024
_TURNS = 8
_PER_PROGRAM = _BLOCK * _TURNS
_BITS = {torch.float32: "int32", torch.bfloat16: "int16", torch.float16: "int16"}

_kernels = None  # (partials, combine) once built; False where Triton cannot be used


def _build():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["n"])
    def partials(x_ptr, n, part_f_ptr, part_i_ptr, BLOCK: tl.constexpr, TURNS: tl.constexpr,
                 INT: tl.constexpr):
        pid = tl.program_id(0)
        start = pid.to(tl.int64) * (BLOCK * TURNS)
        lo = tl.full([BLOCK], float("inf"), tl.float32)
        hi = tl.full([BLOCK], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK], tl.float64)
        squares = tl.zeros([BLOCK], tl.float64)
        nan = tl.zeros([BLOCK], tl.int32)
        posinf = tl.zeros([BLOCK], tl.int32)
        neginf = tl.zeros([BLOCK], tl.int32)
        zeros = tl.zeros([BLOCK], tl.int32)
        checksum = tl.zeros([BLOCK], tl.int64)
        for turn in tl.static_range(TURNS):
            offs = start + turn * BLOCK + tl.arange(0, BLOCK)
            inside = offs < n
            raw = tl.load(x_ptr + offs, mask=inside, other=0.0)
            checksum += raw.to(INT, bitcast=True).to(tl.int64)
            x = raw.to(tl.float32)
            lo = tl.minimum(lo, tl.where(inside, x, float("inf")))
            hi = tl.maximum(hi, tl.where(inside, x, float("-inf")))
            wide = x.to(tl.float64)
            total += wide
            squares += wide * wide
            nan += (x != x).to(tl.int32)
            posinf += (x == float("inf")).to(tl.int32)
            neginf += (x == float("-inf")).to(tl.int32)
            zeros += (inside & (x == 0.0)).to(tl.int32)
        base_f = part_f_ptr + pid * 4
        tl.store(base_f, tl.min(lo, axis=0))
        tl.store(base_f + 1, tl.max(hi, axis=0))
        tl.store(base_f + 2, tl.sum(total, axis=0))
        tl.store(base_f + 3, tl.sum(squares, axis=0))
        base_i = part_i_ptr + pid * 5
        tl.store(base_i, tl.sum(nan.to(tl.int64), axis=0))
        tl.store(base_i + 1, tl.sum(posinf.to(tl.int64), axis=0))
        tl.store(base_i + 2, tl.sum(neginf.to(tl.int64), axis=0))
        tl.store(base_i + 3, tl.sum(zeros.to(tl.int64), axis=0))
        tl.store(base_i + 4, tl.sum(checksum, axis=0))

    @triton.jit(do_not_specialize=["programs", "n"])
    def combine(part_f_ptr, part_i_ptr, programs, n, out_ptr, BLOCK: tl.constexpr):
        lo = tl.full([BLOCK], float("inf"), tl.float64)
        hi = tl.full([BLOCK], float("-inf"), tl.float64)
        total = tl.zeros([BLOCK], tl.float64)
        squares = tl.zeros([BLOCK], tl.float64)
        counts = tl.zeros([BLOCK, 8], tl.int64)
        col = tl.arange(0, 8)
        for first in range(0, programs, BLOCK):
            rows = first + tl.arange(0, BLOCK)
            inside = rows < programs
            lo = tl.minimum(lo, tl.load(part_f_ptr + rows * 4, mask=inside, other=float("inf")))
            hi = tl.maximum(hi, tl.load(part_f_ptr + rows * 4 + 1, mask=inside,
                                        other=float("-inf")))
            total += tl.load(part_f_ptr + rows * 4 + 2, mask=inside, other=0.0)
            squares += tl.load(part_f_ptr + rows * 4 + 3, mask=inside, other=0.0)
            counts += tl.load(part_i_ptr + rows[:, None] * 5 + col[None, :],
                              mask=inside[:, None] & (col[None, :] < 5), other=0)
        summed = tl.sum(counts, axis=0)  # nan, +inf, -inf, zeros, checksum, then padding
        nan = tl.sum(tl.where(col == 0, summed, 0), axis=0)
        floats = tl.where(col == 0, tl.min(lo, axis=0), 0.0)
        floats = tl.where(col == 1, tl.max(hi, axis=0), floats)
        floats = tl.where(col == 2, tl.sum(total, axis=0) / n.to(tl.float64), floats)
        floats = tl.where(col == 3, tl.sqrt(tl.sum(squares, axis=0)), floats)
        # min, max, mean and norm are NaN where any element is (as the CPU path gives them)
        floats = tl.where(nan > 0, float("nan"), floats)
        tl.store(out_ptr + col, floats.to(tl.int64, bitcast=True), mask=col < 4)
        tl.store(out_ptr + 4 + col, summed, mask=col < 5)

    return partials, combine


def packed_stats(flat: torch.Tensor) -> torch.Tensor | None:
    """`device_stats`'s packed vector for `flat`, a contiguous 1-D CUDA tensor of float32,
    bfloat16 or float16 with elements; None where Triton cannot compute it here."""
    global _kernels
    if _kernels is False or flat.dtype not in _BITS:
        return None
    try:
        with torch.cuda.device(flat.device):
            return launch(flat)
    except Exception:  # noqa: BLE001 - no Triton, or no compiler for it: torch ops instead
        _kernels = False
        return None


def launch(flat: torch.Tensor) -> torch.Tensor:
    """Queue both kernels on `flat`'s device (the current stream) and return the packed
    vector there (Triton's interpreter runs them on CPU tensors, for tests)."""
    global _kernels
    import triton.language as tl

    if not _kernels:
        _kernels = _build()
    partials, combine = _kernels
    n = flat.numel()
    programs = -(-n // _PER_PROGRAM)
    scratch = torch.empty(programs * 9 + 9, dtype=torch.int64, device=flat.device)
    part_f = scratch[: programs * 4].view(torch.float64)
    part_i = scratch[programs * 4: programs * 9]
    out = scratch[programs * 9:]
    partials[(programs,)](flat, n, part_f, part_i, BLOCK=_BLOCK, TURNS=_TURNS,
                          INT=getattr(tl, _BITS[flat.dtype]))
    combine[(1,)](part_f, part_i, programs, n, out, BLOCK=256)
    return out
