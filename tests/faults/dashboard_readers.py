"""The dashboard as a reader of a forged run, for the fuzz harness (test_fault_fuzz.py): one app
over the pristine run (run 0) and the forged one (run 1), and for each page what it reads of
the forged run: its data functions (dashboard._data), its Dash callbacks posted as the browser
posts them, chained as the page chains them (a tag list feeds the graph), and the plain file
and SVG routes with the forged file's own path.

The property (checked by the harness): a data function answers or raises the dashboard's own
errors (`NoData`, `ReadError`, `DashboardError`) with a message; an HTTP answer is 2xx or 4xx,
never 5xx, and a callback's answer holds no "Traceback"."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import quote

PRISTINE, FORGED = 0, 1
"""The app's run ids: the run as written, and the copy one file of which is forged."""


class Http(NamedTuple):
    """One HTTP answer of the dashboard: its status, and its body as text."""

    status: int
    text: str


def _helpers() -> Any:
    """tests/dashboard/dashboard_helpers.py, which posts a Dash callback as the page does."""
    mod = sys.modules.get("dashboard_helpers")
    if mod is None:
        path = Path(__file__).resolve().parents[1] / "dashboard" / "dashboard_helpers.py"
        spec = importlib.util.spec_from_file_location("dashboard_helpers", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["dashboard_helpers"] = mod
        spec.loader.exec_module(mod)
    return mod


_apps: dict[Path, Any] = {}


def _client(good: Path, run: Path) -> Any:
    """A test client of the app over (good, run); one app a forged run, the last one kept."""
    app = _apps.get(run)
    if app is None:
        import dashboard

        _apps.clear()
        app = _apps[run] = dashboard.create_app([good, run], refresh_s=0)
    return app.server.test_client()


def forget(run: Path) -> None:
    """Drop the app and what the dashboard cached of `run` (each forged run is read once)."""
    from dashboard import _cache, _data

    _apps.pop(run, None)
    with _cache._lock:
        for key in [k for k in _cache._cache if isinstance(k, tuple) and run in k]:
            del _cache._cache[key]
        for table in (_data._tails, _data._metric_notes):
            for key in [k for k in table if Path(k).is_relative_to(run)]:
                del table[key]


def _post(client: Any, outputs, inputs, state=()) -> tuple[Http, dict | None]:
    status, out, _ = _helpers().callback(client, outputs, inputs, state)
    return Http(status, json.dumps(out)), out


def _get(client: Any, url: str) -> Http:
    resp = client.get(url)
    try:
        return Http(resp.status_code, resp.get_data().decode("utf-8", "replace"))
    finally:
        resp.close()


def _router(client: Any, page: str) -> Http:
    return _post(client, [("page", "children")], [("url", "pathname", page)],
                 [("url", "search", f"?run={FORGED}")])[0]


def _value(out: dict | None, id_: str, prop: str = "value") -> Any:
    return (out or {}).get(id_, {}).get(prop)


V = ("data-version", "data", "fuzz")


def page_runs(client: Any) -> list[Http]:
    """The Runs page, and the refresh poll every page runs (it lists the runs' data files)."""
    poll, _ = _post(client, [("data-version", "data")], [("refresh", "n_intervals", 1)], [V])
    return [_router(client, "/"), _post(client, [("runs-cards", "children")], [V])[0], poll]


def page_scalars(client: Any) -> list[Http]:
    tags, out = _post(client, [("scalars-tags", "options"), ("scalars-tags", "value"),
                               ("scalars-empty", "children")],
                      [("scalars-runs", "value", [FORGED]), V], [("scalars-tags", "value", None)])
    chosen = _value(out, "scalars-tags") or ["loss"]
    graph, _ = _post(client, [("scalars-graph", "figure"), ("scalars-drawn", "data")],
                     [("scalars-runs", "value", [PRISTINE, FORGED]), ("scalars-tags", "value", chosen),
                      ("scalars-smoothing", "value", 0.5), ("scalars-x", "value", "wall_time"),
                      ("scalars-log", "value", ["log"]), ("scalars-graph", "relayoutData", None), V],
                     [("scalars-drawn", "data", None)])
    return [_router(client, "/scalars"), tags, graph]


def page_histograms(client: Any) -> list[Http]:
    tags, out = _post(client, [("hist-tag", "options"), ("hist-tag", "value"), ("hist-empty", "children")],
                      [("hist-run", "value", FORGED), V], [("hist-tag", "value", None)])
    graph, _ = _post(client, [("hist-graph", "figure")],
                     [("hist-run", "value", FORGED), ("hist-tag", "value", _value(out, "hist-tag")), V])
    return [_router(client, "/histograms"), tags, graph]


def page_profile(client: Any) -> list[Http]:
    body, _ = _post(client, [("profile-body", "children")], [("profile-run", "value", FORGED), V])
    compare, _ = _post(client, [("profile-compare-body", "children")],
                       [("profile-run", "value", PRISTINE), ("profile-b", "value", FORGED), V])
    return [_router(client, "/profile"), body, compare]


def page_dumps(client: Any) -> list[Http]:
    ranks, out = _post(client, [("dumps-rank", "options"), ("dumps-rank", "value"),
                                ("dumps-summary", "children")],
                       [("dumps-run", "value", FORGED), V],
                       [("dumps-rank", "value", None), ("dumps-want", "data", {})])
    rank = _value(out, "dumps-rank")
    steps, out = _post(client, [("dumps-step", "options"), ("dumps-step", "value")],
                       [("dumps-rank", "value", rank), V],
                       [("dumps-run", "value", FORGED), ("dumps-step", "value", None),
                        ("dumps-want", "data", {})])
    step = _value(out, "dumps-step")
    table, out = _post(client, [("dumps-table", "data"), ("dumps-table", "page_count"),
                                ("dumps-table", "page_current"), ("dumps-detail", "children")],
                       [("dumps-step", "value", step), ("dumps-table", "page_current", 0),
                        ("dumps-table", "page_size", 50), ("dumps-table", "sort_by", []),
                        ("dumps-table", "filter_query", "")],
                       [("dumps-rank", "value", rank), ("dumps-run", "value", FORGED)])
    answers = [_router(client, "/dumps"), ranks, steps, table]
    rows = _value(out, "dumps-table", "data") or []
    if rows:
        cell = {"row": 0, "column": 0, "column_id": "name", "row_id": rows[0].get("id")}
        answers.append(_post(client, [("dumps-detail", "children")],
                             [("dumps-table", "active_cell", cell)],
                             [("dumps-table", "data", rows[:1]), ("dumps-run", "value", FORGED),
                              ("dumps-rank", "value", rank), ("dumps-step", "value", step)])[0])
    return answers


def page_diff(client: Any) -> list[Http]:
    body, _ = _post(client, [("diff-body", "children")],
                    [("diff-a", "value", PRISTINE), ("diff-b", "value", FORGED),
                     ("diff-rank", "value", 0), ("diff-step", "value", None),
                     ("diff-b-rank", "value", None), ("diff-b-step", "value", None), V])
    explain, _ = _post(client, [("diff-explain", "children")], [("diff-explain-btn", "n_clicks", 1)],
                       [("diff-a", "value", PRISTINE), ("diff-b", "value", FORGED),
                        ("diff-rank", "value", 0), ("diff-step", "value", None)])
    return [_router(client, "/diff"), body, explain]


def page_graph(client: Any) -> list[Http]:
    stages, out = _post(client, [("graph-stage", "options"), ("graph-stage", "value")],
                        [("graph-run", "value", FORGED), V],
                        [("graph-stage", "value", None), ("graph-want", "data", None)])
    body, _ = _post(client, [("graph-body", "children"), ("graph-matches", "children")],
                    [("graph-stage", "value", _value(out, "graph-stage")),
                     ("graph-search", "value", "linear")], [("graph-run", "value", FORGED)])
    return [_router(client, "/graph"), stages, body]


def routes(client: Any, rel: str) -> list[Http]:
    """The file route and the SVG route with `rel`, and the SVG route with the SVG beside an IR
    file (the route the Graph page's frame loads)."""
    answers = [_get(client, f"/_sleuth/file/{FORGED}/{quote(rel)}"),
               _get(client, f"/_sleuth/svg/{FORGED}/{quote(rel)}?highlight=linear")]
    if rel.endswith(".ir"):
        answers.append(_get(client, f"/_sleuth/svg/{FORGED}/{quote(rel[:-3])}.svg?highlight=linear"))
    return answers


PAGES = {"runs": page_runs, "scalars": page_scalars, "histograms": page_histograms,
         "profile": page_profile, "dumps": page_dumps, "diff": page_diff, "graph": page_graph}
"""Every page, by name. A page may read a file it never shows (a FIFO as the summary held pages
that never show it), so the many-example lane points every page at every forgery."""

SHOWN_BY = {"step": ("dumps", "diff"), "dump_json": ("dumps", "diff"),
            "summary": ("scalars", "histograms"), "window": ("profile",), "trace": ("profile",),
            "ir": ("graph",), "svg": ("graph",), "run_json": (), "metrics": ("scalars",),
            "meta": ()}
"""The pages that show each kind of file, besides the Runs page, which shows them all."""


def _data_functions(good: Path) -> dict[str, list]:
    """The data functions each kind of file is read by, as (name, call(run))."""
    from dashboard import _data

    def dump_detail(r: Path) -> Any:
        stats = _data.dump_stats(r, 0, 0)
        if len(stats):
            name = str(stats["name"].iloc[0])
            _data.record_history(r, 0, name)
            _data.dump_tensor(r, 0, 0, name)

    dump = [("data.dump", _data.dump), ("data.dump_stats", dump_detail),
            ("data.diff", lambda r: _data.diff(good, r)),
            ("data.rank_diff", lambda r: _data.rank_diff(good, r)),
            ("data.explain", lambda r: _data.explain(good, r))]
    summary = [("data.scalars", lambda r: (_data.scalars(r), _data.scalar_notes(r))),
               ("data.histograms", _data.histograms)]
    profile = [("data.profile", _data.profile),
               ("data.profile_diff", lambda r: _data.profile_diff(good, r))]
    ir = [("data.graphs", _data.graphs),
          ("data.ir_nodes", lambda r: _data.ir_nodes(r / "ir" / "00_forward.ir"))]
    return {"step": dump, "dump_json": dump, "summary": summary, "window": profile,
            "trace": profile, "ir": ir, "svg": ir[:1], "run_json": [], "metrics": summary[:1],
            "meta": []}


def readers(good: Path, targets: dict[str, str], *, every_page: bool) -> dict[str, list]:
    """target -> the dashboard's readers of that file, as (name, call(run)): its data
    functions, the Runs page and the pages that show it (`every_page`: all pages), and both
    file routes; a page or a route answers a list of `Http`."""
    data = _data_functions(good)

    def page(fn):
        return lambda r: fn(_client(good, r))

    out = {}
    for target, rel in targets.items():
        shown = PAGES if every_page else ("runs", *SHOWN_BY[target])
        out[target] = [*data[target],
                       *((f"dashboard {name} page", page(PAGES[name])) for name in shown),
                       ("dashboard file routes", lambda r, rel=rel: routes(_client(good, r), rel))]
    return out


def errors() -> tuple[type[BaseException], ...]:
    """What a data function may raise: the dashboard's own errors."""
    from dashboard._cache import NoData
    from dashboard._errors import DashboardError

    return (NoData, DashboardError)
