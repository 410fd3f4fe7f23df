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
- with stacks, the same contributions summed per source line, which is the first cause named,
  unless most of the change is time outside any op (a sleep, Python work, a sync), which is
  then named first with the breakdown's phase that holds it;
- memory peak and communication share; across ranks, the slowest rank and the one that got
  slower;
- on traces with GPU events, GPU time side by side (profiler._gpu_time): idle time per step
  split into host-bound, data-bound and waiting on communication, compute/communication
  overlap, and kernel time by module; a CPU trace says it has no GPU figures.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from profiler._diff_gpu import gpu_cause, gpu_diff, gpu_rank_diff
from profiler._noise import Judgement, Spread, judge, spread

PHASES = ("data", "forward", "backward", "optimizer", "other")
"""The step breakdown's parts; they sum to the step time."""


@dataclass
class ProfileDiff:
    """The comparison of two profiles, B against A (times in microseconds per step).

    judgement: the verdict on step time (`verdict`, `change`, p-values, noise floor).
    step_a, step_b: step-time spread of each run (n, median, q1, q3, mean).
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
    causes: sentences naming what accounts for the difference, the likeliest first; time
        outside any op (the step's change that the ops' own time does not hold) before every
        cause that explains less of the change.
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
    notes: list[str] = field(default_factory=list)
    slower_rank: int | None = None
    """The rank whose step time grew the most (several ranks only)."""
    gpu: Any = None
    kernels: Any = None
    gpu_ranks: Any = None
    """rank, figure, key, a, b, delta: the `gpu` figures of each rank, A's rank beside B's."""
    kernels_ranks: Any = None
    """rank, module, type, kernel_a_us, kernel_b_us, delta_us: `kernels` of each rank."""
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
        floor = f"noise floor {j.noise * 100:.3g} %"
        if j.tested:
            p = j.p_slower if j.verdict != "faster" else j.p_faster
            floor += f", Mann-Whitney p = {p:.3g}"
        else:
            floor += ", too few steps for a test"
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
            "headline": self.headline(), "causes": self.causes, "notes": self.notes,
            "step_time": {"change": j.change, "p_slower": j.p_slower, "p_faster": j.p_faster,
                          "noise_floor": j.noise, "tested": j.tested,
                          "a": vars(self.step_a) | {"quartile_deviation": self.step_a.quartile_deviation},
                          "b": vars(self.step_b) | {"quartile_deviation": self.step_b.quartile_deviation}},
            "breakdown": records(self.breakdown), "ops": records(self.ops),
            "modules": records(self.modules), "lines": records(self.lines),
            "ranks": records(self.ranks), "slower_rank": self.slower_rank,
            "gpu": records(self.gpu), "kernels": records(self.kernels),
            "gpu_ranks": records(self.gpu_ranks), "kernels_ranks": records(self.kernels_ranks),
            "host": records(self.host),
            "sides": {k: {kk: (str(vv) if isinstance(vv, Path) else vv) for kk, vv in v.items()}
                      for k, v in self.sides.items()},
        })


def diff_profiles(a: Any, b: Any, *, threshold: float = 0.05, alpha: float = 0.05) -> ProfileDiff:
    """Compare the profiles of two runs: why is B slower than A, or is it not.

    Args:
        a, b: run directories (holding profile/rank*/) or `profiler.Profile` objects.
        threshold: the smallest relative change of the median step called a change (0.05).
        alpha: the Mann-Whitney significance level (0.05).

    Returns a ProfileDiff. Raises ProfileFormatError when a profile cannot be read, and
    ProfilerError for a threshold or alpha out of range.
    """
    from profiler._errors import ProfilerError
    from profiler._reader import read_profile

    if not (0 <= threshold < 10 and 0 < alpha < 1):
        raise ProfilerError(f"threshold must be in [0, 10) and alpha in (0, 1), got "
                            f"{threshold!r} and {alpha!r}")
    names = [str(x) if isinstance(x, (str, os.PathLike)) else getattr(x, "name", "profile")
             for x in (a, b)]
    pa, pb = (read_profile(x) if isinstance(x, (str, os.PathLike)) else x for x in (a, b))
    ta, tb = _step_times(pa.steps), _step_times(pb.steps)
    j = judge(ta, tb, threshold=threshold, alpha=alpha)
    notes: list[str] = []
    if not j.tested:
        notes.append(f"fewer than 3 profiled steps on a side ({len(ta)} and {len(tb)}): the "
                     "noise floor alone decided; profile more steps (active=) for a test")
    if j.noise > 2 * threshold:
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
    descending = j.verdict != "faster"
    ops = _rank(_op_diff(pa.ops, pb.ops, na, nb, stacks), descending)
    mods = _rank(_module_diff(pa.modules, pb.modules, na, nb), descending)
    lines = _line_diff(ops, descending) if stacks else _empty_lines()
    ranks, slower_rank = _rank_diff(pa, pb)
    gpu, kernels = gpu_diff(pa, pb, na, nb, notes, descending)
    gpu_ranks, kernels_ranks = gpu_rank_diff(pa, pb, descending)
    out = ProfileDiff(a=names[0], b=names[1], judgement=j, step_a=spread(ta), step_b=spread(tb),
                      breakdown=_breakdown(pa.steps, pb.steps), ops=ops, modules=mods,
                      lines=lines, ranks=ranks, sides={"a": sa, "b": sb}, notes=notes,
                      slower_rank=slower_rank, gpu=gpu, kernels=kernels,
                      gpu_ranks=gpu_ranks, kernels_ranks=kernels_ranks,
                      host=_host_diff(pa, pb, na, nb, descending))
    out.causes = _causes(out)
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
    for name in (*PHASES, "step", "comm", "tools"):
        col = f"{name}_us"
        va = float(a[col].mean()) if col in a and not a.empty else math.nan
        vb = float(b[col].mean()) if col in b and not b.empty else math.nan
        rows.append({"phase": name, "a_us": va, "b_us": vb, "delta_us": vb - va})
    return pd.DataFrame(rows)


# ---- ops and modules -----------------------------------------------------------------------------
_OP_COLS = ["name", "input_shapes", "input_shapes_a", "input_shapes_b", "module", "source",
            "source_a", "source_b", "side",
            "calls_a", "calls_b", "self_a_us", "self_b_us", "total_a_us", "total_b_us",
            "device_a_us", "device_b_us", "delta_us", "from_calls_us"]
_MOD_COLS = ["module", "type", "source", "side", "calls_a", "calls_b", "self_a_us", "self_b_us",
             "total_a_us", "total_b_us", "device_a_us", "device_b_us", "delta_us", "from_calls_us"]


def _per_step(df: Any, keys: list[str], cols: dict[str, str], n: int) -> Any:
    """Sum `cols` (source column -> output name) by `keys`, divided by n steps."""
    import pandas as pd
    if df.empty:
        return pd.DataFrame(columns=[*keys, *cols.values()])
    g = df.groupby(keys, dropna=False)[list(cols)].sum().reset_index()
    for c in cols:
        g[c] = g[c].astype(float) / n
    return g.rename(columns=cols)


def _merge(a: Any, b: Any, keys: list[str]) -> Any:
    m = a.merge(b, on=keys, how="outer", suffixes=("_a", "_b"), indicator=True)
    m["side"] = m.pop("_merge").map({"both": "both", "left_only": "A only", "right_only": "B only"})
    num = [c for c in m.columns if c.endswith(("_a", "_b"))]
    m[num] = m[num].fillna(0.0)
    return m


def _contribution(m: Any) -> Any:
    """Sets `delta_us`, the change in self time (or in kernel time where that is larger: GPU
    traces), and `from_calls_us`, the part of it that more or fewer calls explain at the
    cheaper side's time per call. Calls do not change with the machine's load, time per call
    does: the causes prefer the part from calls (module docstring of profiler._diff)."""
    cpu = m["self_b"] - m["self_a"]
    dev = m["device_b"] - m["device_a"]
    use_dev = cpu.abs() < dev.abs()
    m["delta_us"] = cpu.where(~use_dev, dev)
    a = m["self_a"].where(~use_dev, m["device_a"])
    b = m["self_b"].where(~use_dev, m["device_b"])
    per_a = a / m["calls_a"].where(m["calls_a"] > 0)
    per_b = b / m["calls_b"].where(m["calls_b"] > 0)
    per_call = per_a.where(per_b.isna() | (per_a <= per_b), per_b).fillna(0.0)
    m["from_calls_us"] = (m["calls_b"] - m["calls_a"]) * per_call
    return m


def _has_modules(df: Any) -> bool:
    return "module" in df and bool((df["module"].fillna("") != "").any())


def _op_diff(a: Any, b: Any, na: int, nb: int, stacks: bool) -> Any:
    """Ops paired across the runs by name, input shapes and, where both profiles name it, the
    module they ran in (the same op in two modules is two rows); never by source line: the
    same op of a script copied elsewhere (train.py, train_sleep.py) is one op. Each side's
    lines are kept as `source_a` / `source_b`; `source` is B's (A's for an op in A only)."""
    import pandas as pd
    cols = {"calls": "calls", "cpu_self_us": "self", "cpu_total_us": "total",
            "device_us": "device"}
    by_module = _has_modules(a) and _has_modules(b)
    keys = ["name", "input_shapes", "module"]
    frames, lines = [], []
    for df, n in ((a, na), (b, nb)):
        for col in ("source", "input_shapes", "module"):
            df = df if col in df or df.empty else df.assign(**{col: ""})
        if not df.empty:
            df = df.assign(input_shapes=df["input_shapes"].fillna("").astype(str),
                           source=df["source"].fillna("").astype(str),
                           module=df["module"].fillna("").astype(str) if by_module else "")
        frames.append(_per_step(df, keys, cols, n))
        lines.append(_sources_by(df, keys) if stacks and not df.empty else {})
    if frames[0].empty and frames[1].empty:
        return pd.DataFrame(columns=_OP_COLS)
    m = _merge(frames[0], frames[1], keys)
    at = list(zip(m["name"], m["input_shapes"], m["module"]))
    m["source_a"] = [lines[0].get(k, "") for k in at]
    m["source_b"] = [lines[1].get(k, "") for k in at]
    m["input_shapes_a"] = m["input_shapes"].where(m["side"] != "B only", "")
    m["input_shapes_b"] = m["input_shapes"].where(m["side"] != "A only", "")
    m = _pair_reshaped(m)
    m["source"] = m["source_b"].where(m["source_b"] != "", m["source_a"])
    return _rename_sides(_contribution(m))[_OP_COLS]


def _pair_reshaped(m: Any) -> Any:
    """One row for an op whose input shapes alone changed (a hidden size of 128 against 1024):
    an op in A only and one in B only with the same name and module, called from the same user
    lines, are the same call of the same op, and as two rows each would be blamed for all of
    its time. Paired only where exactly one such row is on each side; several (a loop over
    layers of different sizes at one line) cannot be told apart and stay as they are, as does
    every op without a line (no stacks), which nothing ties to its partner."""
    a_only = m[(m["side"] == "A only") & (m["source_a"] != "")]
    b_only = m[(m["side"] == "B only") & (m["source_b"] != "")]
    if a_only.empty or b_only.empty:
        return m
    key_a = list(zip(a_only["name"], a_only["module"], a_only["source_a"]))
    key_b = list(zip(b_only["name"], b_only["module"], b_only["source_b"]))
    drop = []
    for k in {k for k in key_a if key_a.count(k) == 1 and key_b.count(k) == 1}:
        ia, ib = a_only.index[key_a.index(k)], b_only.index[key_b.index(k)]
        for col in ("calls_a", "self_a", "total_a", "device_a", "source_a", "input_shapes_a"):
            m.at[ib, col] = m.at[ia, col]
        m.at[ib, "side"] = "both"
        drop.append(ia)
    return m.drop(index=drop).reset_index(drop=True)


SOURCE_SEP = "; "
"""Between the lines of one op called from several places (`_short` splits on it)."""


def _sources_by(df: Any, keys: list[str]) -> dict[tuple[str, ...], str]:
    """Each op's source lines on one side, the busiest first, joined by SOURCE_SEP."""
    out: dict[tuple[str, ...], str] = {}
    known = df[df["source"] != ""]
    for key, g in known.groupby(keys, dropna=False):
        order = g.groupby("source")["cpu_self_us"].sum().sort_values(ascending=False)
        out[tuple(key)] = SOURCE_SEP.join(order.index)
    return out


