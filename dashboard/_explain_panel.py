"""The Diff page's explain panel: is the first divergence a bug or rounding (`tracer.analysis.
explain`). A button runs it on demand, since it re-runs the ops of the chain; the panel then
shows the verdict, the error each op received against the error it introduced on identical
inputs along execution order (with the rounding it is entitled to), the blamed op marked, and a
link to that op's node on the Graph page."""
from __future__ import annotations

from typing import Any

import plotly.graph_objects as go
from dash import Input, Output, State, dcc, html

from dashboard import _data
from dashboard._context import Context
from dashboard._figures import empty_figure
from dashboard._errors import BadValueError
from dashboard._values import typed_whole
from dashboard._widgets import empty_state, graph_link, notice

_FLOOR = 1e-18
"""Errors of exactly 0 drawn at this height on the log scale (a re-run equal bit for bit)."""


def panel(first: dict[str, Any] | None, op_records: bool = False) -> html.Div | None:
    """The button and the (empty) result area, for a divergence at an op record, or at a module
    record of dumps that hold op records too (`op_records`: level mix, whose op records explain
    judges); None for a module-level dump (no op to re-run) or no divergence."""
    if not first or not (first.get("op") or op_records):
        return None
    return html.Div([
        html.Button("explain: bug or rounding? (re-runs the ops on the chain)",
                    id="diff-explain-btn", n_clicks=0),
        dcc.Loading(html.Div(id="diff-explain")),
    ], className="sleuth-card")


def chain_figure(chain: list[dict[str, Any]], blamed: str | None) -> go.Figure:
    """Received (inherited) against introduced error of each op call on the chain, with the
    rounding each is entitled to, in execution order; the blamed op marked."""
    replayed = [e for e in chain if e.get("introduced") is not None]
    if not replayed:
        return empty_figure("no op on the chain could be re-run")
    x = [e["name"] for e in replayed]

    def ys(key: str) -> list[float]:
        return [max(float(e[key] or 0.0), _FLOOR) for e in replayed]

    fig = go.Figure()
    for key, label, dash in (("received", "received (from its inputs)", "dot"),
                             ("introduced", "introduced (its own, on A's inputs)", "solid"),
                             ("entitled", "entitled (its measured rounding)", "dash")):
        fig.add_trace(go.Scatter(x=x, y=ys(key), name=label, mode="lines+markers",
                                 line={"dash": dash}))
    if blamed in x:
        i = x.index(blamed)
        fig.add_trace(go.Scatter(x=[blamed], y=[ys("introduced")[i]], name="blamed: a bug",
                                 mode="markers", marker={"size": 16, "color": "#c62828",
                                                         "symbol": "x"}))
    fig.update_yaxes(type="log", title_text="relative error (0 drawn at 1e-18)")
    fig.update_xaxes(title_text="op call, in execution order", showticklabels=False)
    fig.update_layout(template="plotly_white", height=380, margin=dict(l=60, r=20, t=40, b=40),
                      title="error along the divergence chain", legend={"orientation": "h"})
    return fig


def register(app: Any, ctx: Context) -> None:
    @app.callback(Output("diff-explain", "children"), Input("diff-explain-btn", "n_clicks"),
                  State("diff-a", "value"), State("diff-b", "value"),
                  State("diff-rank", "value"), State("diff-step", "value"),
                  prevent_initial_call=True)
    def _explain(clicks, a, b, rank, step):
        if not clicks:
            return None
        return body(ctx, a, b, rank, step)


def body(ctx: Context, a: Any, b: Any, rank: Any, step: Any) -> Any:
    """The verdict, the chain figure and the link to the blamed op's node."""
    ra, rb = ctx.root(a), ctx.root(b)
    if ra is None or rb is None:
        return None
    try:
        rank, step = typed_whole(rank, "rank"), typed_whole(step, "step")
        result = _data.explain(ra, rb, rank=0 if rank is None else rank, step=step)
    except BadValueError as e:
        return empty_state(str(e))
    except _data.NoData as e:
        return notice(e)
    blamed = result.blamed or {}
    parts: list[Any] = [html.P(result.verdict, id="diff-explain-verdict",
                               className="sleuth-error" if result.status == "bug" else
                               "sleuth-note")]
    if blamed.get("name"):
        parts.append(graph_link(ra, a, f"{blamed['name']}.output.0",
                                "show the blamed op {node} in the graph of run A",
                                "diff-explain-graph-link"))
    parts.append(dcc.Graph(id="diff-explain-chain",
                           figure=chain_figure(result.chain, blamed.get("name"))))
    skipped = [e for e in result.chain if e.get("judged") == "not replayed"]
    if skipped:
        parts.append(html.Ul([html.Li(f"not re-run: {e['name']}: {e['why']}")
                              for e in skipped[:8]], className="sleuth-note"))
    return html.Div(parts)
