"""Downsampling for display: keep each bucket's minimum and maximum so spikes (and NaN gaps)
survive, and cut the visible x window out of a full-resolution series when the user zooms.

A browser draws a few thousand points per trace smoothly; a run logs millions. Nothing is
capped on disk or in memory: figures ask for the window they show, at the resolution they can
draw, and a zoom asks again (full resolution once the window holds few enough points).
"""
from __future__ import annotations

import numpy as np

DEFAULT_POINTS = 2000
"""Points per trace after downsampling (two per bucket: its minimum and its maximum)."""


def minmax_indices(y: np.ndarray, max_points: int = DEFAULT_POINTS) -> np.ndarray:
    """Sorted indices of at most about `max_points` samples of `y` that keep every bucket's
    minimum and maximum, plus the first and last sample.

    NaN wins both the min and the max of its bucket (numpy's argmin/argmax return the first
    NaN), so a NaN in the data shows as a gap in the line instead of vanishing.
    """
    n = len(y)
    if n <= max_points:
        return np.arange(n)
    buckets = max(1, max_points // 2)
    size = -(-n // buckets)  # ceil: full buckets of `size`, the last one shorter
    full = (n // size) * size
    body = y[:full].reshape(-1, size)
    starts = np.arange(0, full, size)
    picks = [starts + body.argmin(axis=1), starts + body.argmax(axis=1)]
    if full < n:
        tail = y[full:]
        picks.append(np.array([full + tail.argmin(), full + tail.argmax()]))
    picks.append(np.array([0, n - 1]))
    return np.unique(np.concatenate(picks))


def window(x: np.ndarray, lo: float | None, hi: float | None) -> slice:
    """The slice of sorted `x` inside [lo, hi], widened by one sample on each side so the line
    runs to the edges of the plot."""
    start = 0 if lo is None else max(0, int(np.searchsorted(x, lo, side="left")) - 1)
    stop = len(x) if hi is None else min(len(x), int(np.searchsorted(x, hi, side="right")) + 1)
    return slice(start, max(start, stop))


def downsample(x: np.ndarray, y: np.ndarray, *, lo: float | None = None, hi: float | None = None,
               max_points: int = DEFAULT_POINTS) -> tuple[np.ndarray, np.ndarray]:
    """`(x, y)` restricted to the window [lo, hi] of sorted `x` and min/max-downsampled to
    about `max_points`; returned unchanged (full resolution) when the window holds fewer."""
    s = window(x, lo, hi)
    xs, ys = x[s], y[s]
    idx = minmax_indices(ys, max_points)
    if len(idx) == len(ys):
        return xs, ys
    return xs[idx], ys[idx]
