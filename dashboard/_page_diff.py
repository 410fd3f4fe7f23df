"""The Diff page: two runs (and a rank and step of each) compared record by record through
`tracer.diff`: error metrics along execution order with the first divergence marked, a button
that explains it (bug or rounding: dashboard._explain_panel), and the table of the worst
records, each linked to its node in the graph. Step files that were missing,
damaged, partial or interrupted are named in an error panel, and the status is then never
"same"."""
from __future__ import annotations

from typing import Any

import pandas as pd
from dash import Input, Output, dcc, html

from dashboard import _data
from dashboard._context import Context
from dashboard._explain_panel import panel as explain_panel
from dashboard._explain_panel import register as register_explain
from dashboard._errors import BadValueError
from dashboard._figures import diff_figure, empty_figure, rank_grid_figure
from dashboard._values import record, records, typed_whole, whole
from dashboard._widgets import (control, data_table, empty_state, graph_link, notice, run_picker,
                                table_columns, table_records)

METRICS = ("max_abs_err", "max_rel_err", "rmse", "cosine", "within")
STAT_METRICS = ("norm_rdiff", "mean_rdiff", "max_rdiff", "min_rdiff")  # statistics-only diffs
_WORST_BY = ("error", "max_rel_err", "max_abs_err", "rmse", "norm_rdiff", "max_rdiff")


def layout(ctx: Context, q: dict[str, str]) -> html.Div:
    a = ctx.run_in(q, "a")
    a = 0 if a is None else a
    b = ctx.run_in(q, "b")
    b = min(1, len(ctx.runs) - 1) if b is None else b
    return html.Div([
        html.H2("Diff"),
        html.Div([run_picker("diff-a", ctx.runs, value=a, label="run A"),
                  run_picker("diff-b", ctx.runs, value=b, label="run B"),
                  control("rank (empty: all)", dcc.Input(id="diff-rank", type="number", min=0, debounce=True),
                          "diff-rank"),
                  control("step (empty: all)", dcc.Input(id="diff-step", type="number", min=0, debounce=True),
                          "diff-step"),
                  control("rank B (empty: same)", dcc.Input(id="diff-b-rank", type="number", min=0, debounce=True),
                          "diff-b-rank"),
                  control("step B (empty: same)", dcc.Input(id="diff-b-step", type="number", min=0, debounce=True),
                          "diff-b-step")], className="sleuth-controls"),
        dcc.Loading(html.Div(id="diff-body")),
    ], id="page-diff")


def call_diff(root_a: Any, root_b: Any, rank: int | None, step: int | None,
              b_rank: int | None = None, b_step: int | None = None) -> Any:
    """tracer.diff on two runs (or two ranks or steps of one run) with A's rank and step and
    B's; one left None takes tracer.diff's default."""
    chosen = {"rank": rank, "step": step, "b_rank": b_rank, "b_step": b_step}
    kwargs = {k: v for k, v in chosen.items() if v is not None}
    return _data.diff(root_a, root_b, **kwargs)


def first_order(first: dict[str, Any] | None, records: pd.DataFrame) -> int | None:
    """The x position (execution order) of the first divergent record."""
    if not first:
        return None
    if "verdict" in records and "order" in records:
        hit = records.loc[records["verdict"] == "diverged", "order"]
        if len(hit):
            return int(hit.iloc[0])
    for key in ("order", "seq"):
        if first.get(key) is not None:
            return int(first[key])
    name = first.get("name")
    if name is not None and "name" in records and "seq" in records:
        hit = records.loc[records["name"] == name, "seq"]
        if len(hit):
            return int(hit.iloc[0])
    return None


def plotted_metrics(records: pd.DataFrame) -> list[str]:
    """Tensor error metrics when tensors were compared, else the statistics' relative diffs."""
    def useful(c: str) -> bool:
        return c in records and pd.api.types.is_numeric_dtype(records[c]) and records[c].notna().any()

    return [m for m in METRICS if useful(m)] or [m for m in STAT_METRICS if useful(m)]


_UNPAIRED = ("only_a", "only_b")
_ERROR_STYLE = {"border": "1px solid #c62828", "background": "#ffebee", "color": "#b71c1c",
                "padding": "8px 12px", "margin": "8px 0", "borderRadius": "6px", "whiteSpace": "pre-wrap"}


def worst(records: pd.DataFrame, n: int = 50) -> pd.DataFrame:
    """The `n` records to look at first: divergent records by their error (`error`, the diff's
    one number per record: NaN/Inf patterns that differ are infinite, then the larger the
    worse; a divergence without a number after those with one), then the others by error, and
    the records without a partner last: they are listed, never ranked as divergences."""
    by = next((c for c in _WORST_BY if c in records), None)
    if by is None:
        return records.head(n)
    key = pd.to_numeric(records[by], errors="coerce")
    rank = pd.Series(1, index=records.index)
    if "verdict" in records:
        rank = records["verdict"].map(lambda v: 2 if v in _UNPAIRED else 0 if v == "diverged" else 1)
    nonfinite = records["nan_diff"].fillna(0) + records["inf_diff"].fillna(0) if "nan_diff" in records \
        else pd.Series(0, index=records.index)
    order = pd.DataFrame({"rank": rank, "unmeasured": key.isna(), "key": -key.fillna(0.0),
                          "nonfinite": -nonfinite}).sort_values(
        ["rank", "unmeasured", "key", "nonfinite"], kind="stable")
    return records.loc[order.index[:n]]


