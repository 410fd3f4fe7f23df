"""`sleuth profile RUN`: top ops, top modules, the step breakdown, the summary and, with several
ranks, the cluster table, read from RUN/profile by `profiler.read_profile`."""
from __future__ import annotations

import argparse
import difflib
import json
import math
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "profile", help="summarize a run's profile, or compare two (`profile diff A B`)",
        usage="sleuth profile [options] RUN\n       sleuth profile diff [options] A B",
        description="Print the top ops and modules, the step-time breakdown (data, forward, "
        "backward, optimizer, other), step time, tokens/s, MFU and communication share of the "
        "profiled windows in RUN/profile, and the per-rank cluster table when several ranks "
        "were profiled. `sleuth profile diff A B` compares two runs: step time with its noise, "
        "the breakdown side by side, ops, modules and source lines ranked by their "
        "contribution to the difference, memory, communication, ranks; exit 0 when B is not "
        "slower beyond noise, 1 when it is, 2 when a profile cannot be read.")
    p.add_argument("run_dir", metavar="RUN", nargs="+", type=Path,
                   help="run directory (holds profile/rank*/); or `diff A B`")
    p.add_argument("--top", type=int, default=10, metavar="N", help="rows of ops and modules (10)")
    p.add_argument("--csv", type=Path, metavar="DIR",
                   help="also write every table as CSV to DIR (breakdown, ops, modules, "
                   "steps, memory, cluster, gpu, gpu_ranks, kernels, host; for diff: "
                   "breakdown, ops, modules, lines, ranks, sides, gpu, gpu_ranks, kernels, "
                   "kernels_ranks, host)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--repeat-a", type=Path, action="append", default=[], metavar="RUN",
                   help="diff: another run of A's config (repeatable): the verdict pools its "
                   "steps and its noise floor includes the variation between runs, which one "
                   "profile a side cannot see")
    p.add_argument("--repeat-b", type=Path, action="append", default=[], metavar="RUN",
                   help="diff: another run of B's config (repeatable), as --repeat-a")
    p.add_argument("--threshold", type=float, default=0.05, metavar="F",
                   help="diff: the smallest relative change of the median step called a "
                   "change (0.05); the steps' own spread can raise it")
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
    from tracer.storage import atomic_file
    if args.top < 1:
        raise CliError("--top must be >= 1")
    if args.csv is not None and args.csv.exists() and not args.csv.is_dir():
        raise CliError(f"--csv {args.csv}: that is a file; --csv takes a folder for the tables "
                       "(made if missing), e.g. --csv profile_tables")
    targets = args.run_dir
    if str(targets[0]) == "diff" and not (len(targets) == 1 and targets[0].is_dir()):
        if len(targets) != 3:
            raise CliError("usage: sleuth profile diff A B (two run directories)")
        from sleuth._cmd_profile_diff import run_diff
        return run_diff(args, targets[1], targets[2])
    if len(targets) != 1:
        first = str(targets[0])
        if len(targets) == 3 and not targets[0].exists() and \
                difflib.get_close_matches(first, ["diff"], n=1, cutoff=0.5):
            raise CliError(f"unknown subcommand {first!r}; did you mean 'diff'? "
                           "(sleuth profile diff A B)")
        raise CliError(f"one run directory expected, got {len(targets)}; to compare two runs: "
                       "sleuth profile diff A B")
    if args.repeat_a or args.repeat_b:
        raise CliError("--repeat-a and --repeat-b are for comparing two runs: sleuth profile "
                       "diff A B --repeat-a A2")
    args.run_dir = targets[0]
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
    kernels = (prof.kernels.groupby("rank", sort=True).head(args.top)
               if prof.kernels is not None and not prof.kernels.empty else None)
    if args.csv:  # every table the text shows, whole (the text shows the top rows)
        args.csv.mkdir(parents=True, exist_ok=True)
        tables = {name: getattr(prof, name) for name in
                  ("ops", "modules", "steps", "memory", "cluster", "gpu", "gpu_ranks",
                   "kernels", "host")}
        for name, df in {**tables, "breakdown": breakdown}.items():
            try:  # whole or not at all: a full disk leaves no truncated table behind
                with atomic_file(args.csv / f"{name}.csv", "w", newline="") as f:
                    df.to_csv(f, index=False)
            except OSError as e:
                raise CliError(f"cannot write {args.csv / f'{name}.csv'}: "
                               f"{e.strerror or e}; free space or pick another --csv "
                               f"folder") from e
    if args.json:
        out = {"summary": {k: _clean(v) for k, v in prof.summary.items()},
               "top_ops": json.loads(ops.to_json(orient="records")),
               "top_modules": json.loads(mods.to_json(orient="records")),
               "steps": json.loads(breakdown.to_json(orient="records")),
               "cluster": json.loads(prof.cluster.to_json(orient="records")),
               "gpu_ranks": json.loads(prof.gpu_ranks.to_json(orient="records")),
               "kernels": json.loads(prof.kernels.to_json(orient="records")),
               "traces": [str(p) for p in prof.traces]}
        print(json.dumps(out, indent=1))
        return 0
    s = prof.summary
    lines = profiler.summary_lines(s)
    print(f"profile of {args.run_dir}: {lines[0]}")
    for line in lines[1:]:
        print(f"  {line}")
    print("\nstep breakdown (mean per step, us):")
    print(breakdown.round(1).to_string(index=False))
    print(f"\ntop {args.top} ops (us, summed over windows and ranks):")
    print(ops.round(1).to_string(index=False) if not ops.empty else "  (none)")
    print(f"\ntop {args.top} modules (us):")
    print(mods.round(1).to_string(index=False) if not mods.empty else
          "  (no module ranges: profile with with_modules=True)")
    if not prof.gpu_ranks.empty:
        print("\nGPU time per rank (mean us per step; idle = host-bound + data-bound + waiting "
              "on communication; shares as fractions):")
        print(prof.gpu_ranks.round(3).to_string(index=False))
    if kernels is not None:
        print(f"\nkernel time by module (top {args.top} of each rank; us per step, nested "
              "modules included):")
        print(kernels.round(1).to_string(index=False))
    if len(prof.cluster) > 1:
        print("\nranks:")
        print(prof.cluster.round(4).to_string(index=False))
        spread = s.get("step_time_spread")
        print(f"  slowest rank {s.get('slowest_rank')}, spread "
              f"{'n/a' if spread is None else f'{spread * 100:.3g} %'}")
    print("\ntraces (open in https://ui.perfetto.dev):")
    for p in prof.traces:
        print(f"  {p}")
    return 0
