"""The causes of a profile diff in words: every sentence `sleuth profile diff` says about why B
is slower (or faster), written here from the typed causes of profiler._diff_causes, last."""
from __future__ import annotations

from profiler._diff_causes import (Cause, GpuIdle, OutsideOps, Shapes, ShapeChange, Site,
                                   Tools)
from profiler._diff_pairs import SOURCE_SEP
from sleuth.common import short_path

SHOWN_SHAPES = 3
"""How many ops a shapes cause lists by name."""


def words(c: Cause) -> str:
    """One cause as a sentence."""
    if isinstance(c, Site):
        return _site(c)
    if isinstance(c, Shapes):
        return _shapes(c)
    if isinstance(c, OutsideOps):
        return _outside(c)
    if isinstance(c, GpuIdle):
        where = (f" on rank {c.rank} (the rank that got slower the most)"
                 if c.rank is not None else "")
        return f"GPU {c.figure}{where}: {c.us:+.4g} us a step ({c.a:.4g} -> {c.b:.4g} us)"
    if isinstance(c, Tools):
        return (f"Sleuth's own work inside the steps: {_us(c.us)} a step (the dump or summary "
                f"ran in {c.side}: compare runs profiled alike)")
    raise TypeError(f"no words for a cause of type {type(c).__name__}")


def _site(c: Site) -> str:
    if c.scope == "line":
        text = f"{short_source(c.source)}: {_us(c.us)} a step ({c.ops}{_side_words(c.side)})"
        if c.smaller is not None:
            text += (f"; its ops ran on smaller inputs, in more calls of less work each: "
                     f"{_change(c.smaller)}")
        for mod, site, calls_a, calls_b in c.new_sites:
            calls = (f" (calls {_n(calls_a)} -> {_n(calls_b)} a step)"
                     if calls_a == calls_a else "")
            text += f"; of its lines, {short_source(site)} calls {mod} in B only{calls}"
        return text
    if c.scope == "op":
        where = f" at {short_source(c.source)}" if c.source else ""
        inside = f" in {c.module}" if c.module else ""
        shapes = f", input shapes {c.shapes_a} -> {c.shapes_b}" if c.shapes_a else ""
        return (f"op {c.name}{inside}{where}: {_us(c.us)} a step, calls {_n(c.calls_a)} -> "
                f"{_n(c.calls_b)} a step{shapes}{_side_words(c.side)}")
    src = f", forward at {short_source(c.source)}" if c.source else ""
    kind = f" ({c.module_type}{src})" if c.module_type else ""
    return (f"module {c.name}{kind}: {_us(c.us)} a step (self time), calls {_n(c.calls_a)} -> "
            f"{_n(c.calls_b)}{_side_words(c.side)}")


def _change(s: ShapeChange) -> str:
    where = f" at {short_source(s.source)}" if s.source else ""
    return f"{s.name}{where} {s.shapes_a} -> {s.shapes_b}"


def _shapes(c: Shapes) -> str:
    shown = [f"{_change(s)} ({_us(s.us)})" for s in c.changes[:SHOWN_SHAPES]]
    more = (f"; and {len(c.changes) - SHOWN_SHAPES} more"
            if len(c.changes) > SHOWN_SHAPES else "")
    word = "larger" if c.larger else "smaller"
    return (f"the same ops on {word} inputs: {_us(c.us)} a step from {len(c.changes)} op(s) at "
            f"the same sites with other input shapes: {'; '.join(shown)}{more}")


def _outside(c: OutsideOps) -> str:
    where = ("in 'other' (the host between ops: Python work, a sleep, a sync, data loading)"
             if c.phase == "other" else f"mostly in '{c.phase}' ({_dur(c.phase_us)} a step "
             "there in the breakdown: Python work or waiting between its ops)")
    ops = (f"the ops' own time changed by {_us(c.ops_us)} a step" if abs(c.ops_us) >= 0.05
           else "the ops' own time did not change")
    if not c.stacks:
        line = ("no source line: time between ops has none without stacks; profile both runs "
                "with with_stack=true to name a sleep's or a blocking call's line")
    elif c.host is not None:
        from profiler._sources import builtin_token
        h = c.host
        line = (f"at {short_source(h.source)}: a call of {builtin_token(h.name) or h.name}(), "
                f"{_dur(h.us)} a step outside the ops it made (calls {_n(h.calls_a)} -> "
                f"{_n(h.calls_b)})")
        if c.unplaced:
            line += (f"; the other {_dur(c.rest_us)} a step is Python work between ops that "
                     "the trace names no line for")
    else:
        line = ("the trace names no source line for it: no builtin call (a sleep, a blocking "
                "read) explains it, so it is Python work between ops; open the trace at a "
                "step's gap")
    text = (f"time outside any op: {_dur(c.us)} a step {where}, not in any op ({c.share:.3g} % "
            f"of the change); {ops}; {line}")
    if c.new_calls_line:
        text += (f"; {short_source(c.new_calls_line)} made new calls, and the Python around "
                 "them runs between ops: likely most of this time")
    return text


def _side_words(side: str) -> str:
    return {"A only": "; in A only", "B only": "; in B only"}.get(side, "")


def short_source(source: str) -> str:
    """A source line as a user reads it, its path printed as the dump prints one
    (`sleuth.common.short_path`; each of several lines joined by SOURCE_SEP)."""
    if SOURCE_SEP in source:
        return SOURCE_SEP.join(short_source(s) for s in source.split(SOURCE_SEP))
    path, sep, line = source.rpartition(":")
    return f"{short_path(path)}:{line}" if sep and path else source


def _us(v: float) -> str:
    """A signed time in us, or in ms from 10 ms up (never as 1.933e+04 us)."""
    return f"{v / 1e3:+.4g} ms" if abs(v) >= 1e4 else f"{v:+.4g} us"


def _dur(us: float) -> str:
    """A signed time in us, or in ms from 1 ms up."""
    return f"{us / 1e3:+.4g} ms" if abs(us) >= 1e3 else _us(us)


def _n(v: float) -> str:
    return f"{v:.3g}"
