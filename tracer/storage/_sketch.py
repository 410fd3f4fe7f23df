"""Sketches: a few of a record's elements, at positions both runs of a diff pick alike, kept in
statistics mode so that a diff sees the order of the elements (docs/dump-format.md, /sketches).

The statistics of a record (min, max, mean, norm, counts, checksum) do not change when its
elements move, so a permutation bug (two attention heads swapped, a transposed reshape) has
the statistics of the right result, and a statistics diff said "same" on it. A sketch is the
values of SKETCH_SIZE elements of the tensor taken in C order: element j of the sketch lies in
the j-th of SKETCH_SIZE equal slices of the tensor, at an offset in it that a hash of (numel,
j) picks (every element when the tensor has fewer). Positions depend on the element count
alone, not on the record's name, so two records with as many elements sample the same
positions, in one codebase or in two. A diff then compares two sketches element by element
with the tolerance of the full comparison: a sampled element out of tolerance is a real one.

Nothing here imports torch: the reader and the diff compute positions too.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

SKETCH_SIZE = 128
"""Elements in a sketch (stored as float32, which holds every float of 32 bits or fewer
exactly: 512 bytes a record)."""
SCHEME = "stratified-splitmix64-128"
"""The position rule, stored with the dump (root attribute `sketch_scheme`): sketches of two
dumps compare only when their schemes are equal."""

_GOLDEN = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over uint64 values (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@lru_cache(maxsize=4096)
def positions(numel: int) -> np.ndarray:  # exported as tracer.storage.sketch_positions
    """The C-order element positions a sketch of a tensor of `numel` elements samples, in
    increasing order: all of them below SKETCH_SIZE, else one in each of SKETCH_SIZE equal
    slices. Read-only; the same for every run, machine and version of this scheme."""
    n, k = int(numel), SKETCH_SIZE
    if n <= k:
        out = np.arange(n, dtype=np.int64)
    else:
        j = np.arange(k, dtype=np.int64)
        lo = j * n // k
        width = (j + 1) * n // k - lo  # >= 1: n > k
        seed = np.uint64((n * _GOLDEN) & _MASK)
        pick = _mix(j.astype(np.uint64) + seed) % width.astype(np.uint64)
        out = lo + pick.astype(np.int64)
    out.flags.writeable = False
    return out


@lru_cache(maxsize=4096)
def offsets(shape: tuple[int, ...], strides: tuple[int, ...]) -> bytes:
    """The sampled elements' offsets in memory from element 0 (in elements), for a tensor of
    this shape laid out with these strides, as SKETCH_SIZE int64 (-1 past the last element of
    a smaller tensor): what the C kernel's `sample` reads."""
    n = 1
    for d in shape:
        n *= int(d)
    where = np.full(SKETCH_SIZE, -1, dtype=np.int64)
    pos = positions(n)
    if len(pos):
        if len(shape):
            index = np.unravel_index(pos, tuple(int(d) for d in shape))
            where[:len(pos)] = sum(i.astype(np.int64) * int(s) for i, s in zip(index, strides))
        else:
            where[0] = 0
    return where.tobytes()


def row_of(table: np.ndarray | None, row: int) -> np.ndarray | None:
    """Row `row` of a /sketches array: that record's sketch, or None when the step kept none
    or the record has none (a row of NaN)."""
    if table is None or not 0 <= row < len(table):
        return None
    values = table[row]
    return None if np.isnan(values).all() else values


def padded(values: np.ndarray) -> np.ndarray:
    """Sampled values (float64, at most SKETCH_SIZE) as a sketch: NaN after the last."""
    out = np.full(SKETCH_SIZE, np.nan)
    out[:len(values)] = values
    return out


def from_array(values: np.ndarray) -> np.ndarray:
    """The sketch of an array in C order (any numeric numpy array; the reader's and the
    tests' way to a sketch from stored elements)."""
    flat = np.asarray(values).reshape(-1)
    return padded(flat[positions(flat.size)].astype(np.float64))


@np.errstate(invalid="ignore", over="ignore")  # as a decorator: a third of the `with`'s cost
def difference(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The sketch of the float32 difference a - b from the sketches of float32 tensors `a` and
    `b`: the same positions, each element rounded as float32 subtraction rounds it."""
    return np.subtract(a, b, dtype=np.float32).astype(np.float64)


sketch_positions = positions
sketch_row = row_of
