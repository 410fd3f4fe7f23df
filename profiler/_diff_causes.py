"""The causes `profiler.diff_profiles` names, as data: one ranked list of typed causes.

Each rule reads the diff's tables (`Tables`) and returns a cause with the time it accounts
for, in microseconds a step; `find_causes` ranks them on those numbers and
`profiler._diff_words` words them, last and in one place, so every rule is tested on data.

What a cause rests on (`Kind`) matters as much as its size: calls B makes that A does not (or
that A makes and B drops) and the inputs' shapes are counted in each run alone, so the
machine's load, which moves a whole run's steps, does not move them; time per call, time
outside ops and GPU idle time move with it. So the causes whose calls or shapes account for
more than the noise floor come first, and so do those the verdict rests on where calls or
shapes decided it (`Tables.decided_by`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from profiler._diff_gpu import idle_part
from profiler._diff_pairs import SOURCE_SEP, shape_size
from profiler._sources import CHANGED, site_key

PHASES = ("data", "forward", "backward", "optimizer", "other")
"""The step breakdown's parts; they sum to the step time."""


class Kind(str, Enum):
    """What a cause rests on."""

    NEW_CALLS = "new calls"
    """Calls B makes that A does not, or more of them: counted in each run alone."""
    DROPPED_CALLS = "dropped calls"
    """Calls A makes that B drops, or fewer of them: counted in each run alone."""
    SHAPES = "shapes"
    """The same ops at the same sites on other input shapes: read in each run alone."""
    TIME_PER_CALL = "time per call"
    """The same calls taking more or less time each: moves with the machine's load."""
    OUTSIDE_OPS = "time outside ops"
    """The step's change that no op holds: a sleep, Python work, a sync, data loading."""
    GPU_IDLE = "GPU idle"
    """A part of the GPU's idle time (host-bound, data-bound, communication)."""
    TOOLS = "Sleuth's own work"
    """A dump or summary inside one run's steps only."""


LOAD_PROOF = (Kind.NEW_CALLS, Kind.DROPPED_CALLS, Kind.SHAPES)
"""The kinds the machine's load does not move."""


@dataclass(frozen=True, kw_only=True)
class Cause:
    """A cause: what it rests on and the time it accounts for."""

    kind: Kind
    us: float
    """What it accounts for, us a step, B against A (signed: + is time B spends more)."""
    rank_us: float
    """The number it is ranked by: its us in the verdict's direction, capped by the rules of
    `find_causes` (a detail never above what holds it)."""

    @property
    def load_proof_us(self) -> float:
        """The part of `us` that calls or shapes hold, read in each run alone."""
        return 0.0


@dataclass(frozen=True, kw_only=True)
class ShapeChange:
    """One op at one site whose input shapes changed."""

    name: str
    source: str
    shapes_a: str
    shapes_b: str
    us: float
    """Its change at the same calls: the time per call that moved with the shapes."""


@dataclass(frozen=True, kw_only=True)
class Site(Cause):
    """A user line, an op or a module whose time changed (`scope`)."""

    scope: str
    """"line", "op" or "module"."""
    name: str
    """The line (`file:line`), the op's name or the module's."""
    source: str = ""
    module: str = ""
    """The op's module."""
    module_type: str = ""
    """The module's type."""
    ops: str = ""
    """The line's ops, largest first, in words (profiler._diff_pairs.line_diff)."""
    side: str = "both"
    calls_a: float = math.nan
    calls_b: float = math.nan
    from_calls_us: float = 0.0
    """The part more or fewer calls explain, at the cheaper side's time per call."""
    shapes_a: str = ""
    shapes_b: str = ""
    new_sites: tuple[tuple[str, str, float, float], ...] = ()
    """(module, file:line, calls a step in A, in B) of the line's top-level module calls B
    alone makes (profiler._diff._new_call_sites)."""
    smaller: ShapeChange | None = None
    """Calls that multiplied at this line while their inputs shrank (a smaller batch
    accumulated): the largest such op, shown beside the calls, not as a cause of its own."""

    @property
    def load_proof_us(self) -> float:
        return self.from_calls_us if self.kind in (Kind.NEW_CALLS, Kind.DROPPED_CALLS) else 0.0