def _module_diff(a: Any, b: Any, na: int, nb: int) -> Any:
    import pandas as pd
    frames = []
    for df, n in ((a, na), (b, nb)):
        if df.empty:
            frames.append(pd.DataFrame(columns=["module", "calls", "self", "total", "device"]))
            continue
        df = df.assign(self_us=df["forward_self_us"] + df["backward_self_us"],
                       tot_us=df["forward_total_us"] + df["backward_total_us"],
                       dev_us=df["forward_device_us"] + df["backward_device_us"])
        frames.append(_per_step(df, ["module"], {"calls": "calls", "self_us": "self",
                                                 "tot_us": "total", "dev_us": "device"}, n))
    if frames[0].empty and frames[1].empty:
        return pd.DataFrame(columns=_MOD_COLS)
    m = _merge(frames[0], frames[1], ["module"])
    info = pd.concat([x for x in (b, a) if not x.empty])
    first = info.drop_duplicates("module").set_index("module")
    m["type"] = m["module"].map(first["type"]).fillna("")
    m["source"] = (m["module"].map(first["source"]).fillna("") if "source" in first
                   else "")
    return _rename_sides(_contribution(m))[_MOD_COLS]


def _rename_sides(m: Any) -> Any:
    ren = {}
    for base in ("calls", "self", "total", "device"):
        for s in ("a", "b"):
            ren[f"{base}_{s}"] = f"{base}_{s}" if base == "calls" else f"{base}_{s}_us"
    return m.rename(columns=ren)


