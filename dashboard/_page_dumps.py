"""The Dumps page: the statistics table of one step of one rank (sortable, filterable by name),
NaN/Inf and watchpoint hits highlighted; clicking a record shows its numeric headroom over the
dumped steps, its tensor's histogram when the dump holds tensor data, and links to its node in
the graph. The table is paged, sorted and filtered on the server (dashboard._paging): a step
of a million records sends one page of rows at a time, never the step."""
from __future__ import annotations

from typing import Any

import pandas as pd
from dash import Input, Output, State, ctx as dash_ctx, dcc, html, no_update

from dashboard import _data
from dashboard._context import Context
from dashboard._figures import headroom_figure, tensor_histogram
from dashboard._paging import filter_frame, page_of, sort_frame
from dashboard._values import record, records, text, whole
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
                   style_data_conditional=HIGHLIGHT, page_action="custom", sort_action="custom",
                   filter_action="custom", page_current=0, page_count=1),
        html.Div(id="dumps-detail"),
    ], id="page-dumps")


def table_frame(stats: pd.DataFrame) -> pd.DataFrame:
    """The table's columns of a statistics frame: `nonfinite` = NaN + Inf counts, `hit` the
    watchpoint conditions (or '-'), `id` = seq so a click survives sorting and filtering."""
    df = stats.copy()
    for c in ("nan", "posinf", "neginf", "zeros"):
        if c not in df:
            df[c] = 0
    df["nonfinite"] = df["nan"] + df["posinf"] + df["neginf"]
    df["hit"] = df["hit"].replace("", NO_HIT) if "hit" in df else NO_HIT
    df["id"] = df["seq"] if "seq" in df else range(len(df))
    return df


def table_rows(frame: pd.DataFrame) -> list[dict[str, Any]]:
    """DataTable rows of a `table_frame` (or of a statistics frame, which it first becomes)."""
    df = frame if "nonfinite" in frame and "id" in frame else table_frame(frame)
    rows = table_records(df, [c for c in COLUMNS if c in df])
    for row, seq in zip(rows, df["id"]):
        row["id"] = int(seq)
    return rows


def table_page(frame: pd.DataFrame, page_current: Any, page_size: Any, sort_by: Any,
               filter_query: Any) -> tuple[list[dict[str, Any]], int, int, int, list[str]]:
    """One page of the table: (rows, page_count, page shown, rows matching the filter, the
    parts of the filter not understood)."""
    matched, bad = filter_frame(frame, text(filter_query) or "")
    matched = sort_frame(matched, sort_by)
    rows, count, page = page_of(matched, page_current, page_size)
    return table_rows(rows), count, page, len(matched), bad


def _want(want: Any, key: str) -> int | None:
    """The rank or step the URL asked for, None when it names none (or no number)."""
    return whole((record(want) or {}).get(key))


def _summary_note(frame: pd.DataFrame, matched: int, query: Any, bad: list[str]) -> html.Div:
    bad_rows = int((frame["nonfinite"] > 0).sum()) if len(frame) else 0
    hits = int((frame["hit"] != NO_HIT).sum()) if len(frame) else 0
    text = f"{len(frame)} records · {bad_rows} with NaN/Inf · {hits} watchpoint hits. "
    if query:
        text += f"{matched} match the filter. "
    parts: list[Any] = [html.P(text + "Click a row for its tensor.", className="sleuth-note")]
    if bad:
        parts.append(html.P("filter not understood, not applied: " + "; ".join(b[:200] for b in bad),
                            className="sleuth-note", id="dumps-filter-problem"))
    return html.Div(parts)


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
        wanted = _want(want, "rank")
        value = next((r for r in (whole(current), wanted) if r in ranks), ranks[0])
        return [{"label": f"rank {r}", "value": r} for r in ranks], value, note

    @app.callback(Output("dumps-step", "options"), Output("dumps-step", "value"),
                  Input("dumps-rank", "value"), Input("data-version", "data"),
                  State("dumps-run", "value"), State("dumps-step", "value"), State("dumps-want", "data"))
    def steps(rank, _v, run, current, want):
        root, rank = ctx.root(run), whole(rank)
        if root is None or rank is None:
            return [], None
        try:
            steps = list(_data.dump(root).steps(rank))
        except _data.NoData:
            return [], None
        wanted = _want(want, "step")
        value = next((s for s in (whole(current), wanted) if s in steps), steps[-1] if steps else None)
        return [{"label": f"step {s}", "value": s} for s in steps], value

    @app.callback(Output("dumps-table", "data"), Output("dumps-table", "page_count"),
                  Output("dumps-table", "page_current"),
                  Output("dumps-detail", "children", allow_duplicate=True),
                  Input("dumps-step", "value"), Input("dumps-table", "page_current"),
                  Input("dumps-table", "page_size"), Input("dumps-table", "sort_by"),
                  Input("dumps-table", "filter_query"),
                  State("dumps-rank", "value"), State("dumps-run", "value"),
                  prevent_initial_call=True)
    def table(step, page, size, sort_by, filter_query, rank, run):
        root, rank, step = ctx.root(run), whole(rank), whole(step)
        if root is None or rank is None or step is None:
            return [], 1, 0, None
        fired = set(dash_ctx.triggered_prop_ids)
        if fired & {"dumps-step.value", "dumps-table.filter_query"}:
            page = 0  # a new step, or a new filter, opens on its first page
        try:
            frame = _data.dump_table(root, rank, step, table_frame)
        except _data.NoData as e:
            return [], 1, 0, notice(e)
        rows, count, page, matched, bad = table_page(frame, page, size, sort_by, filter_query)
        if fired and fired <= {"dumps-table.page_current", "dumps-table.page_size",
                               "dumps-table.sort_by"} and not bad:
            return rows, count, page, no_update  # a new page or order: keep the record shown
        return rows, count, page, _summary_note(frame, matched, text(filter_query), bad)

    @app.callback(Output("dumps-detail", "children"), Input("dumps-table", "active_cell"),
                  State("dumps-table", "data"), State("dumps-run", "value"), State("dumps-rank", "value"),
                  State("dumps-step", "value"), prevent_initial_call=True)
    def detail(cell, rows, run, rank, step):
        root, cell, rank, step = ctx.root(run), record(cell), whole(rank), whole(step)
        if not cell or root is None or rank is None or step is None:
            return None
        row_id = whole(cell.get("row_id"))
        row = next((r for r in records(rows) if row_id is not None and r.get("id") == row_id), None)
        name = text((row or {}).get("name"))
        if not name:
            return None
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
