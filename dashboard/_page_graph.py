"""The Graph page: a run's IR graph (the SVG irdump rendered) with search by node name; the
matching nodes are highlighted. Dumps and Diff link here with `?run=I&node=NAME`."""
from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import pandas as pd
from dash import Input, Output, State, dcc, html

from dashboard import _data
from dashboard._context import Context
from dashboard._routes import HIGHLIGHT_MAX_CHARS, SVG_ROUTE
from dashboard._values import text, whole
from dashboard._widgets import control, empty_state, notice, run_picker

MAX_MATCHES = 50


def layout(ctx: Context, q: dict[str, str]) -> html.Div:
    run = ctx.run_in(q)
    return html.Div([
        html.H2("Graph"),
        html.Div([run_picker("graph-run", ctx.runs, value=run),
                  control("graph", dcc.Dropdown(id="graph-stage", clearable=False), "graph-stage"),
                  control("search node", dcc.Input(id="graph-search", type="text", value=q.get("node", ""),
                                                   placeholder="e.g. layers.0.attn::aten.mm", debounce=True,
                                                   style={"width": "28em"}), "graph-search")],
                 className="sleuth-controls"),
        dcc.Store(id="graph-want", data=q.get("stage")),
        html.Div(id="graph-matches"),
        html.Div(id="graph-body"),
    ], id="page-graph")


def _rel(p: Any, root: Path) -> str | None:
    if p is None or (isinstance(p, float) and pd.isna(p)):
        return None
    path = Path(p)
    path = path if path.is_absolute() else root / path
    try:
        return path.resolve().relative_to(root).as_posix()
    except ValueError:
        return None


def match_nodes(names: pd.Series, query: str, limit: int = MAX_MATCHES) -> list[str]:
    """Node names containing `query` (case-insensitive), exact matches first."""
    if not query:
        return []
    s = names.astype(str)
    hits = s[s.str.contains(query, case=False, regex=False)].drop_duplicates()
    exact = hits[hits == query]
    return list(pd.concat([exact, hits[hits != query]]).head(limit))


def register(app: Any, ctx: Context) -> None:
    @app.callback(Output("graph-stage", "options"), Output("graph-stage", "value"),
                  Input("graph-run", "value"), Input("data-version", "data"),
                  State("graph-stage", "value"), State("graph-want", "data"))
    def stages(run, _v, current, want):
        root = ctx.root(run)
        if root is None:
            return [], None
        try:
            df = _data.graphs(root)
        except _data.NoData:
            return [], None
        opts = [{"label": f"{int(r.stage):02d} {r.name}", "value": int(r.stage)} for r in df.itertuples()]
        values = [o["value"] for o in opts]
        return opts, next((v for v in (whole(current), whole(want)) if v in values),
                          values[0] if values else None)

    @app.callback(Output("graph-body", "children"), Output("graph-matches", "children"),
                  Input("graph-stage", "value"), Input("graph-search", "value"),
                  State("graph-run", "value"))
    def body(stage, query, run):
        root, stage, query = ctx.root(run), whole(stage), text(query)
        if root is None:
            return empty_state("choose a run"), None
        try:
            df = _data.graphs(root)
        except _data.NoData as e:
            return notice(e), None
        row = df[df["stage"] == stage] if stage is not None else df.iloc[:0]
        if row.empty:
            return empty_state("choose a graph"), None
        row = row.iloc[0]
        svg = _rel(row.get("svg"), root)
        matches: Any = None
        if query:
            names = _node_names(row, root)
            found = match_nodes(names, query) if names is not None else []
            matches = html.Div([html.Span(f"{len(found)} node(s) match {query!r}"
                                          + ("" if len(found) < MAX_MATCHES else f" (first {MAX_MATCHES})")),
                                html.Ul([html.Li(n) for n in found], id="graph-match-list")],
                               className="sleuth-note")
        if svg is None:
            return empty_state("this graph has no SVG: install graphviz (`dot`) and export again "
                               "with --save-graphs"), matches
        # No node name is as long as the SVG route's bound: a longer search (0 matches) is drawn
        # unhighlighted rather than refused there.
        lit = query if query and len(query) <= HIGHLIGHT_MAX_CHARS else None
        src = f"{SVG_ROUTE}/{whole(run)}/{quote(svg)}" + ("?" + urlencode({"highlight": lit}) if lit else "")
        return html.Iframe(id="graph-svg", src=src, className="sleuth-svg"), matches


def _node_names(row: pd.Series, root: Path) -> pd.Series | None:
    ir = _rel(row.get("ir"), root)
    if ir is None:
        return None
    try:
        nodes = _data.ir_nodes(root / ir)
    except _data.NoData:
        return None
    return nodes["name"] if "name" in nodes else None
