"""`sleuth profile RUN`: top ops, top modules, the step breakdown, the summary and, with several
ranks, the cluster table, read from RUN/profile by `profiler.read_profile`."""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "profile", help="summarize a run's profile (ops, modules, step breakdown, ranks)",
        description="Print the top ops and modules, the step-time breakdown (data, forward, "
        "backward, optimizer, other), step time, tokens/s, MFU and communication share of the "
        "profiled windows in RUN/profile, and the per-rank cluster table when several ranks "
        "were profiled.")
    p.add_argument("run_dir", metavar="RUN", type=Path, help="run directory (holds profile/rank*/)")
    p.add_argument("--top", type=int, default=10, metavar="N", help="rows of ops and modules (10)")
    p.add_argument("--csv", type=Path, metavar="DIR",
                   help="also write ops, modules, steps, memory and cluster tables as CSV to DIR")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(run=_run)


def _top(df: Any, by: list[str], sort: str, n: int) -> Any:
    if df.empty:
        return df
    num = [c for c in df.select_dtypes("number").columns if c not in ("rank", "window", "step")]
    agg = df.groupby(by, dropna=False)[num].sum(min_count=1).reset_index()
    return agg.sort_values(sort, ascending=False).head(n)


def _clean(value: Any) -> Any:
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    return value


def _run(args: argparse.Namespace) -> int:
    import profiler
    from sleuth.cli import CliError
    if args.top < 1:
        raise CliError("--top must be >= 1")
    try:
        prof = profiler.read_profile(args.run_dir)
    except profiler.ProfilerError as e:
        raise CliError(str(e)) from e
    ops = _top(prof.ops, ["name"], "cpu_self_us", args.top)
    if "device_us" in ops and ops["device_us"].sum() > 0:
        ops = _top(prof.ops, ["name"], "device_us", args.top)
    mods = _top(prof.modules, ["module", "type"], "forward_total_us", args.top)
    phases = ["step_us", "data_us", "forward_us", "backward_us", "optimizer_us", "other_us",
              "comm_us", "tools_us"]
    breakdown = (prof.steps.groupby("rank")[phases].mean().reset_index()
                 if not prof.steps.empty else prof.steps)
    if args.csv:
        args.csv.mkdir(parents=True, exist_ok=True)
        for name in ("ops", "modules", "steps", "memory", "cluster"):
            getattr(prof, name).to_csv(args.csv / f"{name}.csv", index=False)
    if args.json:
        out = {"summary": {k: _clean(v) for k, v in prof.summary.items()},
               "top_ops": json.loads(ops.to_json(orient="records")),
               "top_modules": json.loads(mods.to_json(orient="records")),
               "steps": json.loads(breakdown.to_json(orient="records")),
               "cluster": json.loads(prof.cluster.to_json(orient="records")),
               "traces": [str(p) for p in prof.traces]}
        print(json.dumps(out, indent=1))
        return 0
    s = prof.summary

    def fmt(v: Any, unit: str = "", scale: float = 1.0, digits: int = 3) -> str:
        return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v * scale:.{digits}g}{unit}"

    print(f"profile of {args.run_dir}: {s['ranks']} rank(s), {s['windows']} window(s), {s['steps']} step(s)")
    print(f"  step time {fmt(s['step_time_s'], ' ms', 1e3)}   tokens/s {fmt(s['tokens_per_s'])} (per rank)   "
          f"MFU {fmt(s['mfu'], ' %', 100)} (peak {fmt(s['peak_tflops'])} TFLOP/s)   "
          f"comm share {fmt(s['comm_share'], ' %', 100)}")
    if s.get("clamped_events"):
        print(f"  note: {s['clamped_events']} negative profiler times were clamped to 0")
    if s.get("tools"):
        per_step = sum(s["tools"].values())
        parts = ", ".join(f"{name} {fmt(us, ' ms', 1e-3)}" for name, us in s["tools"].items())
        print(f"  {'the dump was on in these steps: ' if s.get('dump_on') else ''}Sleuth's own "
              f"work took {fmt(per_step, ' ms', 1e-3)} a step ({parts}; "
              f"{fmt(s.get('tool_share'), ' %', 100)} of the step time), inside the phases "
              f"below (tools_us) and left out of the op table; the model's step without it: "
              f"{fmt(s['step_time_s'] - per_step / 1e6, ' ms', 1e3)}")
    print("\nstep breakdown (mean per step, us):")
    print(breakdown.round(1).to_string(index=False))
    print(f"\ntop {args.top} ops (us, summed over windows and ranks):")
    print(ops.round(1).to_string(index=False) if not ops.empty else "  (none)")
    print(f"\ntop {args.top} modules (us):")
    print(mods.round(1).to_string(index=False) if not mods.empty else
          "  (no module ranges: profile with with_modules=True)")
    if len(prof.cluster) > 1:
        print("\nranks:")
        print(prof.cluster.round(4).to_string(index=False))
        print(f"  slowest rank {s.get('slowest_rank')}, spread {fmt(s.get('step_time_spread'), ' %', 100)}")
    print("\ntraces (open in https://ui.perfetto.dev):")
    for p in prof.traces:
        print(f"  {p}")
    return 0
