"""read_profile: the tables of every window of every rank under RUN/profile, and the cluster view.

Tables come from the parquet files written at training time when `write_tables=True`, else they
are built here from the saved traces (the default: training pays only for the trace export).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from profiler._errors import ProfileFormatError
from profiler._gpu_time import STEP_COLUMNS, kernels_by_rank, summarize, summarize_ranks
from profiler._io import write_frame_atomic
from profiler._tables import build_tables
from profiler._trace import load_trace

_TABLES = ("ops", "modules", "steps", "memory", "gpu", "host")


def _names() -> tuple[Any, Any]:
    """The strict names of a window's trace and of a rank folder (tracer.storage.numbered)."""
    from tracer.storage import RANK_DIR, numbered

    return numbered(r"window{n}\.trace\.json(?:\.gz)?"), RANK_DIR


@dataclass
class Profile:
    """Everything profiled in one run directory (all times in microseconds unless `_s`).

    ops: rank, window, name, input_shapes, source (the op's line, from a with_stack trace,
        by the rule the dump's records follow: an installed library's line, such as a Hugging
        Face model's, counts; "" without stacks), caller (the user's line that called that
        library, "" where source is the user's own), module (the module it ran in, by Sleuth's module ranges:
        forward ops by the range around them, backward ops by their autograd node's forward
        op; "" outside every module or without module ranges), calls, cpu_total_us, cpu_self_us, device_us, flops.
    modules: rank, window, module, type, source (file:line of the module class's forward),
        calls, forward_total_us, forward_self_us,
        backward_self_us, backward_total_us, forward_device_us (kernels launched inside the
        module's forward, nested modules included), backward_device_us (by its autograd nodes).
    steps: rank, window, step, step_us, source, data_us, forward_us, backward_us,
        optimizer_us, other_us, comm_us, tools_us (Sleuth's own work inside the phases: the
        tracer's records when the dump was on, summary norms; docs/profiler.md).
    memory: rank, window, time_us, device, bytes, allocated_bytes, reserved_bytes.
    gpu: rank, window and `profiler._gpu_time.STEP_COLUMNS`: GPU busy and idle time per step,
        the idle time split into host-bound, data-bound and waiting on communication, compute
        and communication kernel time and their overlap; empty for a CPU trace.
    gpu_ranks: the GPU figures of each rank (`profiler._gpu_time.RANK_COLUMNS`): per-step
        means, idle and overlap shares, and `slowest` marking the slowest rank by step time.
    kernels: rank, module, type, forward_us, backward_us, kernel_us: kernel time per step of
        each rank by module (kernels charged to the module whose range launched them).
    cluster: rank, step_time_s, comm_share, steps, slowest, slowdown (one row per rank).
    traces: the trace files. summary: step_time_s, tokens_per_s, mfu, comm_share, dump_on,
        tools (microseconds per step of each tool's own work), tool_share, gpu (the GPU
        table's per-step means and shares, `profiler._gpu_time.summarize`; None for a CPU
        trace), ...
    """

    ops: Any
    modules: Any
    steps: Any
    memory: Any
    cluster: Any
    traces: list[Path] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    windows: Any = None
    gpu: Any = None
    gpu_ranks: Any = None
    kernels: Any = None
    host: Any = None
    """rank, window, name, source, calls, time_us: the user's calls of builtins (`time.sleep`,
    a blocking read, `.tolist()`), by the calling line, each call's time less the ops it made;
    with_stack traces only."""


def _check_meta(meta: dict[str, Any], path: Path) -> dict[str, Any]:
    version = str(meta.get("format_version", ""))
    if not version.startswith("1."):
        raise ProfileFormatError(f"{path} has format_version {version!r}; this sleuth reads 1.x "
                                 "profiles: upgrade sleuth to read it")
    return meta


