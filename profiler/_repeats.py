"""The repeats of a config that `profiler.diff_profiles` pools: read, and checked to be what they
claim, another run of the same config.

A repeat is there to measure how far runs of one config lie apart (the machine's speed drifting
between runs), so a repeat that is not one would give a false floor either way:

- the run itself (or a repeat given twice) counts the same steps again, measures a variation of
  0 and makes the test surer than its steps allow;
- a run of another script or config pools steps of other work and calls their difference the
  variation between runs;
- a run with no profiled steps adds nothing while the output lists it.

Each is refused with the option and the run it names. Calls a step do not move with the
machine's load, so a repeat must make the same ops as its side, call for call, within
`CALLS_TOLERANCE` of all calls (a data-dependent branch, a collective's retries).
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from profiler._errors import ProfileFormatError, ProfilerError

CALLS_TOLERANCE = 0.1
"""How far a repeat's op calls a step may differ from its side's (the summed differences by op
name, over the side's calls) and still be a run of the same config: 0.1, so an extra forward
(a sixth more calls) is another config."""


def as_list(repeats: Any) -> list[Any]:
    """`repeats` as a list: one run directory (a path or a Profile) given alone is one repeat,
    not a sequence of letters."""
    if repeats is None:
        return []
    if isinstance(repeats, (str, os.PathLike)) or hasattr(repeats, "steps"):
        return [repeats]
    return list(repeats)


def identity(x: Any) -> Any:
    """What two arguments share when they are one run: the real path of a run directory, or
    the Profile object itself."""
    if isinstance(x, (str, os.PathLike)):
        return os.path.realpath(os.fspath(x))
    return id(x)


def name(x: Any) -> str:
    return str(x) if isinstance(x, (str, os.PathLike)) else getattr(x, "name", "profile")


def read(x: Any) -> Any:
    """The Profile of a run directory, or `x` itself when it is one."""
    from profiler._reader import read_profile
    return read_profile(x) if isinstance(x, (str, os.PathLike)) else x


def read_repeats(option: str, side: str, base: Any, repeats: Sequence[Any],
                 taken: set[Any]) -> list[Any]:
    """The Profiles of `repeats` of side `side` ("A" or "B", whose profile is `base`), each
    checked; `taken` holds the identities of the runs already in the diff and gets theirs.

    Raises ProfilerError (ProfileFormatError for one that cannot be read) naming `option`
    (`--repeat-a`) and the run."""
    out = []
    for x in repeats:
        label = f"{option} {name(x)}"
        key = identity(x)
        if key in taken:
            raise ProfilerError(f"{label}: that run is already in this diff (A, B or another "
                                "repeat), and would count its steps twice; a repeat is the "
                                f"config of {side} profiled again, in another run directory")
        taken.add(key)
        try:
            p = read(x)
        except ProfilerError as e:
            raise type(e)(f"{label}: {e}") from e
        if p.steps.empty:
            raise ProfileFormatError(f"{label}: no profiled steps to pool (a trace without step "
                                     "ranges); profile the run again with steps recorded")
        mismatch = calls_mismatch(base, p)
        if mismatch:
            raise ProfilerError(f"{label} is not a run of {side}'s config: {mismatch}; a repeat "
                                f"is the script and config of {side} profiled again")
        out.append(p)
    return out


def calls_per_step(p: Any) -> dict[str, float]:
    """Op calls a step by op name (all ranks and windows over the profiled (rank, step) pairs)."""
    ops = p.ops
    if ops is None or ops.empty or "calls" not in ops:
        return {}
    n = max(1, len(p.steps))
    return {str(k): float(v) / n for k, v in ops.groupby("name")["calls"].sum().items()}


def calls_mismatch(base: Any, other: Any) -> str:
    """Why `other` makes other work than `base` a step, in words; "" when its calls a step are
    the same within CALLS_TOLERANCE."""
    a, b = calls_per_step(base), calls_per_step(other)
    total = sum(a.values())
    if total == 0:
        return "" if not b else "it makes op calls where its side makes none"
    moved = {k: b.get(k, 0.0) - a.get(k, 0.0) for k in set(a) | set(b)}
    share = sum(abs(v) for v in moved.values()) / total
    if share <= CALLS_TOLERANCE:
        return ""
    worst = sorted(moved, key=lambda k: -abs(moved[k]))[:3]
    shown = ", ".join(f"{k} {a.get(k, 0.0):.3g} -> {b.get(k, 0.0):.3g}" for k in worst)
    return (f"its op calls a step differ from its side's by {share * 100:.3g} % of that side's "
            f"calls ({shown} a step)")