@dataclass(frozen=True, kw_only=True)
class Shapes(Cause):
    """The same ops at the same sites on larger (or smaller) inputs."""

    larger: bool
    changes: tuple[ShapeChange, ...]
    """Every op that moved with its shapes in the verdict's direction, largest first."""

    @property
    def load_proof_us(self) -> float:
        return self.us


@dataclass(frozen=True, kw_only=True)
class HostCall:
    """The user's call of a builtin that spent time outside the ops it made."""

    name: str
    source: str
    us: float
    calls_a: float
    calls_b: float


@dataclass(frozen=True, kw_only=True)
class OutsideOps(Cause):
    """The step's change that no op holds."""

    phase: str
    """The breakdown's phase that grew the most ("other": outside every phase)."""
    phase_us: float
    share: float
    """Its share of the step's change, in percent."""
    ops_us: float
    """The change in the ops' own time."""
    stacks: bool
    host: HostCall | None = None
    """The builtin call that holds it, where one does."""
    rest_us: float = 0.0
    """What `host` leaves: Python work between ops that no line holds."""
    unplaced: bool = False
    """True when the trace places none (or too little) of it at a line."""
    new_calls_line: str = ""
    """The line that made new calls, when none of it is placed: the Python around them."""


@dataclass(frozen=True, kw_only=True)
class GpuIdle(Cause):
    figure: str
    a: float
    b: float
    rank: int | None = None
    """The rank it is read on, with several (the one that got slower the most)."""


@dataclass(frozen=True, kw_only=True)
class Tools(Cause):
    side: str
    """The run whose steps hold Sleuth's own work: "A" or "B"."""


@dataclass(frozen=True)
class Tables:
    """What the rules read, from a ProfileDiff's tables (profiler._diff)."""

    sign: int
    """+1 when B is slower, -1 when faster."""
    step_us: float
    """The smaller median step: 1 % of it is the least a cause must hold."""
    ops: Any
    lines: Any
    modules: Any
    breakdown: Any
    host: Any = None
    gpu: Any = None
    gpu_ranks: Any = None
    slower_rank: int | None = None
    new_call_sites: list[tuple[str, str]] = field(default_factory=list)
    stacks: bool = False
    decided_by: str = "steps"
    """What decided the verdict: "steps", or the evidence load does not move ("calls",
    "shapes", "calls and shapes")."""
    noise: float = 0.0
    """The verdict's noise floor, a fraction of a step: calls or shapes that account for more
    come first."""

    @property
    def floor_us(self) -> float:
        return 0.01 * self.step_us


def find_causes(t: Tables) -> list[Cause]:
    """The causes, the likeliest first (module docstring); [] when nothing points the
    verdict's way."""
    sites = _sites(t)
    shapes = shape_cause(t.ops, t.sign, t.floor_us)
    found: list[Cause] = []
    if shapes is not None:
        found.append(shapes)
        # a line, op or module whose calls did not change took more time per call: where the
        # same ops ran on larger inputs, that is where, and the shapes are why
        sites = [replace(s, rank_us=min(s.rank_us, shapes.rank_us))
                 if s.kind == Kind.TIME_PER_CALL else s for s in sites]
    found += sites
    idle = _gpu_idle(t)
    if idle is not None:
        found.append(idle)
    tools = _tools(t)
    if tools is not None:
        found.append(tools)
    outside = outside_cause(t)
    if outside is not None:
        line = next((s for s in sites if s.scope == "line"), None)
        if (outside.unplaced and line is not None and t.sign * line.from_calls_us > t.floor_us):
            # the Python that makes new calls (a loop of .item() checks) runs between them: the
            # line that made them holds what no line is named for, so it stays ahead
            outside = replace(outside, rank_us=min(outside.rank_us, line.rank_us),
                              new_calls_line=line.name)
        found.append(outside)
    return rank(found, t.sign, max(t.noise * t.step_us, t.floor_us), t.decided_by)


