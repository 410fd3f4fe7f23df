"""Small layout pieces every page uses: the empty-state box, run pickers, a data table."""
from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from dash import dash_table, dcc, html

from dashboard._runs import Run, run_options

EMPTY_CLASS = "sleuth-empty"
ERROR_CLASS = "sleuth-error"


def empty_state(message: str) -> html.Div:
    """A visible note that says why a page or panel has nothing to show, and how to fix it."""
    return html.Div(message, className=EMPTY_CLASS)


def error_panel(message: str) -> html.Div:
    """A panel that says a file of the run could not be read: which file, what is wrong and what
    to do (the reader's message), in place of the data, never a traceback."""
    return html.Div([html.Strong("Cannot read this data: "), message], className=ERROR_CLASS,
                    role="alert")


def notice(e: Exception) -> html.Div:
    """The panel for a `NoData` a page caught: an error panel for a damaged file, else the
    empty state that says how to get the data."""
    from dashboard._cache import ReadError

    return error_panel(str(e)) if isinstance(e, ReadError) else empty_state(str(e))


def run_picker(id_: str, runs: Sequence[Run], *, multi: bool = False, value: Any = None,
               label: str = "run") -> html.Div:
    """A labelled dropdown over the dashboard's runs (values are run indices)."""
    if value is None:
        value = [r.index for r in runs] if multi else (runs[0].index if runs else None)
    return html.Div([html.Label(label, htmlFor=id_),
                     dcc.Dropdown(id=id_, options=run_options(runs), value=value, multi=multi,
                                  clearable=multi)], className="sleuth-control")


def graph_link(root: Path, run: Any, record: str, text: str, id_: str | None = None) -> Any:
    """A link to a dump record's node on the Graph page (`text` may use `{node}`), or None when
    the record names no node or the run has no IR graphs: there the link would open a page
    that only says the graph is missing."""
    from dashboard import _data

    node = _data.node_name_for_record(record)
    if not node:
        return None
    try:
        _data.graphs(root)
    except _data.NoData:
        return None
    extra = {"id": id_} if id_ else {}
    return dcc.Link(text.format(node=node), href="/graph?" + urlencode({"run": run, "node": node}),
                    **extra)


def control(label: str, component: Any, id_: str | None = None) -> html.Div:
    return html.Div([html.Label(label, htmlFor=id_), component], className="sleuth-control")


def data_table(id_: str, **kwargs: Any) -> dash_table.DataTable:
    """A dash DataTable with the house defaults (native sort and filter, paging).

    dash_table is deprecated in Dash 4 in favour of dash-ag-grid, an extra dependency; it still
    ships with dash, so its construction-time DeprecationWarning is silenced here, once.
    """
    opts: dict[str, Any] = dict(sort_action="native", filter_action="native", page_size=25,
                                style_table={"overflowX": "auto"},
                                style_cell={"fontFamily": "monospace", "fontSize": 12,
                                            "padding": "2px 6px", "textAlign": "left",
                                            "maxWidth": 420, "overflow": "hidden",
                                            "textOverflow": "ellipsis"},
                                style_header={"fontWeight": "bold"})
    opts.update(kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return dash_table.DataTable(id=id_, **opts)


def table_columns(names: Sequence[str]) -> list[dict[str, Any]]:
    """DataTable column specs; float columns formatted with 4 significant digits."""
    from dash.dash_table.Format import Format

    cols: list[dict[str, Any]] = []
    for n in names:
        if n in _FLOATS:
            cols.append({"name": n, "id": n, "type": "numeric", "format": Format(precision=4)})
        elif n in _INTS:
            cols.append({"name": n, "id": n, "type": "numeric"})
        else:
            cols.append({"name": n, "id": n})
    return cols


_FLOATS = {"min", "max", "mean", "norm", "value", "cosine", "max_abs_err", "max_rel_err", "rmse",
           "within", "mean_abs_err", "norm_rdiff", "mean_rdiff", "max_rdiff", "min_rdiff"}


def table_records(df: Any, cols: Sequence[str]) -> list[dict[str, Any]]:
    """DataFrame rows for a DataTable: NaN becomes empty and +-Inf the strings 'inf'/'-inf'
    (JSON has neither), numpy scalars become Python numbers."""
    import math

    rows = []
    for rec in df[list(cols)].to_dict("records"):
        out = {}
        for k, v in rec.items():
            if hasattr(v, "item"):
                v = v.item()
            if isinstance(v, float) and not math.isfinite(v):
                v = None if math.isnan(v) else ("inf" if v > 0 else "-inf")
            out[k] = v
        rows.append(out)
    return rows
_INTS = {"numel", "nan", "posinf", "neginf", "zeros", "seq", "index", "call", "rank", "step"}