def _read_meta(d: Path, k: int) -> dict[str, Any]:
    path = d / f"window{k}.json"
    if not path.exists():  # crashed between trace and metadata: the trace alone still helps
        return {}
    return _check_meta(_read_json(path), path)


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object file of a profile, or ProfileFormatError naming it and what is wrong."""
    fix = "re-run the profiled steps, or delete this window's files to read the others"
    from tracer.storage import JsonLimitError, load_bounded

    try:
        data = load_bounded(path)
    except JsonLimitError as e:
        raise ProfileFormatError(f"cannot read {e}; {fix}") from e
    if not isinstance(data, dict):
        raise ProfileFormatError(f"{path} holds a JSON {type(data).__name__}, not the object "
                                 f"this file should hold; {fix}")
    return data


def window_tables(d: Path, k: int) -> dict[str, Any]:
    """Tables of one window as DataFrames (plus `summary`), from parquet when present."""
    import pandas as pd
    meta = _read_meta(d, k)
    cached = {t: d / f"window{k}.{t}.parquet" for t in _TABLES}
    summary_path = d / f"window{k}.summary.json"
    if all(p.exists() for p in cached.values()) and summary_path.exists():
        try:
            out: dict[str, Any] = {t: pd.read_parquet(p) for t, p in cached.items()}
            out["summary"] = _read_json(summary_path)
            return out
        except Exception:  # noqa: BLE001 - a damaged cache: the trace below is the source of truth
            pass
    trace_path = _named_trace(d / f"window{k}.json", meta.get("trace") or f"window{k}.trace.json.gz")
    if not trace_path.exists():
        trace_path = d / f"window{k}.trace.json"
    trace = load_trace(trace_path)
    try:
        built = build_tables(trace, meta)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise ProfileFormatError(f"{trace_path} is damaged: an event cannot be read ({e}); "
                                 "re-run the profiled steps, or delete this window's files "
                                 "to read the others") from e
    out = {t: pd.DataFrame(built[t], columns=_COLUMNS[t]) for t in _TABLES}
    out["summary"] = built["summary"]
    return out


def _named_trace(meta_path: Path, name: Any) -> Path:
    """The trace a window's metadata names, kept inside the run (`tracer.storage.inside_run`):
    a name that leads out of it is another file, never read as this run's."""
    from tracer import UntrustedFileError
    from tracer.storage import inside_run

    try:
        return inside_run(meta_path.parent.parent.parent, meta_path, name)
    except UntrustedFileError as e:
        raise ProfileFormatError(str(e)) from e


def write_window_tables(d: Path, k: int, fmt: str = "parquet") -> None:
    """Build window k's tables from its trace and write them next to it (atomically)."""
    import json as _json

    from profiler._io import write_json_atomic
    tables = window_tables(d, k)
    for t in _TABLES:
        write_frame_atomic(tables[t], d / f"window{k}.{t}.{fmt}", fmt)
    write_json_atomic(d / f"window{k}.summary.json", _json.loads(_json.dumps(tables["summary"])))


_COLUMNS = {
    "ops": ["name", "input_shapes", "source", "caller", "module", "calls", "cpu_total_us",
            "cpu_self_us", "device_us", "flops"],
    "modules": ["module", "type", "source", "calls", "forward_total_us", "forward_self_us",
                "backward_self_us", "backward_total_us", "forward_device_us",
                "backward_device_us"],
    "steps": ["step", "step_us", "source", "data_us", "forward_us", "backward_us",
              "optimizer_us", "other_us", "comm_us", "tools_us"],
    "memory": ["time_us", "device", "bytes", "allocated_bytes", "reserved_bytes"],
    "gpu": STEP_COLUMNS,
    "host": ["name", "source", "calls", "time_us"],
}


def read_profile(run_dir: str | os.PathLike[str]) -> Profile:
    """Read every window of every rank under `run_dir/profile/`.

    Raises ProfileFormatError when there is no profile or a file is unreadable.
    """
    import pandas as pd
    root = Path(run_dir) / "profile"
    if not root.is_dir():
        raise ProfileFormatError(f"no profile in {run_dir}: expected {root}/rank*/ (run with a "
                                 "profiler.Collector, `--profile`, or SLEUTH_PROFILE=1)")
    frames: dict[str, list[Any]] = {t: [] for t in _TABLES}
    traces: list[Path] = []
    win_rows = []
    window_re, rank_re = _names()
    ranks = [(int(rank_re.fullmatch(d.name).group(1)), d, sorted(
        {int(m.group(1)) for p in d.iterdir() if (m := window_re.fullmatch(p.name))}))
        for d in root.iterdir() if rank_re.fullmatch(d.name)]
    ranks.sort(key=lambda r: r[0])
    _one_run(root, [(d, k) for _, d, windows in ranks for k in windows])
    for rank, d, windows in ranks:
        for k in windows:
            tables = window_tables(d, k)
            traces.append(next(p for p in (d / f"window{k}.trace.json.gz", d / f"window{k}.trace.json")
                               if p.exists()))
            for t in _TABLES:
                df = tables[t]
                df.insert(0, "window", k)
                df.insert(0, "rank", rank)
                frames[t].append(df)
            win_rows.append({"rank": rank, "window": k, **tables["summary"]})
    if not traces:
        raise ProfileFormatError(f"no profiled window under {root}: the run ended before a "
                                 "window completed (lower wait/warmup/active or run more steps)")
    out = {t: pd.concat(frames[t], ignore_index=True) if frames[t] else
           pd.DataFrame(columns=["rank", "window", *_COLUMNS[t]]) for t in _TABLES}
    windows = pd.DataFrame(win_rows)
    cluster = _cluster(out["steps"])
    summary = _summary(windows, out["steps"], cluster)
    summary["gpu"] = summarize(out["gpu"])
    return Profile(ops=out["ops"], modules=out["modules"], steps=out["steps"],
                   memory=out["memory"], cluster=cluster, traces=traces, summary=summary,
                   windows=windows, gpu=out["gpu"], host=out["host"],
                   gpu_ranks=summarize_ranks(out["gpu"], summary.get("slowest_rank")),
                   kernels=kernels_by_rank(out["modules"], out["steps"]))


