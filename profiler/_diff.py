"""diff_profiles: why is run B slower (or not) than run A, from their profiles.

Everything is per step (per rank): times summed over a run's windows and ranks are divided by
its number of profiled (rank, step) pairs, so runs profiled for different numbers of steps or
ranks compare. The verdict on step time is `profiler._noise.judge` (Mann-Whitney on the steps,
a floor from their spread); the rest explains it:

- the step breakdown (data, forward, backward, optimizer, other, plus comm and tool time);
- ops and modules ranked by their contribution to the difference in time per step: the change
  in self time (on a trace with GPU kernels, the change in kernel time when that is larger),
  with calls, self and total time, the user's source line where the trace has stacks, and the
  side an op is found on (`both`, `A only`, `B only`: a new cast, a recompute, a sync);
- with stacks, the same contributions summed per source line;
- the causes, as typed data ranked on the time each accounts for (profiler._diff_causes) and
  worded last (profiler._diff_words): a line, op or module resting on new calls, dropped calls
  or time per call, the same ops on larger or smaller inputs, time outside any op (a sleep,
  Python work, a sync), GPU idle time, Sleuth's own work;
- where the step times cannot judge, the evidence load does not move (calls, and shapes read
  in each run alone) decides when it costs more than the noise floor, and the headline says so;
- memory peak and communication share; across ranks, the slowest rank and the one that got
  slower;
- on traces with GPU events, GPU time side by side (profiler._gpu_time): idle time per step
  split into host-bound, data-bound and waiting on communication, compute/communication
  overlap, and kernel time by module; a CPU trace says it has no GPU figures.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

from profiler._diff_causes import PHASES, Cause, Tables, find_causes, shapes_load_free
from profiler._diff_gpu import gpu_diff, gpu_rank_diff
from profiler._diff_pairs import empty_lines, host_diff, line_diff, module_diff, op_diff, rank
from profiler._diff_words import short_source, words
from profiler._errors import ProfileFormatError
from profiler._noise import Judgement, Spread, between_runs, judge, spread
from profiler._repeats import as_list, identity, name, read, read_repeats


@dataclass
class ProfileDiff:
    """The comparison of two profiles, B against A (times in microseconds per step).

    judgement: the verdict on step time (`verdict`, `change`, p-values, noise floor and what
        set it, the variation between runs where repeats measured it).
    step_a, step_b: step-time spread of each side (n, median, q1, q3, mean), over its repeats
        too.
    breakdown: phase, a_us, b_us, delta_us (mean per step; phases, then step, comm, tools).
    ops: name, input_shapes, module (ops pair across runs by these three, the module only where
        both profiles name it, never by file path; an op in one run only pairs with one whose
        shapes alone differ, called from the same lines: `_pair_reshaped`), input_shapes_a,
        input_shapes_b (each side's; `input_shapes` is B's, A's for an op in A only), source
        (B's line, A's for an op in A only), source_a, source_b, side, calls_a, calls_b, self_a_us, self_b_us, total_a_us, total_b_us,
        device_a_us, device_b_us, delta_us (the contribution), ranked by contribution.
    modules: module, type, source, side, calls_a, calls_b, self_a_us, self_b_us, total_a_us,
        total_b_us, device_a_us, device_b_us, delta_us, ranked likewise.
    lines: source, delta_us, ops (the ops at that line, largest first), side (empty without
        stacks).
    sides: per run (`a`, `b`): peak memory by device, comm share, tool time, ranks, slowest
        rank, whether the trace has stacks, its kernel time (device_us) and its traces.
    ranks: rank, step_a_us, step_b_us, change (one row per rank found in both).
    gpu: figure, a, b, delta (GPU time per step: busy, idle, host-bound, data-bound, waiting
        on communication, compute and communication kernels, their overlap and its share);
        None on a side whose trace has no GPU events; empty when neither has.
    kernels: module, type, kernel_a_us, kernel_b_us, delta_us: kernel time per step by module
        (kernels charged to the module whose range launched them), largest change first.
    gpu_ranks, kernels_ranks: the same two per rank (a `rank` column first), so one slow rank
        of several is not averaged away (profiler._diff_gpu).
    findings: what accounts for the difference, as typed causes (profiler._diff_causes: new
        or dropped calls, shapes, time per call, time outside ops, GPU idle, Sleuth's own
        work), the likeliest first.
    causes: the findings in words (profiler._diff_words), in the same order.
    notes: what limits the comparison (few steps, no stacks, one side's dump on, ...).
    """

    a: str
    b: str
    judgement: Judgement
    step_a: Spread
    step_b: Spread
    breakdown: Any
    ops: Any
    modules: Any
    lines: Any
    ranks: Any
    sides: dict[str, dict[str, Any]] = field(default_factory=dict)
    causes: list[str] = field(default_factory=list)
    findings: list[Cause] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    slower_rank: int | None = None
    """The rank whose step time grew the most (several ranks only)."""
    gpu: Any = None
    kernels: Any = None
    gpu_ranks: Any = None
    """rank, figure, key, a, b, delta: the `gpu` figures of each rank, A's rank beside B's."""
    kernels_ranks: Any = None
    """rank, module, type, kernel_a_us, kernel_b_us, delta_us: `kernels` of each rank."""
    new_call_sites: list[tuple[str, str]] = field(default_factory=list)
    """(module, file:line): a top-level module call B makes from a line of a script it shares
    with A where A makes none (an extra forward, a second model call)."""
    repeats: dict[str, list[str]] = field(default_factory=dict)
    """The further runs of each side's config (`a`, `b`) whose steps the verdict pooled."""
    host: Any = None
    """name, source, source_a, source_b, calls_a, calls_b, time_a_us, time_b_us, delta_us: the
    user's calls of builtins (`time.sleep`, a blocking read, `.tolist()`; with_stack traces),
    their time outside the ops they made, per step, paired by name without the object's
    address; largest change first."""

    @property
    def verdict(self) -> str:
        return self.judgement.verdict

    @property
    def exit_code(self) -> int:
        """1 when B is slower beyond noise, else 0 (`sleuth profile diff`'s exit code)."""
        return 1 if self.judgement.verdict == "slower" else 0

    def headline(self) -> str:
        """One sentence: the verdict with the two medians and the noise it was judged against."""
        j, a, b = self.judgement, self.step_a, self.step_b
        base = (f"step time {_ms(a.median)} -> {_ms(b.median)} (median of {a.n} and {b.n} "
                f"steps, {_pct(j.change)})")
        floor = f"noise floor {j.noise * 100:.3g} %" + {
            "spread": " (the steps' spread)",
            "between runs": " (the variation between runs)"}.get(j.floor_from, "")
        if j.tested:
            said = j.withheld or j.verdict
            p = j.p_faster if said == "faster" else j.p_slower
            floor += f", Mann-Whitney p = {p:.3g}"
        else:
            floor += ", too few steps for a test"
        if math.isnan(j.between) and j.verdict != "no change":
            floor += "; variation between runs not measured (one profile a side)"
        if j.withheld and j.decided_by == "steps":  # (else the headline says they go against)
            floor += (f"; the steps alone say {j.withheld}, against its calls or shapes (see "
                      f"the note)")
        if j.decided_by != "steps":
            return _by_evidence(j, base, floor)
        if j.verdict == "slower":
            return f"B is slower: {base}; {floor}"
        if j.verdict == "faster":
            return f"B is faster: {base}; {floor}"
        return f"no change beyond noise: {base}; {floor}"

    def rank_lines(self) -> list[str]:
        """With several ranks and GPU figures: the slowest rank of each run and the rank that
        got slower the most, with their GPU idle time and its parts, in words; else []."""
        from profiler._diff_gpu import rank_lines
        return rank_lines(self.gpu_ranks, (self.sides.get("a", {}).get("slowest_rank"),
                                           self.sides.get("b", {}).get("slowest_rank")),
                          self.slower_rank)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for `--json` (NaN as None)."""
        import json
        j = self.judgement

        def records(df: Any) -> list[dict[str, Any]]:
            return json.loads(df.to_json(orient="records")) if df is not None else []

        return _clean({
            "a": self.a, "b": self.b, "verdict": j.verdict, "exit_code": self.exit_code,
            "headline": self.headline(), "causes": self.causes,
            "findings": [_finding(c) for c in self.findings], "notes": self.notes,
            "step_time": {"change": j.change, "p_slower": j.p_slower, "p_faster": j.p_faster,
                          "noise_floor": j.noise, "floor_from": j.floor_from,
                          "between_runs": j.between, "tested": j.tested,
                          "decided_by": j.decided_by, "calls_share": j.calls_share,
                          "shapes_share": j.shapes_share,
                          "repeats": self.repeats,
                          "a": vars(self.step_a) | {"quartile_deviation": self.step_a.quartile_deviation},
                          "b": vars(self.step_b) | {"quartile_deviation": self.step_b.quartile_deviation}},
            "breakdown": records(self.breakdown), "ops": records(self.ops),
            "modules": records(self.modules), "lines": records(self.lines),
            "ranks": records(self.ranks), "slower_rank": self.slower_rank,
            "gpu": records(self.gpu), "kernels": records(self.kernels),
            "gpu_ranks": records(self.gpu_ranks), "kernels_ranks": records(self.kernels_ranks),
            "host": records(self.host),
            "new_call_sites": [{"module": m, "source": s} for m, s in self.new_call_sites],
            "sides": {k: {kk: (str(vv) if isinstance(vv, Path) else vv) for kk, vv in v.items()}
                      for k, v in self.sides.items()},
        })


def diff_profiles(a: Any, b: Any, *, repeat_a: Sequence[Any] = (), repeat_b: Sequence[Any] = (),
                  threshold: float = 0.05, alpha: float = 0.05) -> ProfileDiff:
    """Compare the profiles of two runs: why is B slower than A, or is it not.

    Args:
        a, b: run directories (holding profile/rank*/) or `profiler.Profile` objects.
        repeat_a, repeat_b: more runs of A's (B's) config. The verdict then pools each side's
            steps and its floor includes the variation between runs of one config (the
            machine's speed drifting from run to run, which one profile a side cannot see);
            the tables compare `a` and `b`.
        threshold: the smallest relative change of the median step called a change (0.05).
        alpha: the Mann-Whitney significance level (0.05).

    Returns a ProfileDiff. Raises ProfileFormatError when a profile cannot be read or holds no
    profiled steps, and ProfilerError for a threshold or alpha out of range, or a repeat that is
    no other run of its side's config (profiler._repeats).
    """
    from profiler._errors import ProfilerError

    if not (0 <= threshold < 10 and 0 < alpha < 1):
        raise ProfilerError(f"threshold must be in [0, 10) and alpha in (0, 1), got "
                            f"{threshold!r} and {alpha!r}")
    names = [name(x) for x in (a, b)]
    pa, pb = read(a), read(b)
    for side, x, p in (("A", a, pa), ("B", b, pb)):
        if p.steps.empty:
            raise ProfileFormatError(f"{side} ({name(x)}) has no profiled steps, so no step "
                                     "time to compare (a trace without step ranges: a loop "
                                     "that never called the Collector's step(), or an empty "
                                     "trace); profile it again with steps recorded")
    repeat_a, repeat_b = as_list(repeat_a), as_list(repeat_b)
    taken = {identity(a), identity(b)}
    more_a = read_repeats("--repeat-a", "A", pa, repeat_a, taken)
    more_b = read_repeats("--repeat-b", "B", pb, repeat_b, taken)
    runs_a = [_step_times(p.steps) for p in (pa, *more_a)]
    runs_b = [_step_times(p.steps) for p in (pb, *more_b)]
    ta, tb = [t for r in runs_a for t in r], [t for r in runs_b for t in r]
    between = [between_runs([spread(r).median for r in runs if r]) for runs in (runs_a, runs_b)]
    measured = [v for v in between if not math.isnan(v)]
    j = judge(ta, tb, threshold=threshold, alpha=alpha,
              between=max(measured) if measured else math.nan)
    # each run's own spread: pooled runs would count the drift between them twice
    in_run = [spread(r).quartile_deviation for r in (*runs_a, *runs_b) if r]
    j = replace(j, floor_in_run=max([threshold, *in_run]))
    step_a, step_b = spread(ta), spread(tb)
    step_us = min(step_a.median, step_b.median)
    notes: list[str] = []
    if not measured:
        notes.append("one profile a side: the machine's speed can drift between two runs (another "
                     "job, a clock change) and move every step of one run alike, which the steps' "
                     "spread cannot show; profile A again and pass it with --repeat-a (repeat_a=) "
                     "to measure the variation between runs into the noise floor")
    else:
        moved = "; ".join(f"{side} {v * 100:.3g} % over {len(runs)} runs" for side, v, runs in
                          (("A", between[0], runs_a), ("B", between[1], runs_b))
                          if not math.isnan(v))
        busy = ("; as much as that is a busy machine: profile on a quiet one for a finer "
                "answer" if max(measured) > 2 * threshold else "")
        notes.append(f"between runs of one config the median step moved by {moved}: the noise "
                     f"floor includes it{busy}; the verdict pools the steps of every run, the "
                     "tables below compare A and B alone")
    if not j.tested:
        notes.append(f"fewer than 3 profiled steps on a side ({len(ta)} and {len(tb)}): the "
                     "noise floor alone decided; profile more steps (active=) for a test")
    if j.noise > 2 * threshold and j.floor_from == "spread":
        notes.append(f"the steps' own spread sets the noise floor at {j.noise * 100:.3g} % "
                     f"(above the {threshold * 100:.3g} % threshold): a busy machine or uneven "
                     "steps; profile again on a quiet machine, or more steps, for a finer answer")
    na, nb = max(1, len(pa.steps)), max(1, len(pb.steps))
    sa, sb = _side(pa), _side(pb)
    stacks = sa["stacks"] and sb["stacks"]
    if sa["stacks"] != sb["stacks"]:
        notes.append("only one profile has Python stacks (with_stack): ops are compared by "
                     "name, without source lines; profile both runs alike")
    elif not stacks:
        notes.append("no Python stacks in these profiles: ops carry no source line (profile "
                     "with with_stack=true to name the line)")
    if sa["dump_on"] != sb["dump_on"]:
        notes.append(f"the dump was on in {'A' if sa['dump_on'] else 'B'} only: Sleuth's own work "
                     "is inside its phases (the `tools` row)")
    raw_ops = op_diff(pa.ops, pb.ops, na, nb, stacks)
    # what B's change in calls costs a step at A's time per call: calls do not move with load
    calls_us = float(raw_ops["from_calls_us"].sum()) if not raw_ops.empty else 0.0
    shapes_us = shapes_load_free(raw_ops)
    j = _against_calls(j, calls_us, step_us, notes, shapes_us)
    j = _decided_by_evidence(j, calls_us, shapes_us, step_a.median)
    descending = j.verdict != "faster"
    ops = rank(raw_ops, descending)
    mods = rank(module_diff(pa.modules, pb.modules, na, nb), descending)
    lines = line_diff(ops, descending) if stacks else empty_lines()
    if j.verdict == "no change" and not j.withheld:
        _unjudged_calls(calls_us, lines, step_us, notes)
    ranks, slower_rank = _rank_diff(pa, pb)
    gpu, kernels = gpu_diff(pa, pb, na, nb, notes, descending)
    gpu_ranks, kernels_ranks = gpu_rank_diff(pa, pb, descending)
    out = ProfileDiff(a=names[0], b=names[1], judgement=j, step_a=step_a, step_b=step_b,
                      breakdown=_breakdown(pa.steps, pb.steps), ops=ops, modules=mods,
                      lines=lines, ranks=ranks, sides={"a": sa, "b": sb}, notes=notes,
                      slower_rank=slower_rank, gpu=gpu, kernels=kernels,
                      gpu_ranks=gpu_ranks, kernels_ranks=kernels_ranks,
                      host=host_diff(pa, pb, na, nb, descending))
    out.repeats = {"a": [name(x) for x in repeat_a], "b": [name(x) for x in repeat_b]}
    out.new_call_sites = _new_call_sites(pa, pb)
    if j.verdict != "no change":
        out.findings = find_causes(Tables(
            sign=1 if j.verdict == "slower" else -1, step_us=step_us, ops=ops, lines=lines,
            modules=mods, breakdown=out.breakdown, host=out.host, gpu=gpu, gpu_ranks=gpu_ranks,
            slower_rank=slower_rank, new_call_sites=out.new_call_sites, stacks=stacks,
            decided_by=j.decided_by, noise=j.noise))
    out.causes = [words(c) for c in out.findings]
    return out


def _against_calls(j: Judgement, calls_us: float, step_us: float, notes: list[str],
                   shapes_us: float = 0.0) -> Judgement:
    """The verdict kept, or withheld ("no change", `withheld` its direction) when it is
    against the calls and shapes: B judged faster while it makes calls A does not, or runs the
    same ops on larger inputs (or slower while it makes fewer, on smaller ones), by less than
    twice the floor with nothing measuring the variation between runs, or by less than those
    calls and shapes account for beyond the floor, repeats or not (`_decided_by_evidence` then
    gives their verdict). Calls and shapes do not move with the machine's load (`shapes_us`:
    `shapes_load_free`); a whole run's steps do, when the machine's speed drifts between
    runs, and one profile a side cannot tell that from a change of the program."""
    if j.verdict == "no change":
        return j
    shapes_us = 0.0 if math.isnan(shapes_us) else shapes_us
    evidence = calls_us + shapes_us
    sign = 1 if j.verdict == "slower" else -1
    if sign * evidence >= 0 or abs(evidence) <= 0.01 * step_us:
        return j
    # more against the steps than they moved, beyond the floor: for the steps to hold, the ops
    # that did not change would have had to speed up (slow down) by the whole sum, which is
    # the machine's speed moving between the runs, whatever the repeats measured
    overruled = abs(evidence) > (abs(j.change) + _evidence_floor(j)) * step_us
    if not overruled and (not math.isnan(j.between) or abs(j.change) >= 2 * j.noise):
        return j
    parts = [(word, text) for word, us, text in (
        ("calls", calls_us, f"B makes {'more' if calls_us > 0 else 'fewer'} calls than A, "
                            f"{calls_us:+.4g} us a step at A's time per call"),
        ("shapes", shapes_us, f"B runs the same ops on {'larger' if shapes_us > 0 else 'smaller'} "
                              f"inputs, {shapes_us:+.4g} us a step"))
        if abs(us) > 0.01 * step_us]
    what = " and ".join(w for w, _ in parts) or "calls and shapes"
    said = "; ".join(t for _, t in parts) or f"{evidence:+.4g} us a step"
    then = ("so they decide the verdict, as they do not move with load" if overruled else
            "so no verdict is given: profile A again and pass it with --repeat-a, or profile "
            "both at once")
    notes.append(f"the steps say B is {j.verdict} ({j.change * 100:+.3g} %), against its "
                 f"{what}: {said}; the machine's speed likely changed between the two runs, "
                 f"{then}")
    return replace(j, verdict="no change", withheld=j.verdict)


def _decided_by_evidence(j: Judgement, calls_us: float, shapes_us: float,
                         step_us: float) -> Judgement:
    """Where the step times cannot judge ("no change", or withheld against the calls),
    evidence that load does not move decides when together it costs more than the noise
    floor: the change in calls (calls B makes that A does not, at B's time per call, or that A
    makes and B drops, at A's; calls both make more or fewer times) and the same ops on other
    input shapes (`shapes_load_free`: B's time scaled by the ops that ran alike). Both are
    read in each run alone, so the machine's load, which moves a whole run's steps, does not
    move them. Each part that holds a quarter of their sum the verdict's way is named."""
    if j.verdict != "no change" or not step_us > 0:
        return j
    shapes_us = 0.0 if math.isnan(shapes_us) else shapes_us
    share = (calls_us + shapes_us) / step_us
    if abs(share) <= max(_evidence_floor(j), 0.01):
        return j
    sign = 1 if share > 0 else -1
    total = abs(calls_us + shapes_us)
    named = {k: v / step_us if sign * v >= 0.25 * total else math.nan
             for k, v in (("calls_share", calls_us), ("shapes_share", shapes_us))}
    return replace(j, verdict="slower" if sign > 0 else "faster", **named)


def _evidence_floor(j: Judgement) -> float:
    """The floor calls and shapes must clear: the one of a single run (`floor_in_run`), as
    the drift between runs that the repeats measure does not move them."""
    return j.noise if math.isnan(j.floor_in_run) else j.floor_in_run


def _by_evidence(j: Judgement, base: str, floor: str) -> str:
    """The headline of a verdict that calls or shapes decided (`_decided_by_evidence`)."""
    sign = 1 if j.verdict == "slower" else -1
    said = []
    if not math.isnan(j.calls_share):
        said.append(f"B makes {'more' if sign > 0 else 'fewer'} calls than A, "
                    f"{j.calls_share * 100:+.3g} % of A's step")
    if not math.isnan(j.shapes_share):
        said.append(f"{'and ' if said else 'B '}runs the same ops on "
                    f"{'larger' if sign > 0 else 'smaller'} inputs, "
                    f"{j.shapes_share * 100:+.3g} % of A's step at A's speed")
    which = "they do" if j.decided_by == "calls and shapes" else f"{j.decided_by} do"
    steps = "go against" if j.withheld else "do not clear"
    shares = [abs(v) for v in (j.calls_share, j.shapes_share) if not math.isnan(v)]
    if _evidence_floor(j) < j.noise and sum(shares) <= j.noise:
        # above one run's floor only: the drift between runs that raised the other does not
        # move calls or shapes
        floor = (f"floor of one run, {_evidence_floor(j) * 100:.3g} % (the drift between runs "
                 f"moves neither calls nor shapes; {floor})")
    return (f"B is {j.verdict}, by its {j.decided_by}: {', '.join(said)}, above the {floor}, "
            f"which the step times alone ({base}) {steps}; {which} not move with the "
            "machine's load")


def _unjudged_calls(calls_us: float, lines: Any, step_us: float, notes: list[str]) -> None:
    """With no change beyond noise, a change in calls that would cost time (new calls, a
    recompute) is still named in a note: the steps were too noisy to judge it, not the program
    unchanged."""
    if abs(calls_us) <= 0.01 * step_us:
        return
    sign = 1 if calls_us > 0 else -1
    where = ""
    if not lines.empty:
        top = lines.loc[(sign * lines["from_calls_us"]).idxmax()]
        if sign * float(top["from_calls_us"]) > 0:
            where = f", the most at {short_source(str(top['source']))} ({top['ops']})"
    notes.append(f"B makes {'more' if sign > 0 else 'fewer'} calls than A, {calls_us:+.4g} us a "
                 f"step at A's time per call{where}: within the noise of these step times, so "
                 "not judged; profile on a quieter machine, more steps, or with repeats "
                 "(--repeat-a) to judge it")


def _call_sites(p: Any) -> dict[str, set[str]]:
    """Top-level module name -> the `file:line`s that called it, over a profile's windows."""
    out: dict[str, set[str]] = {}
    w = getattr(p, "windows", None)
    if w is None or getattr(w, "empty", True) or "module_call_lines" not in w:
        return out
    for sites in w["module_call_lines"]:
        if isinstance(sites, dict):
            for mod, lines in sites.items():
                out.setdefault(str(mod), set()).update(str(x) for x in lines or ())
    return out


def _new_call_sites(pa: Any, pb: Any) -> list[tuple[str, str]]:
    """(module, file:line) of each top-level module call B makes from a line A never calls it
    from, in a file A's calls come from too: the same script, so the line is a new call and
    not the same call moved to another copy of it."""
    a, b = _call_sites(pa), _call_sites(pb)
    out = []
    for mod, lines in sorted(b.items()):
        files_a = {x.rpartition(":")[0] for x in a.get(mod, ())}
        for site in sorted(lines - a.get(mod, set())):
            if site.rpartition(":")[0] in files_a:
                out.append((mod, site))
    return out


# ---- step times ----------------------------------------------------------------------------------
def _step_times(steps: Any) -> list[float]:
    """One time per profiled step: with several ranks the slowest rank's (it gates the step)."""
    if steps.empty:
        return []
    return [float(v) for v in steps.groupby(["window", "step"])["step_us"].max().tolist()]


def _breakdown(a: Any, b: Any) -> Any:
    import pandas as pd
    rows = []
    for phase in (*PHASES, "step", "comm", "tools"):
        col = f"{phase}_us"
        va = float(a[col].mean()) if col in a and not a.empty else math.nan
        vb = float(b[col].mean()) if col in b and not b.empty else math.nan
        rows.append({"phase": phase, "a_us": va, "b_us": vb, "delta_us": vb - va})
    return pd.DataFrame(rows)


# ---- one side's figures, ranks -------------------------------------------------------------------
def _side(p: Any) -> dict[str, Any]:
    s = p.summary or {}
    peaks = {}
    if not p.memory.empty:
        for dev, g in p.memory.groupby("device"):
            peaks[str(dev)] = int(g["allocated_bytes"].max())
    ops = p.ops
    stacks = bool("source" in ops and (ops["source"].fillna("") != "").any())
    return {"steps": int(len(p.steps)), "ranks": int(s.get("ranks") or 0),
            "peak_memory_bytes": peaks, "comm_share": s.get("comm_share"),
            "tools": s.get("tools") or {}, "dump_on": bool(s.get("dump_on")),
            "slowest_rank": s.get("slowest_rank"), "stacks": stacks,
            "device_us": float(ops["device_us"].sum()) if "device_us" in ops else 0.0,
            "traces": [str(t) for t in p.traces]}


def _rank_diff(pa: Any, pb: Any) -> tuple[Any, int | None]:
    import pandas as pd
    cols = ["rank", "step_a_us", "step_b_us", "change"]
    if pa.steps.empty or pb.steps.empty:
        return pd.DataFrame(columns=cols), None
    ga = pa.steps.groupby("rank")["step_us"].median().rename("step_a_us")
    gb = pb.steps.groupby("rank")["step_us"].median().rename("step_b_us")
    r = pd.concat([ga, gb], axis=1, join="inner").reset_index()
    r["change"] = r["step_b_us"] / r["step_a_us"] - 1
    r = r[cols]
    slower = int(r.loc[r["change"].idxmax(), "rank"]) if len(r) > 1 else None
    return r, slower



# ---- words ---------------------------------------------------------------------------------------
def _ms(us: float) -> str:
    return "n/a" if us is None or math.isnan(us) else f"{us / 1e3:.4g} ms"


def _pct(change: float) -> str:
    return "n/a" if change is None or math.isnan(change) else f"{change * 100:+.3g} %"


def _finding(c: Cause) -> dict[str, Any]:
    """A typed cause as plain data: its type, what it rests on, its fields."""
    from dataclasses import asdict
    return {"type": type(c).__name__, **asdict(c), "kind": c.kind.value}


def _clean(v: Any) -> Any:
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return None
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v
