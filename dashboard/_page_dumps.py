"""The Dumps page: the statistics table of one step of one rank (sortable, filterable by name),
NaN/Inf and watchpoint hits highlighted; clicking a record shows its numeric headroom over the
dumped steps, its tensor's histogram when the dump holds tensor data, and links to its node in
the graph."""
from __future__ import annotations

from typing import Any

import pandas as pd
from dash import Input, Output, State, dcc, html

from dashboard import _data
from dashboard._context import Context
from dashboard._figures import headroom_figure, tensor_histogram
from dashboard._widgets import (control, data_table, empty_state, graph_link, notice, run_picker,
                                table_columns, table_records)

COLUMNS = ("seq", "name", "phase", "direction", "dtype", "shape", "min", "max", "mean", "norm",
           "nonfinite", "zeros", "hit", "source")
NO_HIT = "-"
HIGHLIGHT = [
    {"if": {"filter_query": "{nonfinite} > 0"}, "backgroundColor": "#fde0dc", "color": "#b71c1c"},
    {"if": {"filter_query": f'{{hit}} != "{NO_HIT}"'}, "backgroundColor": "#fff3cd"},
    {"if": {"filter_query": f'{{nonfinite}} > 0 && {{hit}} != "{NO_HIT}"'},
     "backgroundColor": "#fbc4bd", "color": "#b71c1c"},
]


def layout(ctx: Context, q: dict[str, str]) -> html.Div:
    run = ctx.run_in(q)
    return html.Div([
        html.H2("Dumps"),
        html.Div([run_picker("dumps-run", ctx.runs, value=run),
                  control("rank", dcc.Dropdown(id="dumps-rank", clearable=False), "dumps-rank"),
                  control("step", dcc.Dropdown(id="dumps-step", clearable=False), "dumps-step")],
                 className="sleuth-controls"),
        dcc.Store(id="dumps-want", data={"rank": q.get("rank"), "step": q.get("step")}),
        html.Div(id="dumps-summary"),
        data_table("dumps-table", columns=table_columns(COLUMNS), data=[],
                   style_data_conditional=HIGHLIGHT),
        html.Div(id="dumps-detail"),
    ], id="page-dumps")


def table_rows(stats: pd.DataFrame) -> list[dict[str, Any]]:
    """DataTable rows of a statistics frame: `nonfinite` = NaN + Inf counts, `hit` the watchpoint
    conditions (or '-'), row id = seq so a click survives sorting and filtering."""
    df = stats.copy()
    for c in ("nan", "posinf", "neginf", "zeros"):
        if c not in df:
            df[c] = 0
    df["nonfinite"] = df["nan"] + df["posinf"] + df["neginf"]
    df["hit"] = df["hit"].replace("", NO_HIT) if "hit" in df else NO_HIT
    cols = [c for c in COLUMNS if c in df]
    rows = table_records(df, cols)
    for row, seq in zip(rows, df["seq"] if "seq" in df else range(len(df))):
        row["id"] = int(seq)
    return rows


def register(app: Any, ctx: Context) -> None:
    @app.callback(Output("dumps-rank", "options"), Output("dumps-rank", "value"),
                  Output("dumps-summary", "children"),
                  Input("dumps-run", "value"), Input("data-version", "data"),
                  State("dumps-rank", "value"), State("dumps-want", "data"))
    def ranks(run, _v, current, want):
        root = ctx.root(run)
        if root is None:
            return [], None, empty_state("choose a run")
        try:
            d = _data.dump(root)
            ranks = list(d.ranks)
        except _data.NoData as e:
            return [], None, notice(e)
        skipped = list(getattr(d, "skipped", None) or [])
        notes = [html.P(f"{len(skipped)} partial or unreadable step file(s) skipped (a run still "
                        f"writing, or a crash): {skipped[0]}", className="sleuth-note")] if skipped else []
        if getattr(d, "manifest", None) is not None:  # a Parquet export (tracer.storage.ExportedDump)
            notes.append(html.P(f"statistics read from the Parquet export {d.root}: no tensor "
                                "bytes, and no watchpoint hits (those need the HDF5 dump)",
                                className="sleuth-note", id="dumps-export-note"))
        note = html.Div(notes) if notes else None
        if not ranks:
            return [], None, empty_state("this dump holds no complete step file yet")
        wanted = int(want["rank"]) if (want or {}).get("rank") not in (None, "") else None
        value = next((r for r in (current, wanted) if r in ranks), ranks[0])
        return [{"label": f"rank {r}", "value": r} for r in ranks], value, note

    @app.callback(Output("dumps-step", "options"), Output("dumps-step", "value"),
                  Input("dumps-rank", "value"), Input("data-version", "data"),
                  State("dumps-run", "value"), State("dumps-step", "value"), State("dumps-want", "data"))
    def steps(rank, _v, run, current, want):
        root = ctx.root(run)
        if root is None or rank is None:
            return [], None
        try:
            steps = list(_data.dump(root).steps(rank))
        except _data.NoData:
            return [], None
        wanted = int(want["step"]) if (want or {}).get("step") not in (None, "") else None
        value = next((s for s in (current, wanted) if s in steps), steps[-1] if steps else None)
        return [{"label": f"step {s}", "value": s} for s in steps], value

    @app.callback(Output("dumps-table", "data"), Output("dumps-detail", "children", allow_duplicate=True),
                  Input("dumps-step", "value"), State("dumps-rank", "value"), State("dumps-run", "value"),
                  prevent_initial_call=True)
    def table(step, rank, run):
        root = ctx.root(run)
        if root is None or rank is None or step is None:
            return [], None
        try:
            stats = _data.dump_stats(root, rank, step)
        except _data.NoData as e:
            return [], notice(e)
        bad = int((stats.get("nan", 0) + stats.get("posinf", 0) + stats.get("neginf", 0) > 0).sum()) \
            if not stats.empty else 0
        hits = int((stats["hit"] != "").sum()) if "hit" in stats else 0
        note = html.P(f"{len(stats)} records · {bad} with NaN/Inf · {hits} watchpoint hits. "
                      "Click a row for its tensor.", className="sleuth-note")
        return table_rows(stats), note

    @app.callback(Output("dumps-detail", "children"), Input("dumps-table", "active_cell"),
                  State("dumps-table", "data"), State("dumps-run", "value"), State("dumps-rank", "value"),
                  State("dumps-step", "value"), prevent_initial_call=True)
    def detail(cell, rows, run, rank, step):
        root = ctx.root(run)
        if not cell or root is None:
            return None
        row = next((r for r in rows or [] if r.get("id") == cell.get("row_id")), None)
        if row is None:
            return None
        name = str(row["name"])
        link = graph_link(root, run, name, "show {node} in the graph", "dumps-graph-link")
        parts: list[Any] = [html.H4(name), link]
        try:
            parts.append(dcc.Graph(id="dumps-tensor", figure=tensor_histogram(
                _data.dump_tensor(root, rank, step, name), name)))
        except _data.NoData as e:
            parts.append(notice(e))
        try:
            history = _data.record_history(root, rank, name)
            parts.append(dcc.Graph(id="dumps-headroom", figure=headroom_figure(history, name)))
        except _data.NoData as e:
            parts.append(notice(e))
        return html.Div(parts)