def _rank(df: Any, descending: bool) -> Any:
    if df.empty:
        return df.reset_index(drop=True)
    return df.sort_values("delta_us", ascending=not descending, kind="stable").reset_index(drop=True)


def _empty_lines() -> Any:
    import pandas as pd
    return pd.DataFrame(columns=["source", "delta_us", "from_calls_us", "ops", "side"])


def _line_diff(ops: Any, descending: bool) -> Any:
    """Contributions summed per user line; ops without a line are left out."""
    import pandas as pd
    known = ops[ops["source"] != ""]
    if known.empty:
        return _empty_lines()
    rows = []
    for src, g in known.groupby("source"):
        sides = set(g["side"])
        # one name per op: its rows of each shape and module summed
        delta, from_calls = float(g["delta_us"].sum()), float(g["from_calls_us"].sum())
        g = (g.groupby("name")[["calls_a", "calls_b", "delta_us"]].sum().reset_index()
             .sort_values("delta_us", ascending=not descending))
        named = [f"{r.name} (calls {r.calls_a:.3g} -> {r.calls_b:.3g})"
                 if abs(r.calls_b - r.calls_a) >= 0.5 else r.name for r in g.head(4).itertuples()]
        rows.append({"source": src, "delta_us": delta, "from_calls_us": from_calls,
                     "ops": ", ".join(named),
                     "side": sides.pop() if len(sides) == 1 else "both"})
    return _rank(pd.DataFrame(rows), descending)


