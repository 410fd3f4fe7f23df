"""The causes `profiler.diff_profiles` names, the likeliest first, in words.

From a ProfileDiff's tables: the user line, op and module whose change in calls (which do not
move with the machine's load) or in time accounts for the most of the change, the GPU's idle
time, Sleuth's own work, and the time outside any op (a sleep, Python work, a sync), ranked by
their share of the change.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from profiler._diff_gpu import gpu_cause
from profiler._diff_pairs import SOURCE_SEP
from profiler._sources import CHANGED, site_key
from sleuth.common import short_path

if TYPE_CHECKING:
    from profiler._diff import ProfileDiff

PHASES = ("data", "forward", "backward", "optimizer", "other")
"""The step breakdown's parts; they sum to the step time."""

# ---- words ---------------------------------------------------------------------------------------
def _pick(df: Any, sign: int, floor_us: float) -> Any:
    """The row to name: the one whose change in calls adds the most time in the verdict's
    direction, when that is over `floor_us` (calls do not move with the machine's load, so
    such a change is the program's); else the largest contribution. None when nothing points
    that way."""
    if df.empty:
        return None
    calls = df[sign * df["from_calls_us"] > floor_us]
    if not calls.empty:
        return calls.loc[(sign * calls["from_calls_us"]).idxmax()]
    top = df.iloc[0]
    return top if sign * top["delta_us"] > 0 else None


def causes(d: ProfileDiff) -> list[str]:
    """The likeliest causes first: the user line (with stacks), then the op, then the module;
    Sleuth's own work first when it accounts for more than the op."""
    if d.judgement.verdict == "no change":
        return []
    sign = 1 if d.judgement.verdict == "slower" else -1
    floor_us = 0.01 * min(d.step_a.median, d.step_b.median)  # 1 % of a step
    out: list[str] = []
    weights: list[float] = []  # each cause's microseconds a step, for ranking the outside time
    reshaped = _reshaped(d.ops, sign, floor_us)
    if reshaped:
        out.append(reshaped[1])
        weights.append(reshaped[0])
    line = _pick(d.lines, sign, floor_us)
    if line is not None:
        out.append(f"{short_source(line['source'])}: {_us(line['delta_us'])} a step "
                   f"({line['ops']}{_side_words(line['side'])})")
        weights.append(abs(line["delta_us"]))
        named = _sites(str(line["source"])) if sign > 0 else set()
        for mod, site in d.new_call_sites:
            if site_key(site) not in named:
                continue
            row = d.modules[d.modules["module"] == mod]
            calls = (f" (calls {_n(row.iloc[0]['calls_a'])} -> {_n(row.iloc[0]['calls_b'])} "
                     "a step)" if not row.empty else "")
            out[-1] += f"; of its lines, {short_source(site)} calls {mod} in B only{calls}"
    op = _pick(d.ops, sign, floor_us)
    op_delta = 0.0
    if op is not None:
        op_delta = abs(op["delta_us"])
        where = f" at {short_source(op['source'])}" if op["source"] else ""
        inside = f" in {op['module']}" if op.get("module") else ""
        shapes = (f", input shapes {op['input_shapes_a']} -> {op['input_shapes_b']}"
                  if op["side"] == "both" and op["input_shapes_a"] != op["input_shapes_b"]
                  else "")
        out.append(f"op {op['name']}{inside}{where}: {_us(op['delta_us'])} a step, calls "
                   f"{_n(op['calls_a'])} -> {_n(op['calls_b'])} a step{shapes}"
                   f"{_side_words(op['side'])}")
        weights.append(op_delta)
    mod = _pick(d.modules, sign, floor_us)
    if mod is not None:
        src = f", forward at {short_source(mod['source'])}" if mod["source"] else ""
        kind = f" ({mod['type']}{src})" if mod["type"] else ""
        out.append(f"module {mod['module']}{kind}: {_us(mod['delta_us'])} a step (self time), "
                   f"calls {_n(mod['calls_a'])} -> {_n(mod['calls_b'])}"
                   f"{_side_words(mod['side'])}")
        weights.append(abs(mod["delta_us"]))
    idle = gpu_cause(d.gpu, d.gpu_ranks, d.slower_rank, sign, floor_us)
    if idle:
        out.append(idle[1])
        weights.append(idle[0])
    tools = d.breakdown.set_index("phase")["delta_us"].get("tools", 0.0)
    if isinstance(tools, float) and not math.isnan(tools) and sign * tools > 0:
        text = (f"Sleuth's own work inside the steps: {_us(tools)} a step (the dump or summary "
                f"ran in {'B' if sign > 0 else 'A'}: compare runs profiled alike)")
        at = 0 if abs(tools) > op_delta else len(out)
        out.insert(at, text)
        weights.insert(at, abs(tools))
    outside = _outside_ops(d, sign, floor_us)
    if outside is not None:
        weight, text, unplaced = outside
        # ranked by share of the change: before every cause that explains less; except where
        # the trace places none of it and a line made new calls: the Python that makes new
        # calls (a loop of .item() checks) runs between them, so that line stays first
        at = next((i for i, w in enumerate(weights) if w < weight), len(out))
        new_calls = line is not None and sign * float(line.get("from_calls_us", 0.0)) > floor_us
        if new_calls and unplaced:
            at = max(at, 1)
            text += (f"; {short_source(line['source'])} made new calls, and the Python around them "
                     "runs between ops: likely most of this time")
        out.insert(at, text)
    return out



