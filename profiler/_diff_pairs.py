"""Ops, modules, source lines and the user's builtin calls paired across two profiles, per step.

Part of `profiler.diff_profiles` (profiler._diff): each table sums one side's rows by their
pairing key, divides by the side's profiled (rank, step) pairs, merges the two sides, and ranks
the rows by their contribution to the difference in time per step (`delta_us`), with the part
that more or fewer calls explain (`from_calls_us`).
"""
from __future__ import annotations

from typing import Any

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


def op_diff(a: Any, b: Any, na: int, nb: int, stacks: bool) -> Any:
    """Ops paired across the runs by name, input shapes and, where both profiles name it, the
    module they ran in (the same op in two modules is two rows); never by source line: the
    same op of a script copied elsewhere (train.py, train_sleep.py) is one op. Each side's
    user lines (an op's `caller`, else its `source`) are kept as `source_a` / `source_b`;
    `source` is B's (A's for an op in A only)."""
    import pandas as pd
    cols = {"calls": "calls", "cpu_self_us": "self", "cpu_total_us": "total",
            "device_us": "device"}
    by_module = _has_modules(a) and _has_modules(b)
    keys = ["name", "input_shapes", "module"]
    frames, lines = [], []
    for df, n in ((a, na), (b, nb)):
        for col in ("source", "caller", "input_shapes", "module"):
            df = df if col in df or df.empty else df.assign(**{col: ""})
        if not df.empty:
            # an op made inside an installed library (a Hugging Face model) is judged at the
            # user's line that called it: the one a user can change
            caller = df["caller"].fillna("").astype(str)
            df = df.assign(input_shapes=df["input_shapes"].fillna("").astype(str),
                           source=caller.where(caller != "", df["source"].fillna("").astype(str)),
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


SHAPES_SEP = " + "
"""Between the input shapes of an op's calls of one site summed into one row (`_pair_reshaped`)."""


def shape_size(shapes: str) -> int:
    """The elements an op's input shapes hold together ("[[16, 128], [128]]": 2176; several
    calls' shapes joined by SHAPES_SEP: their sum), for ordering calls of one site by size and
    telling larger inputs from smaller; 0 where the text is no list of shapes."""
    total = 0
    for call in shapes.split(SHAPES_SEP):
        for part in call.replace(" ", "").split("],["):
            dims = [int(x) for x in part.strip("[]").split(",") if x.lstrip("-").isdigit()]
            if dims:
                n = 1
                for d in dims:
                    n *= d
                total += n
    return total


_SIDE_COLS = ("calls", "self", "total", "device")


def _pair_reshaped(m: Any) -> Any:
    """One row for an op whose input shapes alone changed (a hidden size of 128 against 1024,
    a sequence twice as long): ops in A only and in B only with the same name and module,
    called from the same user lines, are the same calls of the same op, and as two rows each
    would be blamed for all of its time ("in B only"). Where such a site has the same number
    of rows on each side (a loop over layers, attention's two matmuls at one line), they pair
    in order of their inputs' size, smallest with smallest. A site with more rows on one side
    (two of A's calls had one shape, B's three differ) cannot be paired call for call: each
    side's rows are summed into one row found in both, their shapes joined by SHAPES_SEP, so
    its change of calls and of time is still the site's and never "in B only". Every op
    without a line (no stacks) stays as it is: nothing ties it to its partner."""
    a_only = m[(m["side"] == "A only") & (m["source_a"] != "")]
    b_only = m[(m["side"] == "B only") & (m["source_b"] != "")]
    if a_only.empty or b_only.empty:
        return m
    groups_a: dict[tuple, list] = {}
    groups_b: dict[tuple, list] = {}
    for idx, key in zip(a_only.index, zip(a_only["name"], a_only["module"], a_only["source_a"])):
        groups_a.setdefault(key, []).append(idx)
    for idx, key in zip(b_only.index, zip(b_only["name"], b_only["module"], b_only["source_b"])):
        groups_b.setdefault(key, []).append(idx)
    drop = []
    for key, rows_a in groups_a.items():
        rows_b = groups_b.get(key, [])
        if not rows_b:
            continue
        rows_a = sorted(rows_a, key=lambda i: shape_size(str(m.at[i, "input_shapes_a"])))
        rows_b = sorted(rows_b, key=lambda i: shape_size(str(m.at[i, "input_shapes_b"])))
        if len(rows_a) != len(rows_b):
            for rows, side in ((rows_a, "a"), (rows_b, "b")):
                for col in _SIDE_COLS:
                    m.at[rows[0], f"{col}_{side}"] = sum(float(m.at[i, f"{col}_{side}"])
                                                         for i in rows)
                m.at[rows[0], f"input_shapes_{side}"] = SHAPES_SEP.join(
                    str(m.at[i, f"input_shapes_{side}"]) for i in rows)
            drop += rows_a[1:] + rows_b[1:]
            m.at[rows_b[0], "input_shapes"] = m.at[rows_b[0], "input_shapes_b"]
            rows_a, rows_b = rows_a[:1], rows_b[:1]
        for ia, ib in zip(rows_a, rows_b):
            for col in ("calls_a", "self_a", "total_a", "device_a", "source_a",
                        "input_shapes_a"):
                m.at[ib, col] = m.at[ia, col]
            m.at[ib, "side"] = "both"
            drop.append(ia)
    return m.drop(index=drop).reset_index(drop=True)


SOURCE_SEP = "; "
"""Between the lines of one op called from several places (`profiler._diff_words.short_source`
splits on it)."""


def _sources_by(df: Any, keys: list[str]) -> dict[tuple[str, ...], str]:
    """Each op's source lines on one side, the busiest first, joined by SOURCE_SEP."""
    out: dict[tuple[str, ...], str] = {}
    known = df[df["source"] != ""]
    for key, g in known.groupby(keys, dropna=False):
        order = g.groupby("source")["cpu_self_us"].sum().sort_values(ascending=False)
        out[tuple(key)] = SOURCE_SEP.join(order.index)
    return out


def module_diff(a: Any, b: Any, na: int, nb: int) -> Any:
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


def rank(df: Any, descending: bool) -> Any:
    if df.empty:
        return df.reset_index(drop=True)
    return df.sort_values("delta_us", ascending=not descending, kind="stable").reset_index(drop=True)


def empty_lines() -> Any:
    import pandas as pd
    return pd.DataFrame(columns=["source", "delta_us", "from_calls_us", "ops", "side"])


def line_diff(ops: Any, descending: bool) -> Any:
    """Contributions summed per user line; ops without a line are left out."""
    import pandas as pd
    known = ops[ops["source"] != ""]
    if known.empty:
        return empty_lines()
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
    return rank(pd.DataFrame(rows), descending)


def host_diff(pa: Any, pb: Any, na: int, nb: int, descending: bool) -> Any:
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
    return rank(m[cols], descending)
