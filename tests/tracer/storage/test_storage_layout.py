"""tracer.storage._layout: how strides lay a record's elements over stored bytes."""
from __future__ import annotations

import itertools

from tracer.storage._layout import dense_strides


def test_dense_strides_is_exactly_a_dense_block():
    """dense_strides (the plain-record check, with its shortcut for a matrix) says True exactly
    when the strides read each of `numel` consecutive elements once, for every small shape and
    stride."""
    for ndim in range(4):
        for shape in itertools.product((1, 2, 3), repeat=ndim):
            for strides in itertools.product((0, 1, 2, 3, 4, 6, 9), repeat=ndim):
                offsets = sorted(sum(i * s for i, s in zip(index, strides))
                                 for index in itertools.product(*(range(n) for n in shape)))
                expected = offsets == list(range(len(offsets)))
                assert dense_strides(shape, strides) == expected, (shape, strides)
