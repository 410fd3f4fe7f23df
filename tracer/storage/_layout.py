"""How a record's element strides lay its elements over stored bytes (docs/dump-format.md,
`strides`): pure functions over shape and stride tuples, shared by the capture side (tensors)
and by the reader and the diff, which never import torch."""
from __future__ import annotations


def stored_extent(shape: tuple[int, ...], strides: tuple[int, ...]) -> int:
    """How many elements of stored bytes a record with these element `strides` reads, from its
    first element to its last: `numel` for C order or a dense permutation, more for a slice
    with gaps, fewer for an expansion (stride 0). 0 for a tensor without elements."""
    if any(n == 0 for n in shape):
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(shape, strides))


def dense_strides(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """True when these strides read exactly `numel` consecutive elements, each once (C order,
    or a transpose or permutation of a dense block): the elements then fill their memory in
    memory order, with no gaps."""
    if len(shape) == 2:  # a matrix (a transposed weight, on the record path): no sort
        (n0, n1), (s0, s1) = shape, strides
        if n0 > 1 and n1 > 1:
            return (s1 == 1 and s0 == n1) or (s0 == 1 and s1 == n0)
    expected = 1
    # dims by stride; the order among equal strides does not change the answer (two dims of
    # one stride pass only where the stride and `expected` are both 0)
    for s, n in sorted([(s, n) for n, s in zip(shape, strides) if n != 1]):
        if s != expected:
            return False
        expected *= n
    return True