def _reshaped(ops: Any, sign: int, floor_us: float) -> tuple[float, str] | None:
    """(microseconds a step, words) for the same ops run on other input shapes, where they
    account for more of the change than every op whose calls changed: the inputs grew (a
    longer sequence, a larger batch), which the same op at the same site says better than a
    list of ops with more time."""
    if ops.empty or "input_shapes_a" not in ops:
        return None
    both = ops[(ops["side"] == "both") & (ops["input_shapes_a"] != ops["input_shapes_b"])
               & (ops["input_shapes_a"] != "") & (ops["input_shapes_b"] != "")]
    moved = both[sign * both["delta_us"] > 0]
    total = float(moved["delta_us"].sum()) if not moved.empty else 0.0
    calls = float(ops["from_calls_us"].sum())
    if sign * total <= floor_us or sign * total <= sign * calls:
        return None
    top = moved.reindex((sign * moved["delta_us"]).sort_values(ascending=False).index)
    shown = []
    for _, r in top.head(3).iterrows():
        where = f" at {short_source(str(r['source']))}" if r["source"] else ""
        shown.append(f"{r['name']}{where} {r['input_shapes_a']} -> {r['input_shapes_b']} "
                     f"({_us(r['delta_us'])})")
    more = f"; and {len(top) - 3} more" if len(top) > 3 else ""
    word = "larger" if sign > 0 else "smaller"
    return abs(total), (f"the same ops on {word} inputs: {_us(total)} a step from {len(top)} "
                        f"op(s) at the same sites with other input shapes: "
                        f"{'; '.join(shown)}{more}")


def _outside_line(d: ProfileDiff, sign: int, outside: float) -> tuple[str, bool]:
    """Where the time outside ops was spent, as far as the trace can say: the user's line
    whose builtin call (a sleep, a blocking read, a `.tolist()`) spent the most more time
    outside the ops it made, or why no line is named; and
    whether the traces, with stacks, place none of it (Python work between ops)."""
    if not (d.sides["a"]["stacks"] and d.sides["b"]["stacks"]):
        return ("no source line: time between ops has none without stacks; profile both runs "
                "with with_stack=true to name a sleep's or a blocking call's line"), False
    h = d.host
    if h is not None and not h.empty:
        top = h.loc[(sign * h["delta_us"]).idxmax()]
        # a builtin's time outside ops holds the time only when it holds most of it, or is new: a
        # print() that took 30 us more in a busy run is noise, not the cause
        grew = sign * (float(top["calls_b"]) - float(top["calls_a"])) > 0
        if sign * top["delta_us"] > 0.5 * abs(outside) or (
                grew and sign * top["delta_us"] > 0.1 * abs(outside)):
            from profiler._sources import builtin_token
            name = builtin_token(str(top["name"])) or str(top["name"])
            text = (f"at {short_source(top['source'])}: a call of {name}(), "
                    f"{_dur(top['delta_us'])} a step outside the ops it made (calls "
                    f"{_n(top['calls_a'])} -> {_n(top['calls_b'])})")
            rest = outside - float(top["delta_us"])
            if sign * rest <= 0.5 * abs(outside):
                return text, False
            # new calls of a builtin that makes ops (a loop of `.item()`) hold only their
            # wrappers' microseconds: the rest is the Python around them, which no line holds
            return (f"{text}; the other {_dur(rest)} a step is Python work between ops that "
                    "the trace names no line for"), True
    return ("the trace names no source line for it: no builtin call (a sleep, a blocking read) "
            "explains it, so it is Python work between ops; open the trace at a step's gap"), True


def _outside_ops(d: ProfileDiff, sign: int, floor_us: float
                 ) -> tuple[float, str, bool] | None:
    """The change in step time that no op holds: the step's change less the change in the ops'
    self time (which sums the time inside ops once). A sleep, Python work, a host sync or data
    loading between ops lands here, and in the breakdown's phase around it (`other` when it is
    outside every phase). (weight in us, sentence, whether no line holds it: `_outside_line`)
    when it is over `floor_us` and at least a quarter of the change; else None."""
    bd = d.breakdown.set_index("phase")["delta_us"]
    step = float(bd.get("step", math.nan))
    if math.isnan(step) or sign * step <= 0:
        return None
    ops = 0.0
    if not d.ops.empty:
        ops = float(d.ops["self_b_us"].sum() - d.ops["self_a_us"].sum())
    outside = step - ops
    if sign * outside <= floor_us or sign * outside < 0.25 * sign * step:
        return None
    phases = {p: float(bd.get(p, math.nan)) for p in PHASES}
    phases = {p: v for p, v in phases.items() if not math.isnan(v)}
    phase = max(phases, key=lambda p: sign * phases[p]) if phases else "other"
    where = ("in 'other' (the host between ops: Python work, a sleep, a sync, data loading)"
             if phase == "other" else f"mostly in '{phase}' ({_dur(phases[phase])} a step "
             "there in the breakdown: Python work or waiting between its ops)")
    share = abs(outside / step) * 100
    line, unplaced = _outside_line(d, sign, outside)
    ops_words = (f"the ops' own time changed by {_us(ops)} a step" if abs(ops) >= 0.05 else
                 "the ops' own time did not change")
    return abs(outside), (f"time outside any op: {_dur(outside)} a step {where}, not in any "
                          f"op ({share:.3g} % of the change); "
                          f"{ops_words}; {line}"), unplaced


def _sites(source: str) -> set[str]:
    """The `file:line`s a source cell names (`a.py:21,27; b.py:5`, a CHANGED mark dropped)."""
    out = set()
    for part in source.replace(CHANGED, "").split(SOURCE_SEP):
        path, _, lines = part.strip().rpartition(":")
        out.update(site_key(f"{path}:{n}") for n in lines.split(",") if path and n.isdigit())
    return out


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
