"""`sleuth profile diff A B`: why is run B slower than run A (`profiler.diff_profiles`).

Reached through `sleuth profile` (`sleuth profile diff A B`), whose parser carries the options;
this module renders the comparison as text, `--json` or `--csv` tables. Exit 0 when B is not
slower beyond noise, 1 when it is, 2 when a profile cannot be read.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

# the shapes are shown: ops pair by them, so without them one op's rows of two shapes read as
# the same row twice
_OP_SHOW = ["name", "shapes", "module", "source", "side", "calls_a", "calls_b", "self_a_us", "self_b_us",
            "total_a_us", "total_b_us", "delta_us", "from_calls_us"]
_MOD_SHOW = ["module", "type", "side", "calls_a", "calls_b", "self_a_us", "self_b_us",
             "total_a_us", "total_b_us", "delta_us", "from_calls_us"]


def run_diff(args: argparse.Namespace, a: Path, b: Path) -> int:
    import profiler
    from profiler._diff_words import short_source
    from sleuth.cli import CliError

    repeat_a, repeat_b = args.repeat_a, args.repeat_b
    for side, path in (("A", a), ("B", b), *(("--repeat-a", r) for r in repeat_a),
                       *(("--repeat-b", r) for r in repeat_b)):
        if not path.is_dir():
            raise CliError(f"{side} ({path}) is not a run directory: give run directories "
                           "that hold profile/rank*/")
    try:
        d = profiler.diff_profiles(a, b, repeat_a=repeat_a, repeat_b=repeat_b,
                                   threshold=args.threshold)
    except profiler.ProfilerError as e:
        raise CliError(str(e)) from e
    top = args.top
    if args.csv:
        args.csv.mkdir(parents=True, exist_ok=True)
        for name in ("breakdown", "ops", "modules", "lines", "ranks", "gpu", "kernels",
                     "gpu_ranks", "kernels_ranks", "host"):
            getattr(d, name).to_csv(args.csv / f"{name}.csv", index=False)
        _sides_frame(d).to_csv(args.csv / "sides.csv", index=False)
    if args.json:
        print(json.dumps(d.to_dict(), indent=1))
        return d.exit_code
    print(f"profile diff: A = {a}, B = {b}")
    for label, more in (("A", repeat_a), ("B", repeat_b)):
        if more:
            print(f"  repeats of {label}: {', '.join(map(str, more))}")
    print(d.headline())
    if d.causes:
        print("\nwhat accounts for it, the likeliest first:")
        for i, c in enumerate(d.causes, 1):
            print(f"  {i}. {c}")
    for note in d.notes:
        print(f"note: {note}")
    print("\nstep breakdown (mean us per step):")
    print(_table(d.breakdown))
    ops = d.ops.head(top)
    ops = ops.assign(source=[_both_lines(x, y, short_source) for x, y in
                             zip(ops["source_a"], ops["source_b"])],
                     shapes=[_both_lines(x, y, str) for x, y in
                             zip(ops["input_shapes_a"], ops["input_shapes_b"])])[_OP_SHOW]
    print(f"\nops by contribution to the difference (top {top}; us and calls per step):")
    print(_table(ops) if not ops.empty else "  (none)")
    only = d.ops[d.ops["side"] != "both"]
    if not only.empty:
        print("\nops found in one run only:")
        show = only.assign(time_us=only["self_b_us"].where(only["side"] == "B only",
                                                           only["self_a_us"]),
                           calls=only["calls_b"].where(only["side"] == "B only", only["calls_a"]),
                           source=only["source"].map(short_source))
        show = show.reindex(show["time_us"].abs().sort_values(ascending=False).index)
        print(_table(show[["name", "input_shapes", "module", "side", "calls", "time_us",
                           "source"]].head(top).rename(columns={"input_shapes": "shapes"})))
    mods = d.modules.head(top)[_MOD_SHOW]
    print(f"\nmodules by contribution (top {top}; self = forward + backward self time):")
    print(_table(mods) if not mods.empty else
          "  (no module ranges: profile with with_modules=True)")
    if not d.lines.empty:
        print(f"\nsource lines by contribution (top {top}):")
        print(_table(d.lines.head(top).assign(source=lambda f: f["source"].map(short_source))))
    _print_gpu(d, top)
    print("\nside by side:")
    for label, key in (("A", "a"), ("B", "b")):
        s = d.sides[key]
        peaks = ", ".join(f"{dev} {v / 2**20:.4g} MiB" for dev, v in s["peak_memory_bytes"].items())
        comm = s["comm_share"]
        print(f"  {label}: {s['steps']} step(s) on {s['ranks']} rank(s); memory peak "
              f"{peaks or 'n/a'}; comm share {_pct(comm)}"
              + (f"; slowest rank {s['slowest_rank']}" if s.get("slowest_rank") is not None else ""))
    if len(d.ranks) > 1:
        print("\nranks (median step, us):")
        print(_table(d.ranks))
        print(f"  the rank that got slower the most: {d.slower_rank}")
    print("\ntraces (open in https://ui.perfetto.dev):")
    for label, key in (("A", "a"), ("B", "b")):
        for t in d.sides[key]["traces"]:
            print(f"  {label}: {t}")
    return d.exit_code


def _print_gpu(d: Any, top: int) -> None:
    """GPU time side by side, kernel time by module; nothing when neither trace has GPU events
    (the notes above say so)."""
    if d.gpu is None or d.gpu.empty:
        return
    shares = d.gpu["key"] == "overlap_share"
    gpu = d.gpu[~shares][["figure", "a", "b", "delta"]]
    print("\nGPU time (us per step; idle = host-bound + data-bound + waiting on communication):")
    print(_table(gpu))
    share = d.gpu[shares].iloc[0]
    print(f"  share of communication overlapped by compute: A {_pct(share['a'])}, "
          f"B {_pct(share['b'])}")
    if d.kernels is not None and not d.kernels.empty:
        print(f"\nkernel time by module (top {top}; us per step, nested modules included):")
        print(_table(d.kernels.head(top)))
    r = d.gpu_ranks
    if r is None or r.empty or r["rank"].nunique() < 2:
        return
    import pandas as pd
    wide = r.pivot(index="rank", columns="key", values=["a", "b"])
    cols = {}
    for key, short in (("gpu_idle_us", "idle"), ("host_wait_us", "host"),
                       ("data_wait_us", "data"), ("comm_wait_us", "comm"),
                       ("overlap_share", "overlap_%")):
        for side in ("a", "b"):
            v = wide[(side, key)]
            cols[short.replace("_%", f"_{side}_%") if "%" in short else f"{short}_{side}"] = (
                v * 100 if key == "overlap_share" else v)
    print("\nGPU time per rank (us per step: idle and its host-bound, data-bound and "
          "communication parts; % of communication overlapped by compute):")
    print(_table(pd.DataFrame(cols).reset_index()))
    for line in d.rank_lines():
        print(f"  {line}")
    k = d.kernels_ranks
    if k is not None and not k.empty:
        print(f"\nkernel time by module per rank (top {top} of each; us per step):")
        print(_table(k.groupby("rank", sort=True).head(top)))


def _sides_frame(d: Any) -> Any:
    """The side-by-side figures of each run as a table (`sides.csv`): steps, ranks, memory
    peak per device, communication share, slowest rank, stacks, dump, kernel time."""
    import pandas as pd
    rows = []
    for label, key in (("A", "a"), ("B", "b")):
        s = d.sides[key]
        row = {"side": label, "run": d.a if key == "a" else d.b, "steps": s["steps"],
               "ranks": s["ranks"], "comm_share": s["comm_share"],
               "slowest_rank": s.get("slowest_rank"), "stacks": s["stacks"],
               "dump_on": s["dump_on"], "device_us": s["device_us"]}
        for dev, v in s["peak_memory_bytes"].items():
            row[f"peak_memory_bytes_{dev}"] = v
        rows.append(row)
    return pd.DataFrame(rows)


def _both_lines(a: str, b: str, short: Any) -> str:
    """An op's source line (or input shapes) as each run has it: one when the two agree (or one
    side has none), else `A x | B y` (ops pair by name and shapes, so a script run from another
    path, or edited, has its line per side; an op whose shapes alone changed pairs by its
    line, and has its shapes per side)."""
    a, b = short(a) if a else "", short(b) if b else ""
    if not a or not b or a == b:
        return b or a
    return f"A {a} | B {b}"


def _pct(v: Any) -> str:
    return "n/a" if not isinstance(v, (int, float)) or math.isnan(v) else f"{v * 100:.3g} %"


def _table(df: Any) -> str:
    import pandas as pd
    with pd.option_context("display.width", 200, "display.max_columns", 20,
                           "display.max_colwidth", 60):
        return df.round(1).to_string(index=False)
