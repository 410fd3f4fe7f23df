"""The Scalars page: any logged series (metrics.jsonl and the summary), several runs overlaid,
EMA smoothing, log scale, x by step or wall time. The figure holds a downsampled view; a zoom
re-reads the window from the full series (full resolution once it is small enough)."""
from __future__ import annotations

import re
from typing import Any

from dash import Input, Output, State, ctx as dash_ctx, dcc, html, no_update

from dashboard import _data
from dashboard._context import Context
from dashboard._figures import empty_figure, scalars_figure
from dashboard._values import choice, number, record, text, texts, wholes
from dashboard._widgets import control, run_picker

_DEFAULT_TAGS = ("loss", "lr", "grad_norm")
SMOOTHING_MAX = 0.99
X_AXES = {"step": "step", "wall_time": "wall time"}
"""The x axis choices: value -> label."""
_RANGE_KEY = re.compile(r"^xaxis\d*\.range\[(0|1)\]$")
_RANGE_LIST = re.compile(r"^xaxis\d*\.range$")
_AUTO_KEY = re.compile(r"^xaxis\d*\.autorange$")


def layout(ctx: Context, q: dict[str, str]) -> html.Div:
    run = ctx.run_in(q)
    runs = [run] if run is not None else None
    return html.Div([
        html.H2("Scalars"),
        html.Div([
            run_picker("scalars-runs", ctx.runs, multi=True, value=runs, label="runs"),
            control("series", dcc.Dropdown(id="scalars-tags", multi=True, options=[], value=[]),
                    "scalars-tags"),
            control("smoothing (EMA)", dcc.Slider(id="scalars-smoothing", min=0, max=SMOOTHING_MAX, step=0.01,
                                                  value=0, marks={0: "0", 0.25: "0.25", 0.5: "0.5", 0.75: "0.75", 0.9: "0.9"},
                                                  tooltip={"placement": "bottom"}), "scalars-smoothing"),
            control("x axis", dcc.RadioItems(id="scalars-x", options=[{"label": label, "value": x}
                                                                      for x, label in X_AXES.items()],
                                             value="step", inline=True), "scalars-x"),
            control("y axis", dcc.Checklist(id="scalars-log", options=[{"label": "log scale", "value": "log"}],
                                            value=[], inline=True), "scalars-log"),
        ], className="sleuth-controls"),
        html.Div(id="scalars-empty"),
        dcc.Graph(id="scalars-graph", figure=empty_figure("loading"), config={"displaylogo": False}),
        dcc.Store(id="scalars-drawn"),
    ], id="page-scalars")


def x_range_from_relayout(relayout: dict[str, Any] | None) -> tuple[float, float] | None | bool:
    """The x window a plotly relayout event asks for: (lo, hi), None for autorange (full view),
    False when the event does not touch the x axis (a y zoom, a resize, a legend click)."""
    relayout = record(relayout)
    if not relayout:
        return False
    lo = hi = None
    for key, value in relayout.items():
        if _AUTO_KEY.match(key):
            return None
        if _RANGE_LIST.match(key) and isinstance(value, (list, tuple)) and len(value) == 2:
            lo, hi = value
        m = _RANGE_KEY.match(key)
        if m:
            if m.group(1) == "0":
                lo = value
            else:
                hi = value
    lo, hi = number(lo), number(hi)
    return False if lo is None or hi is None else (lo, hi)


def register(app: Any, ctx: Context) -> None:
    @app.callback(Output("scalars-tags", "options"), Output("scalars-tags", "value"),
                  Output("scalars-empty", "children"),
                  Input("scalars-runs", "value"), Input("data-version", "data"),
                  State("scalars-tags", "value"))
    def tags(run_ids: list[int] | None, _v: Any, chosen: list[str] | None):
        run_ids = wholes(run_ids)
        names: list[str] = []
        notes: list[str] = []
        for i in run_ids:
            root = ctx.root(i)
            if root is not None:
                names += [t for t in _data.scalars(root) if t not in names]
                notes += [f"{ctx.label(i)}: {n}" for n in _data.scalar_notes(root)]
        problems = html.Div([html.Div(n) for n in notes], id="scalars-problems",
                            className="sleuth-error", role="alert") if notes else None
        if not names:
            return [], [], [problems, _no_scalars(ctx, run_ids)]
        keep = [t for t in texts(chosen) if t in names]
        if not keep:
            keep = [t for t in _DEFAULT_TAGS if t in names] or names[:3]
        return [{"label": t, "value": t} for t in names], keep, problems

    @app.callback(Output("scalars-graph", "figure"), Output("scalars-drawn", "data"),
                  Input("scalars-runs", "value"), Input("scalars-tags", "value"),
                  Input("scalars-smoothing", "value"), Input("scalars-x", "value"),
                  Input("scalars-log", "value"), Input("scalars-graph", "relayoutData"),
                  Input("data-version", "data"), State("scalars-drawn", "data"))
    def figure(run_ids, tags, smoothing, x, log, relayout, version, drawn):
        # Several inputs can fire in one call (a new tag list and the graph's first autosize).
        # A relayout that leaves x unchanged (a resize, a y zoom) needs no redraw, but only when
        # the figure on screen is the one these inputs make: the browser drops a call still
        # running when the same callback fires again, so the graph's first autosize can cancel
        # the first draw and must then draw in its place (`drawn` is None: still "loading").
        run_ids, tags, log = wholes(run_ids), texts(tags), texts(log)
        smoothing = number(smoothing, low=0.0, high=SMOOTHING_MAX) or 0.0
        x = choice(x, X_AXES) or "step"
        key = [run_ids, tags, smoothing, x, log, text(version)]
        triggers = set(dash_ctx.triggered_prop_ids.values())
        x_range = x_range_from_relayout(relayout)
        if triggers == {"scalars-graph"} and x_range is False and drawn == key:
            return no_update, no_update
        if "scalars-x" in triggers or x_range is False:
            x_range = None
        series = {ctx.label(i): _data.scalars(ctx.root(i)) for i in run_ids if ctx.root(i)}
        if not tags:
            return empty_figure("no series to show"), key
        return scalars_figure(series, tags, x=x, smoothing=smoothing, log_y="log" in log,
                              x_range=x_range), key


def _no_scalars(ctx: Context, run_ids: list[int] | None) -> Any:
    from dashboard._widgets import empty_state

    if not run_ids:
        return empty_state("choose a run")
    return empty_state("these runs logged no scalars: the trainer writes metrics.jsonl; for other "
                       "scripts run with --summary (or call profiler.SummaryWriter.add_scalar)")
