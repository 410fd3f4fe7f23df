"""The Profile page: top ops and modules by time, the step-time breakdown, the memory timeline,
each rank's GPU time (busy, and idle by cause; a CUDA trace only) and the per-rank cluster view
of one run's `profiler.Profile`, plus links to its traces. With a
second run chosen ("compare with", or `?run=A&b=B` in the URL), the page shows first why B is
slower than A, or that it is not (dashboard._profile_compare)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
import profiler
from dash import Input, Output, dcc, html

from dashboard import _data
from dashboard._context import Context
from dashboard._figures import bar_top, empty_figure, lines, stacked_steps
from dashboard._routes import FILE_ROUTE
from dashboard._runs import run_options
from dashboard._profile_compare import compare_panel
from dashboard._values import whole
from dashboard._widgets import control, empty_state, notice, run_picker

_PHASES = ("data", "forward", "backward", "optimizer", "other")


def layout(ctx: Context, q: dict[str, str]) -> html.Div:
    run = ctx.run_in(q)
    other = ctx.run_in(q, "b")
    compare = dcc.Dropdown(id="profile-b", options=run_options(ctx.runs), value=other,
                           clearable=True, placeholder="none: one run")
    return html.Div([html.H2("Profile"),
                     html.Div([run_picker("profile-run", ctx.runs, value=run, label="run (A)"),
                               control("compare with (run B)", compare, "profile-b")],
                              className="sleuth-controls"),
                     dcc.Loading(html.Div(id="profile-compare-body")),
                     dcc.Loading(html.Div(id="profile-body"))], id="page-profile")


def pick(df: pd.DataFrame, candidates: tuple[str, ...], *, numeric: bool = False,
         contains: tuple[str, ...] = ()) -> str | None:
    """The first column of `df` named in `candidates`, else the first (numeric) column whose name
    contains one of `contains`: the profiler's tables name their columns, this page reads them
    without hard-coding one spelling of the time unit."""
    for c in candidates:
        if c in df.columns:
            return c
    for c in df.columns:
        if numeric and not pd.api.types.is_numeric_dtype(df[c]):
            continue
        if any(s in str(c).lower() for s in contains):
            return str(c)
    return None


def profile_figures(prof: Any, *, rank: int | None = None) -> dict[str, Any]:
    """The page's figures from a Profile, by panel name (pure: tested without a browser).

    Op and module times are summed over profiling windows (and over ranks unless `rank` is
    given); the step breakdown and memory timeline show `rank` (default: the lowest rank).
    """
    figs: dict[str, Any] = {}
    ops = _frame(prof, "ops")
    if rank is None and "rank" in ops and len(ops):
        rank = int(ops["rank"].min())
    ops = _only(ops, rank)
    op_label = pick(ops, ("name", "op", "key"))
    op_value = pick(ops, ("cpu_self_us", "self_time_us", "self_cpu_time_us"), numeric=True, contains=("self",))
    if op_label and op_value:
        agg = ops.groupby(op_label, as_index=False)[op_value].sum()
        figs["ops"] = bar_top(agg, op_label, op_value, title="top ops by self CPU time", unit="")
    else:
        figs["ops"] = empty_figure("no op table in this profile")
    mods = _only(_frame(prof, "modules"), rank)
    mod_label = pick(mods, ("module", "name"))
    parts = [c for c in ("forward_self_us", "backward_self_us") if c in mods]
    if mod_label and parts:
        agg = mods.groupby(mod_label, as_index=False)[parts].sum()
        agg["self_us"] = agg[parts].sum(axis=1)
        figs["modules"] = bar_top(agg, mod_label, "self_us", title="modules by self time (forward + backward)")
    else:
        mod_value = pick(mods, ("total_time_us",), numeric=True, contains=("time", "_us"))
        figs["modules"] = (bar_top(mods, mod_label, mod_value, title="modules by time")
                           if mod_label and mod_value else empty_figure("no module table in this profile"))
    steps = _only(_frame(prof, "steps"), rank)
    parts = [c for c in steps.columns if str(c).endswith("_us") and pd.api.types.is_numeric_dtype(steps[c])
             and any(str(c).startswith(p) for p in _PHASES)]
    if "step" in steps and parts:
        figs["steps"] = stacked_steps(steps.groupby("step", as_index=False)[parts].sum(), "step", parts,
                                      title="step time breakdown (us)")
    elif "step" in steps:
        y = pick(steps, ("step_us",), numeric=True, contains=("time", "_us"))
        figs["steps"] = lines(steps, "step", [y] if y else [], title="step time")
    else:
        figs["steps"] = empty_figure("no step table in this profile")
    mem = _only(_frame(prof, "memory"), rank)
    ys = [c for c in ("allocated_bytes", "reserved_bytes", "bytes") if c in mem]
    if "time_us" in mem and ys:
        mem = mem.assign(**{c: mem[c] / 2**20 for c in ys}).rename(columns={c: c.replace("bytes", "MiB") for c in ys})
        ys = [c.replace("bytes", "MiB") for c in ys]
        figs["memory"] = lines(mem, "time_us", ys, title="memory timeline (MiB)",
                               group="window" if "window" in mem and mem["window"].nunique() > 1 else None)
    else:
        figs["memory"] = empty_figure("no memory timeline in this profile (profile_memory off)")
    figs["gpu"] = _gpu_ranks_figure(_frame(prof, "gpu_ranks"))
    clu = _frame(prof, "cluster")
    if "rank" in clu and "step_time_s" in clu and len(clu) > 1:
        c = clu.assign(rank=clu["rank"].map(lambda r: f"rank {r}"))
        figs["cluster"] = bar_top(c, "rank", "step_time_s", n=len(c), title="per-rank step time (s)")
    else:
        figs["cluster"] = empty_figure("one rank only: the cluster view compares the ranks of a multi-process run")
    return figs


_GPU_PARTS = {"gpu_busy_us": "busy", "host_wait_us": "idle: host-bound",
              "data_wait_us": "idle: data-bound", "comm_wait_us": "idle: waiting on communication"}


def _gpu_ranks_figure(gpu: pd.DataFrame) -> Any:
    """Each rank's GPU time a step as stacked bars: busy, and the idle time split into
    host-bound, data-bound and waiting on communication (`Profile.gpu_ranks`), the slowest rank
    marked; one line for a CPU trace, which has no GPU figures."""
    parts = [c for c in _GPU_PARTS if c in gpu]
    if gpu.empty or "rank" not in gpu or not parts:
        return empty_figure("CPU trace: no GPU figures (GPU idle, overlap and kernel time need "
                            "a trace of a CUDA run)")
    slowest = gpu["slowest"].astype(bool) if "slowest" in gpu else pd.Series(False, gpu.index)
    shown = gpu.assign(rank=[f"rank {r}" + (" (slowest)" if s else "")
                             for r, s in zip(gpu["rank"], slowest)])
    shown = shown.rename(columns=_GPU_PARTS)
    return stacked_steps(shown, "rank", [_GPU_PARTS[c] for c in parts],
                         title="GPU time a step per rank (us): busy, and idle by cause")


def _only(df: pd.DataFrame, rank: int | None) -> pd.DataFrame:
    return df[df["rank"] == rank] if rank is not None and "rank" in df else df


def _frame(prof: Any, name: str) -> pd.DataFrame:
    df = getattr(prof, name, None)
    return df if isinstance(df, pd.DataFrame) else pd.DataFrame()


def register(app: Any, ctx: Context) -> None:
    @app.callback(Output("profile-compare-body", "children"), Input("profile-run", "value"),
                  Input("profile-b", "value"), Input("data-version", "data"))
    def compare(run, other, _v):
        root_a, root_b = ctx.root(run), ctx.root(other)
        if root_a is None or root_b is None:
            return []
        if root_a == root_b:
            return empty_state("run B is run A: choose another run to compare with")
        try:
            d = _data.profile_diff(root_a, root_b)
        except _data.NoData as e:
            return notice(e)
        return compare_panel(d, whole(run), whole(other), (root_a, root_b),
                             (ctx.label(run), ctx.label(other)))

    @app.callback(Output("profile-body", "children"), Input("profile-run", "value"),
                  Input("data-version", "data"))
    def body(run, _v):
        root = ctx.root(run)
        if root is None:
            return empty_state("choose a run")
        try:
            prof = _data.profile(root)
        except _data.NoData as e:
            return notice(e)
        figs = profile_figures(prof)
        lines = profiler.summary_lines(getattr(prof, "summary", None) or {})
        head = html.P([part for i, line in enumerate(lines) for part in ([html.Br()] if i else []) + [line]],
                      id="profile-summary", className="sleuth-note", style={"whiteSpace": "pre-wrap"})
        panels = [head] + [dcc.Graph(id=f"profile-{k}", figure=f, config={"displaylogo": False},
                            className="sleuth-panel") for k, f in figs.items()]
        traces = [Path(p) for p in (getattr(prof, "traces", None) or [])]
        links = [html.A(p.name, href=f"{FILE_ROUTE}/{whole(run)}/{p.resolve().relative_to(root).as_posix()}",
                        download=p.name) for p in traces if _under(p, root)]
        if links:
            panels.append(html.Div([html.Span("traces (open in ui.perfetto.dev): "), *links],
                                   className="sleuth-links"))
        return panels


def _under(p: Path, root: Path) -> bool:
    try:
        return p.resolve().is_relative_to(root)
    except OSError:
        return False