def rank(found: list[Cause], sign: int, first_us: float, decided_by: str = "steps"
         ) -> list[Cause]:
    """Largest `rank_us` first (ties keep their order), after the causes that rest on evidence
    load does not move: those whose calls or shapes account for more than `first_us` in the
    verdict's direction, and, where such evidence decided the verdict, those resting on it; a
    line or op before any of its parts that comes first."""
    decided = {"calls": (Kind.NEW_CALLS, Kind.DROPPED_CALLS), "shapes": (Kind.SHAPES,),
               "calls and shapes": LOAD_PROOF}.get(decided_by, ())
    first = [c.kind in decided or sign * c.load_proof_us > first_us for c in found]
    # the sites come line, op, module, each a part of the one before it: where a finer one
    # comes first, so does what holds it (a module called twice is its line's new call, and
    # that line's own count can sit under the floor when its time per call moved with load)
    sites = [i for i, c in enumerate(found) if isinstance(c, Site)]
    for outer, inner in reversed(list(zip(sites, sites[1:]))):
        first[outer] = first[outer] or first[inner]
    order = sorted(range(len(found)), key=lambda i: (not first[i], -found[i].rank_us))
    return [found[i] for i in order]


# ---- lines, ops and modules ----------------------------------------------------------------------
def pick(df: Any, sign: int, floor_us: float) -> Any:
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


def site_kind(side: str, us: float, from_calls_us: float) -> Kind:
    """New or dropped calls where calls explain at least half of the change (or the row is
    in one run only), else time per call."""
    if side == "B only":
        return Kind.NEW_CALLS
    if side == "A only":
        return Kind.DROPPED_CALLS
    if abs(from_calls_us) >= 0.5 * abs(us) and from_calls_us != 0:
        return Kind.NEW_CALLS if from_calls_us > 0 else Kind.DROPPED_CALLS
    return Kind.TIME_PER_CALL


def _sites(t: Tables) -> list[Site]:
    """The line (with stacks), then the op, then the module; a finer scope never ranks above
    the one before it (an op is a part of its line's time)."""
    out: list[Site] = []
    sign, floor_us = t.sign, t.floor_us
    cap = math.inf
    line = pick(t.lines, sign, floor_us)
    if line is not None:
        us, calls_us = float(line["delta_us"]), float(line["from_calls_us"])
        named = sources_of(str(line["source"])) if sign > 0 else set()
        new_sites = []
        for mod, site in t.new_call_sites:
            if site_key(site) in named:
                row = t.modules[t.modules["module"] == mod]
                ca, cb = ((float(row.iloc[0]["calls_a"]), float(row.iloc[0]["calls_b"]))
                          if not row.empty else (math.nan, math.nan))
                new_sites.append((mod, site, ca, cb))
        cap = sign * us
        out.append(Site(kind=site_kind(str(line["side"]), us, calls_us), us=us, rank_us=cap,
                        scope="line", name=str(line["source"]), source=str(line["source"]),
                        ops=str(line["ops"]), side=str(line["side"]), from_calls_us=calls_us,
                        new_sites=tuple(new_sites),
                        smaller=_shrunk_at(t.ops, str(line["source"]), sign)))
    op = pick(t.ops, sign, floor_us)
    if op is not None:
        us, calls_us = float(op["delta_us"]), float(op["from_calls_us"])
        cap = min(cap, sign * us)
        reshaped = op["side"] == "both" and op["input_shapes_a"] != op["input_shapes_b"]
        out.append(Site(kind=site_kind(str(op["side"]), us, calls_us), us=us, rank_us=cap,
                        scope="op", name=str(op["name"]), source=str(op["source"] or ""),
                        module=str(op.get("module") or ""), side=str(op["side"]),
                        calls_a=float(op["calls_a"]), calls_b=float(op["calls_b"]),
                        from_calls_us=calls_us,
                        shapes_a=str(op["input_shapes_a"]) if reshaped else "",
                        shapes_b=str(op["input_shapes_b"]) if reshaped else ""))
    mod = pick(t.modules, sign, floor_us)
    if mod is not None:
        us, calls_us = float(mod["delta_us"]), float(mod["from_calls_us"])
        cap = min(cap, sign * us)
        out.append(Site(kind=site_kind(str(mod["side"]), us, calls_us), us=us, rank_us=cap,
                        scope="module", name=str(mod["module"]), source=str(mod["source"] or ""),
                        module_type=str(mod["type"] or ""), side=str(mod["side"]),
                        calls_a=float(mod["calls_a"]), calls_b=float(mod["calls_b"]),
                        from_calls_us=calls_us))
    return out