def _one_run(root: Path, windows: list[tuple[Path, int]]) -> None:
    """ProfileFormatError when the windows' metadata name more than one run (`run_id`): a
    window of another run left beside this run's would be read as this run's. Windows
    without an id (written before run ids, or by a run without one) are not checked."""
    runs: dict[str, str] = {}
    for d, k in windows:
        run_id = _read_meta(d, k).get("run_id")
        if isinstance(run_id, str) and run_id:
            runs.setdefault(run_id, f"{d.name}/window{k}")
    if len(runs) > 1:
        (a, where_a), (b, where_b) = list(runs.items())[:2]
        raise ProfileFormatError(f"{root} holds the profiles of {len(runs)} runs ({where_a}: "
                                 f"run {a}, {where_b}: run {b}); read one run at a time: move "
                                 f"the other run's windows away, or profile again with "
                                 f"--overwrite or another --run-dir")


def _cluster(steps: Any) -> Any:
    import pandas as pd
    if steps.empty:
        return pd.DataFrame(columns=["rank", "step_time_s", "comm_share", "steps", "slowest",
                                     "slowdown"])
    g = steps.groupby("rank")
    cluster = pd.DataFrame({
        "step_time_s": g["step_us"].mean() / 1e6,
        "comm_share": g["comm_us"].sum() / g["step_us"].sum().where(lambda s: s > 0),
        "steps": g["step"].count(),
    }).reset_index()
    fastest = cluster["step_time_s"].min()
    cluster["slowest"] = cluster["step_time_s"] == cluster["step_time_s"].max()
    cluster["slowdown"] = cluster["step_time_s"] / fastest if fastest > 0 else math.nan
    return cluster


def _summary(windows: Any, steps: Any, cluster: Any) -> dict[str, Any]:
    def mean(col: str) -> float:
        if col not in windows or windows[col].dropna().empty:
            return math.nan
        return float(windows[col].dropna().mean())

    st = float(steps["step_us"].mean() / 1e6) if not steps.empty else math.nan
    comm = float(steps["comm_us"].sum() / steps["step_us"].sum()) if not steps.empty and steps["step_us"].sum() > 0 else 0.0
    out = {"ranks": int(cluster["rank"].nunique()) if not cluster.empty else 0,
           "windows": int(len(windows)), "steps": int(len(steps)),
           "step_time_s": st, "tokens_per_s": mean("tokens_per_s"), "mfu": mean("mfu"),
           "flops_per_step": mean("flops_per_step"), "peak_tflops": mean("peak_tflops"),
           "comm_share": comm, "clamped_events": int(windows["clamped_events"].sum()),
           **_tools(windows, steps)}
    if len(cluster) > 1:
        times = cluster["step_time_s"]
        out["slowest_rank"] = int(cluster.loc[times.idxmax(), "rank"])
        out["step_time_spread"] = float((times.max() - times.min()) / times.mean())
    return out


def _tools(windows: Any, steps: Any) -> dict[str, Any]:
    """Tool time over all windows: per tool, microseconds per step (weighted by the windows'
    steps); its share of the step time; whether the dump ran in any profiled step. Tables
    written before tool time was measured have none of these columns and read as no tools."""
    per_tool: dict[str, float] = {}
    if "tools" in windows:
        n = max(1, int(windows["steps"].sum()))
        for tools, k in zip(windows["tools"], windows["steps"]):
            for name, us in (tools if isinstance(tools, dict) else {}).items():
                per_tool[name] = per_tool.get(name, 0.0) + us * k / n
    total = steps["step_us"].sum() if not steps.empty else 0.0
    share = (float(steps["tools_us"].fillna(0).sum() / total)
             if "tools_us" in steps and total > 0 else 0.0)
    return {"dump_on": bool("dump_on" in windows and windows["dump_on"].fillna(False).any()),
            "tools": per_tool, "tool_share": share}
