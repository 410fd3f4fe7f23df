"""The Histograms page: one tensor's value distribution over steps (weights, gradients,
activations logged by the summary writer) as a heatmap."""
from __future__ import annotations

from typing import Any

from dash import Input, Output, State, dcc, html

from dashboard import _data
from dashboard._context import Context
from dashboard._figures import empty_figure, histogram_heatmap
from dashboard._values import text, whole
from dashboard._widgets import control, empty_state, notice, run_picker


def layout(ctx: Context, q: dict[str, str]) -> html.Div:
    run = ctx.run_in(q)
    return html.Div([
        html.H2("Histograms"),
        html.Div([run_picker("hist-run", ctx.runs, value=run),
                  control("tensor", dcc.Dropdown(id="hist-tag", options=[], clearable=False), "hist-tag")],
                 className="sleuth-controls"),
        html.Div(id="hist-empty"),
        dcc.Graph(id="hist-graph", figure=empty_figure("loading"), config={"displaylogo": False}),
    ], id="page-histograms")


def _key(rank: int, tag: str) -> str:
    return f"{rank}|{tag}"


def _parse_key(key: Any) -> tuple[int, str] | None:
    """(rank, tag) of a `_key`, None for any other value."""
    rank, _, tag = (text(key) or "").partition("|")
    return None if whole(rank) is None or not tag else (whole(rank), tag)


def register(app: Any, ctx: Context) -> None:
    @app.callback(Output("hist-tag", "options"), Output("hist-tag", "value"), Output("hist-empty", "children"),
                  Input("hist-run", "value"), Input("data-version", "data"), State("hist-tag", "value"))
    def tags(run, _v, chosen):
        root = ctx.root(run)
        if root is None:
            return [], None, empty_state("choose a run")
        try:
            df = _data.histograms(root)
        except _data.NoData as e:
            return [], None, notice(e)
        pairs = df[["rank", "tag"]].drop_duplicates().sort_values(["rank", "tag"])
        ranks = pairs["rank"].nunique()
        options = [{"label": t if ranks == 1 else f"{t} [rank {r}]", "value": _key(int(r), str(t))}
                   for r, t in pairs.itertuples(index=False)]
        values = [o["value"] for o in options]
        chosen = text(chosen)
        return options, chosen if chosen in values else (values[0] if values else None), None

    @app.callback(Output("hist-graph", "figure"), Input("hist-run", "value"), Input("hist-tag", "value"),
                  Input("data-version", "data"))
    def figure(run, key, _v):
        root, chosen = ctx.root(run), _parse_key(key)
        if root is None or chosen is None:
            return empty_figure("no histogram chosen")
        try:
            df = _data.histograms(root)
        except _data.NoData as e:
            return empty_figure(str(e))
        rank, tag = chosen
        sel = df[(df["rank"] == rank) & (df["tag"] == tag)]
        return histogram_heatmap(sel, tag)