def sources_of(source: str) -> set[str]:
    """The `file:line`s a source cell names (`a.py:21,27; b.py:5`, a CHANGED mark dropped)."""
    out = set()
    for part in source.replace(CHANGED, "").split(SOURCE_SEP):
        path, _, lines = part.strip().rpartition(":")
        out.update(site_key(f"{path}:{n}") for n in lines.split(",") if path and n.isdigit())
    return out


# ---- shapes --------------------------------------------------------------------------------------
def _reshaped(ops: Any) -> Any:
    """The ops found in both runs at the same site with other input shapes, with `per_call_us`
    (their change at the same calls: `delta_us` less the part more or fewer calls explain) and
    `grew` (+1 when B's inputs hold more elements, -1 fewer, 0 as many)."""
    if ops.empty or "input_shapes_a" not in ops:
        return ops.iloc[0:0].assign(per_call_us=[], grew=[])
    both = ops[(ops["side"] == "both") & (ops["input_shapes_a"] != ops["input_shapes_b"])
               & (ops["input_shapes_a"] != "") & (ops["input_shapes_b"] != "")]
    size_a = both["input_shapes_a"].astype(str).map(shape_size)
    size_b = both["input_shapes_b"].astype(str).map(shape_size)
    grew = (size_b > size_a).astype(int) - (size_b < size_a).astype(int)
    return both.assign(per_call_us=both["delta_us"] - both["from_calls_us"], grew=grew)


def shape_cause(ops: Any, sign: int, floor_us: float) -> Shapes | None:
    """The same ops at the same sites on larger inputs (B slower) or smaller ones (B faster):
    the time their calls' change of time per call accounts for, over `floor_us`. More calls of
    the same ops are the calls' time, not the shapes': a smaller batch accumulated over four
    times the calls is no slowdown by its shapes, whose smaller inputs take less time a call
    (`Site.smaller` shows them beside the calls)."""
    r = _reshaped(ops)
    moved = r[(r["grew"] == sign) & (sign * r["per_call_us"] > 0)]
    if moved.empty:
        return None
    total = float(moved["per_call_us"].sum())
    if sign * total <= floor_us:
        return None
    moved = moved.reindex((sign * moved["per_call_us"]).sort_values(ascending=False).index)
    changes = tuple(ShapeChange(name=str(x["name"]), source=str(x["source"] or ""),
                                shapes_a=str(x["input_shapes_a"]),
                                shapes_b=str(x["input_shapes_b"]), us=float(x["per_call_us"]))
                    for _, x in moved.iterrows())
    return Shapes(kind=Kind.SHAPES, us=total, rank_us=abs(total), larger=sign > 0,
                  changes=changes)


def shapes_load_free(ops: Any) -> float:
    """What the ops' change of shapes costs a step, read in each run alone: the reshaped ops'
    time in B scaled by the median over the ops that ran alike in both (same shapes, same
    calls) of A's time over B's, less their time in A. A machine slower for all of B's run
    moves every alike op's ratio alike, so it does not move this; a burst of load inside a
    few ops moves their ratios only, which the median sets aside. nan when no op ran alike."""
    r = _reshaped(ops)
    if r.empty:
        return 0.0
    alike = ops[(ops["side"] == "both") & (ops["input_shapes_a"] == ops["input_shapes_b"])
                & (ops["calls_a"] == ops["calls_b"]) & (ops["self_a_us"] > 0)
                & (ops["self_b_us"] > 0)]
    if alike.empty:
        return math.nan
    speed = float((alike["self_a_us"] / alike["self_b_us"]).median())
    # at A's calls: the part more or fewer calls explain is the calls' (from_calls_us)
    b = float((r["self_b_us"] - r["from_calls_us"]).sum())
    return b * speed - float(r["self_a_us"].sum())