def nonfinite_counts(records: pd.DataFrame) -> pd.Series:
    """The NaN/+Inf/-Inf counts of each side as text ("3/0/0 | 0/0/0"; "-" for a side that lacks
    the record)."""
    def side(r: Any, prefix: str) -> str:
        n = r.get(prefix + "nan")
        if n is None or pd.isna(n) or int(n) < 0:
            return "-"
        return f"{int(n)}/{int(r[prefix + 'posinf'])}/{int(r[prefix + 'neginf'])}"
    if "nan" not in records:
        return pd.Series("", index=records.index)
    return records.apply(lambda r: f"{side(r, '')} | {side(r, 'b_')}", axis=1)


def problems_panel(result: Any) -> html.Div | None:
    """The step files that were not fully read (named, with what is wrong), and the steps
    --allow-missing left out; None when every selected step was read completely."""
    problems = list(getattr(result, "problems", None) or [])
    left_out = list(getattr(result, "left_out", None) or [])
    if not problems and not left_out:
        return None
    parts: list[Any] = []
    if problems:
        parts += [html.Strong(f"{len(problems)} step file(s) not fully read or on one side only: "
                              "this diff is not a complete comparison"),
                  html.Ul([html.Li(_line(p)) for p in problems])]
    if left_out:
        parts += [html.Strong(f"{len(left_out)} step(s) left out (allow_missing):"),
                  html.Ul([html.Li(_line(p)) for p in left_out])]
    return html.Div(parts, id="diff-problems", className="sleuth-error", style=_ERROR_STYLE)


def setup_panel(changes: list[dict[str, Any]], most: int = 8) -> html.Div | None:
    """How the runs were set up differently (a diff's setup change), likeliest cause first:
    what the records cannot show, and what the divergence may follow from."""
    setup = next((c for c in changes if c.get("kind") == "setup"), None)
    if setup is None:
        return None
    found = setup["differences"]
    items = [html.Li(d["text"]) for d in found[:most]]
    if len(found) > most:
        items.append(html.Li(f"and {len(found) - most} more (sleuth diff --json)"))
    return html.Div([html.P(f"the runs were set up differently (step {setup['step']}; "
                            "likeliest cause first):"), html.Ul(items)],
                    id="diff-setup", className="sleuth-note")


def _error_panel(message: str) -> html.Div:
    return html.Div(message, id="diff-problems", className="sleuth-error", style=_ERROR_STYLE)


def _is_tracer_error(e: BaseException | None) -> bool:
    try:
        from tracer import TracerError
    except ImportError:
        return False
    return isinstance(e, TracerError)


def _line(p: Any) -> str:
    line = getattr(p, "line", None)
    return line() if callable(line) else str(p)


def register(app: Any, ctx: Context) -> None:
    @app.callback(Output("diff-body", "children"), Input("diff-a", "value"), Input("diff-b", "value"),
                  Input("diff-rank", "value"), Input("diff-step", "value"), Input("diff-b-rank", "value"),
                  Input("diff-b-step", "value"), Input("data-version", "data"))
    def _body(a, b, rank, step, b_rank, b_step, _v):
        return body(ctx, a, b, rank, step, b_rank, b_step)

    @app.callback(Output("diff-rank", "value"), Output("diff-step", "value"),
                  Input("diff-rank-grid", "clickData"), prevent_initial_call=True)
    def _open_cell(click):
        return cell_of(click)

    register_explain(app, ctx)


def cell_of(click: dict | None) -> tuple[Any, Any]:
    """(rank, step) of a clicked cell of the rank x step grid: the one-pair diff opens there."""
    from dash.exceptions import PreventUpdate

    points = records((record(click) or {}).get("points"))
    cell = (whole(points[0].get("y")), whole(points[0].get("x"))) if points else (None, None)
    if None in cell:
        raise PreventUpdate
    return cell