def _host_diff(pa: Any, pb: Any, na: int, nb: int, descending: bool) -> Any:
    """The user's builtin calls, their time outside the ops they made, per step on each side,
    paired by name without the object's address (profiler._tables._host_rows); each side's
    busiest line kept."""
    import pandas as pd
    from profiler._sources import builtin_name
    cols = ["name", "source", "source_a", "source_b", "calls_a", "calls_b", "time_a_us",
            "time_b_us", "delta_us"]
    frames, lines = [], []
    for p, n in ((pa, na), (pb, nb)):
        h = getattr(p, "host", None)
        if h is None or h.empty:
            frames.append(pd.DataFrame(columns=["name", "calls", "time"]))
            lines.append({})
            continue
        # a profile written before addresses were stripped: the same call pairs by its name
        h = h.assign(name=h["name"].astype(str).map(builtin_name))
        frames.append(_per_step(h, ["name"], {"calls": "calls", "time_us": "time"}, n))
        top = h.groupby(["name", "source"])["time_us"].sum().reset_index()
        top = top.sort_values("time_us", ascending=False).drop_duplicates("name")
        lines.append(dict(zip(top["name"], top["source"].astype(str))))
    if frames[0].empty and frames[1].empty:
        return pd.DataFrame(columns=cols)
    m = _merge(frames[0], frames[1], ["name"])
    m["source_a"] = [lines[0].get(k, "") for k in m["name"]]
    m["source_b"] = [lines[1].get(k, "") for k in m["name"]]
    m["source"] = m["source_b"].where(m["source_b"] != "", m["source_a"])
    m = m.rename(columns={"time_a": "time_a_us", "time_b": "time_b_us"})
    m["delta_us"] = m["time_b_us"] - m["time_a_us"]
    return _rank(m[cols], descending)


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


