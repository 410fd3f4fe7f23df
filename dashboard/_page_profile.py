"""The Profile page: top ops and modules by time, the step-time breakdown, the memory timeline
and the per-rank cluster view of one run's `profiler.Profile`, plus links to its traces."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
from dash import Input, Output, dcc, html

from dashboard import _data
from dashboard._context import Context
from dashboard._figures import bar_top, empty_figure, lines, stacked_steps
from dashboard._routes import FILE_ROUTE
from dashboard._widgets import empty_state, run_picker

_PHASES = ("data", "forward", "backward", "optimizer", "other")


def layout(ctx: Context, q: dict[str, str]) -> html.Div:
    run = int(q["run"]) if q.get("run", "").isdigit() and ctx.root(q["run"]) else None
    return html.Div([html.H2("Profile"),
                     html.Div([run_picker("profile-run", ctx.runs, value=run)], className="sleuth-controls"),
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


def profile_figures(prof: Any) -> dict[str, Any]:
    """The page's figures from a Profile, by panel name (pure: tested without a browser)."""
    figs: dict[str, Any] = {}
    ops = _frame(prof, "ops")
    op_label = pick(ops, ("name", "op", "key"))
    op_value = pick(ops, ("self_time_us", "self_cpu_time_us", "self_device_time_us"), numeric=True,
                    contains=("self",)) or pick(ops, (), numeric=True, contains=("time", "_us", "_ms"))
    figs["ops"] = (bar_top(ops, op_label, op_value, title="top ops (self time)") if op_label and op_value
                   else empty_figure("no op table in this profile"))
    mods = _frame(prof, "modules")
    mod_label = pick(mods, ("module", "name"))
    mod_value = pick(mods, ("self_time_us", "total_time_us", "time_us"), numeric=True, contains=("time",))
    figs["modules"] = (bar_top(mods, mod_label, mod_value, title="modules by time") if mod_label and mod_value
                       else empty_figure("no module table in this profile"))
    steps = _frame(prof, "steps")
    parts = [c for c in steps.columns if any(p in str(c).lower() for p in _PHASES)
             and pd.api.types.is_numeric_dtype(steps[c])]
    if "step" in steps and parts:
        figs["steps"] = stacked_steps(steps, "step", parts, title="step time breakdown")
    elif "step" in steps:
        y = pick(steps, ("step_time_us", "step_time_ms", "step_time_s"), numeric=True, contains=("time",))
        figs["steps"] = lines(steps, "step", [y] if y else [], title="step time")
    else:
        figs["steps"] = empty_figure("no step table in this profile")
    mem = _frame(prof, "memory")
    t = pick(mem, ("time_us", "time_ms", "time_s", "time", "ts", "t"))
    ys = [c for c in mem.columns if c != t and c != "rank" and pd.api.types.is_numeric_dtype(mem[c])
          and any(s in str(c).lower() for s in ("alloc", "reserv", "bytes", "mem", "mib", "mb"))]
    figs["memory"] = (lines(mem, t, ys, title="memory timeline", group="rank" if mem.get("rank") is not None
                            and mem["rank"].nunique() > 1 else None)
                      if t and ys else empty_figure("no memory timeline in this profile"))
    clu = _frame(prof, "cluster")
    cv = pick(clu, ("step_time_us", "step_time_ms", "mean_step_time_us"), numeric=True, contains=("time",))
    if "rank" in clu and cv:
        c = clu.assign(rank=clu["rank"].map(lambda r: f"rank {r}"))
        figs["cluster"] = bar_top(c, "rank", cv, n=len(c), title="per-rank step time")
    else:
        figs["cluster"] = empty_figure("one rank only: the cluster view needs a multi-rank run")
    return figs


def _frame(prof: Any, name: str) -> pd.DataFrame:
    df = getattr(prof, name, None)
    return df if isinstance(df, pd.DataFrame) else pd.DataFrame()


def register(app: Any, ctx: Context) -> None:
    @app.callback(Output("profile-body", "children"), Input("profile-run", "value"),
                  Input("data-version", "data"))
    def body(run, _v):
        root = ctx.root(run)
        if root is None:
            return empty_state("choose a run")
        try:
            prof = _data.profile(root)
        except _data.NoData as e:
            return empty_state(str(e))
        figs = profile_figures(prof)
        panels = [dcc.Graph(id=f"profile-{k}", figure=f, config={"displaylogo": False},
                            className="sleuth-panel") for k, f in figs.items()]
        traces = [Path(p) for p in (getattr(prof, "traces", None) or [])]
        links = [html.A(p.name, href=f"{FILE_ROUTE}/{int(run)}/{p.resolve().relative_to(root).as_posix()}",
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