def ranks_body(ctx: Context, a: Any, b: Any, step: int | None) -> Any:
    """Every rank of both runs: the earliest divergence across ranks, one line per rank that is
    not the same, and the rank x step grid (a click opens that rank and step below)."""
    ra, rb = ctx.root(a), ctx.root(b)
    try:
        result = _data.rank_diff(ra, rb, step)
    except _data.NoData as e:
        if _is_tracer_error(e.__cause__):
            return [_error_panel(str(e))]
        return [notice(e)]
    status = str(result.status)
    head: list[Any] = [
        html.Span(f"status: {status}", id="diff-status",
                  className="sleuth-badge " + ("on" if status == "same" else "off")),
        html.Span(f"{len(result.ranks)} rank(s) compared, every rank with the same rank of B; "
                  "click a cell to open that rank and step", className="sleuth-note")]
    only = [f"rank(s) only in {side}: {', '.join(map(str, rs))}"
            for side, rs in (("A", result.only_a), ("B", result.only_b)) if rs]
    unread = [f"rank {r['rank']}: {r['error'] or '; '.join(p['path'] + ': ' + p['state'] for p in r['problems'][:3])}"
              for r in result.ranks if r["status"] == "incomplete"]
    if only or unread:
        head.append(html.Div([html.Strong("not every rank was compared whole:"),
                              html.Ul([html.Li(x) for x in only + unread])],
                             id="diff-problems", className="sleuth-error", style=_ERROR_STYLE))
    fd = result.earliest
    earliest = None
    if fd:
        earliest = (int(fd["rank"]), int(fd["step"]))
        where = " · ".join(f"{k}: {fd[k]}" for k in ("name", "module", "op", "source") if fd.get(k))
        head += [html.P(f"earliest divergence: rank {fd['rank']} step {fd['step']} · {where}",
                        id="diff-first"),
                 graph_link(ra, a, str(fd.get("name", "")), "show {node} in the graph of run A")]
    fig = rank_grid_figure(result.table(), earliest)
    return [html.Div(head), dcc.Graph(id="diff-rank-grid", figure=fig)]


def body(ctx: Context, a: Any, b: Any, rank: int | None, step: int | None, b_rank: int | None,
         b_step: int | None) -> Any:
    """The page below the controls for runs `a` and `b` (indices into ctx.runs)."""
    ra, rb = ctx.root(a), ctx.root(b)
    if ra is None or rb is None:
        return empty_state("choose two runs")
    try:
        rank, step = typed_whole(rank, "rank"), typed_whole(step, "step")
        b_rank, b_step = typed_whole(b_rank, "rank B"), typed_whole(b_step, "step B")
    except BadValueError as e:
        return empty_state(str(e))
    if len(ctx.runs) < 2:
        note = "start the dashboard with two runs to compare them: `sleuth dashboard RUN_A RUN_B`"
    else:
        note = None
    if rank is None and b_rank is None and b_step is None and max(
            _data.rank_count(ra), _data.rank_count(rb)) > 1:
        return ranks_body(ctx, a, b, step)
    try:
        result = call_diff(ra, rb, rank, step, b_rank, b_step)
    except _data.NoData as e:
        if _is_tracer_error(e.__cause__):  # the dumps are there but could not be compared
            return [_error_panel(str(e)), empty_state(note) if note else None]
        return [notice(e), empty_state(note) if note else None]
    except Exception as e:  # noqa: BLE001 - a diff that cannot run is shown, not crashed on
        return empty_state(f"the diff failed: {e}")
    records = getattr(result, "records", pd.DataFrame())
    if "verdict" in records:
        counts = records["verdict"].value_counts().to_dict()
    else:
        counts = {}
    first = getattr(result, "first_divergence", None)
    x = first_order(first, records)
    status = str(getattr(result, "status", "?"))
    head = [html.Span(f"status: {status}", id="diff-status",
                      className="sleuth-badge " + ("on" if status == "same" else "off")),
            html.Span(" · ".join(f"{k} {v}" for k, v in counts.items()), className="sleuth-note"),
            problems_panel(result), setup_panel(getattr(result, "changes", None) or [])]
    for st in getattr(result, "steps", None) or []:
        if st.get("status") == "interrupted":
            head.append(html.P(f"step {st['step']} interrupted: {st['reason']}", className="sleuth-note"))
    if first:
        where = " · ".join(f"{k}: {first[k]}" for k in ("name", "module", "op", "source") if first.get(k))
        head += [html.P(f"first divergence: {where}", id="diff-first"),
                 graph_link(ra, a, str(first.get("name", "")), "show {node} in the graph of run A")]
    metrics = plotted_metrics(records)
    order = "order" if "order" in records else "seq"
    fig = diff_figure(records, metrics, first=x, order=order) if metrics else empty_figure("no error metrics")
    bad = worst(records)
    if len(bad):
        bad = bad.assign(**{"nan/+inf/-inf A | B": nonfinite_counts(bad)})
    cols = [c for c in (order, "step", "name", "verdict", "nan/+inf/-inf A | B", "error", *metrics,
                        "source", "reason") if c in bad]
    rows = table_records(bad, cols)
    ops = "op" in records and bool((records["op"].astype(str) != "").any())
    return [html.Div(head), explain_panel(first, ops), dcc.Graph(id="diff-graph", figure=fig),
            html.H3("worst records"),
            data_table("diff-table", columns=table_columns(cols), data=rows, page_size=15)]