def _causes(d: ProfileDiff) -> list[str]:
    """The likeliest causes first: the user line (with stacks), then the op, then the module;
    Sleuth's own work first when it accounts for more than the op."""
    if d.judgement.verdict == "no change":
        return []
    sign = 1 if d.judgement.verdict == "slower" else -1
    floor_us = 0.01 * min(d.step_a.median, d.step_b.median)  # 1 % of a step
    out: list[str] = []
    weights: list[float] = []  # each cause's microseconds a step, for ranking the outside time
    line = _pick(d.lines, sign, floor_us)
    if line is not None:
        out.append(f"{_short(line['source'])}: {_us(line['delta_us'])} a step "
                   f"({line['ops']}{_side_words(line['side'])})")
        weights.append(abs(line["delta_us"]))
    op = _pick(d.ops, sign, floor_us)
    op_delta = 0.0
    if op is not None:
        op_delta = abs(op["delta_us"])
        where = f" at {_short(op['source'])}" if op["source"] else ""
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
        src = f", forward at {_short(mod['source'])}" if mod["source"] else ""
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
            text += (f"; {_short(line['source'])} made new calls, and the Python around them "
                     "runs between ops: likely most of this time")
        out.insert(at, text)
    return out



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
            text = (f"at {_short(top['source'])}: a call of {name}(), "
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


def _side_words(side: str) -> str:
    return {"A only": "; in A only", "B only": "; in B only"}.get(side, "")


def _short(source: str) -> str:
    """A source line as a user reads it: a path inside the working folder made relative (each
    of several lines joined by SOURCE_SEP)."""
    if SOURCE_SEP in source:
        return SOURCE_SEP.join(_short(s) for s in source.split(SOURCE_SEP))
    try:
        path, line = source.rsplit(":", 1)
        for d in ("site-packages/", "dist-packages/"):
            if d in path:
                return f"{path.split(d, 1)[1]}:{line}"
        p = Path(path)
        if p.is_absolute():
            try:
                return f"{p.relative_to(Path.cwd())}:{line}"
            except ValueError:
                return source
    except ValueError:
        pass
    return source


def _us(v: float) -> str:
    return f"{v:+.4g} us"


def _dur(us: float) -> str:
    """A signed time in us, or in ms from 1 ms up."""
    return f"{us / 1e3:+.4g} ms" if abs(us) >= 1e3 else _us(us)


def _n(v: float) -> str:
    return f"{v:.3g}"


def _ms(us: float) -> str:
    return "n/a" if us is None or math.isnan(us) else f"{us / 1e3:.4g} ms"


def _pct(change: float) -> str:
    return "n/a" if change is None or math.isnan(change) else f"{change * 100:+.3g} %"


def _clean(v: Any) -> Any:
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return None
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v