def _shrunk_at(ops: Any, source: str, sign: int) -> ShapeChange | None:
    """At a line whose calls multiplied (B slower) or fell (B faster): the largest op there
    whose inputs moved the other way, the sign of work split into more, smaller calls."""
    r = _reshaped(ops)
    r = r[(r["source"] == source) & (r["grew"] == -sign)
          & (sign * (r["calls_b"] - r["calls_a"]) > 0)]
    if r.empty:
        return None
    size = r["input_shapes_a"].astype(str).map(shape_size)
    x = r.loc[size.idxmax()]
    return ShapeChange(name=str(x["name"]), source=source, shapes_a=str(x["input_shapes_a"]),
                       shapes_b=str(x["input_shapes_b"]), us=float(x["per_call_us"]))


# ---- GPU idle, Sleuth's own work, time outside ops -----------------------------------------------
def _gpu_idle(t: Tables) -> GpuIdle | None:
    part = idle_part(t.gpu, t.gpu_ranks, t.slower_rank, t.sign, t.floor_us)
    if part is None:
        return None
    figure, a, b, delta, on_rank = part
    return GpuIdle(kind=Kind.GPU_IDLE, us=delta, rank_us=abs(delta), figure=figure, a=a, b=b,
                   rank=on_rank)


def _tools(t: Tables) -> Tools | None:
    tools = t.breakdown.set_index("phase")["delta_us"].get("tools", 0.0)
    if not isinstance(tools, float) or math.isnan(tools) or t.sign * tools <= 0:
        return None
    return Tools(kind=Kind.TOOLS, us=tools, rank_us=abs(tools), side="B" if t.sign > 0 else "A")


def outside_cause(t: Tables) -> OutsideOps | None:
    """The change in step time that no op holds: the step's change less the change in the
    ops' self time (which sums the time inside ops once). A sleep, Python work, a host sync or
    data loading between ops lands here, and in the breakdown's phase around it (`other` when
    it is outside every phase); over `floor_us` and at least a quarter of the change, else
    None."""
    sign = t.sign
    bd = t.breakdown.set_index("phase")["delta_us"]
    step = float(bd.get("step", math.nan))
    if math.isnan(step) or sign * step <= 0:
        return None
    ops = 0.0
    if not t.ops.empty:
        ops = float(t.ops["self_b_us"].sum() - t.ops["self_a_us"].sum())
    outside = step - ops
    if sign * outside <= t.floor_us or sign * outside < 0.25 * sign * step:
        return None
    phases = {p: float(bd.get(p, math.nan)) for p in PHASES}
    phases = {p: v for p, v in phases.items() if not math.isnan(v)}
    phase = max(phases, key=lambda p: sign * phases[p]) if phases else "other"
    host, rest, unplaced = host_share(t.host, t.stacks, sign, outside)
    return OutsideOps(kind=Kind.OUTSIDE_OPS, us=outside, rank_us=abs(outside), phase=phase,
                      phase_us=phases.get(phase, math.nan), share=abs(outside / step) * 100,
                      ops_us=ops, stacks=t.stacks, host=host, rest_us=rest, unplaced=unplaced)


def host_share(h: Any, stacks: bool, sign: int, outside: float
               ) -> tuple[HostCall | None, float, bool]:
    """Where the time outside ops was spent, as far as the trace can say: the user's builtin
    call (a sleep, a blocking read, a `.tolist()`) that spent the most more time outside the
    ops it made, when it holds most of it or is new; (that call or None, the rest no line
    holds, whether the trace places none or too little of it: Python work between ops)."""
    if not stacks:
        return None, 0.0, False
    if h is not None and not h.empty:
        top = h.loc[(sign * h["delta_us"]).idxmax()]
        # a builtin's time outside ops holds the time only when it holds most of it, or is new:
        # a print() that took 30 us more in a busy run is noise, not the cause
        grew = sign * (float(top["calls_b"]) - float(top["calls_a"])) > 0
        if sign * top["delta_us"] > 0.5 * abs(outside) or (
                grew and sign * top["delta_us"] > 0.1 * abs(outside)):
            call = HostCall(name=str(top["name"]), source=str(top["source"]),
                            us=float(top["delta_us"]), calls_a=float(top["calls_a"]),
                            calls_b=float(top["calls_b"]))
            rest = outside - call.us
            if sign * rest <= 0.5 * abs(outside):
                return call, 0.0, False
            # new calls of a builtin that makes ops (a loop of `.item()`) hold only their
            # wrappers' microseconds: the rest is the Python around them, which no line holds
            return call, rest, True
    return None, outside, True
