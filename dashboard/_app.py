"""`create_app(run_dirs)`: the Dash app, its page shell (navigation, routing by URL path) and
the refresh loop that re-reads runs that are still training."""
from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from dashboard import (_page_diff, _page_dumps, _page_graph, _page_histograms, _page_profile,
                       _page_runs, _page_scalars)
from dashboard._context import Context, query
from dashboard._routes import register_routes
from dashboard._runs import fingerprint, load_runs
from dashboard._values import text
from dashboard._widgets import empty_state

PAGES = {  # path -> (title, module); the order is the navigation bar's
    "/": ("Runs", _page_runs),
    "/scalars": ("Scalars", _page_scalars),
    "/histograms": ("Histograms", _page_histograms),
    "/profile": ("Profile", _page_profile),
    "/dumps": ("Dumps", _page_dumps),
    "/diff": ("Diff", _page_diff),
    "/graph": ("Graph", _page_graph),
}

_CSS = """
body { font-family: system-ui, sans-serif; margin: 0; color: #222; background: #fafafa; }
.sleuth-nav { display: flex; gap: 4px; align-items: center; padding: 6px 16px; background: #263238; }
.sleuth-nav .brand { color: #fff; font-weight: bold; margin-right: 16px; }
.sleuth-nav a { color: #cfd8dc; text-decoration: none; padding: 6px 10px; border-radius: 4px; }
.sleuth-nav a:hover, .sleuth-nav a.active { background: #37474f; color: #fff; }
#page { padding: 8px 20px 40px; }
.sleuth-controls { display: flex; flex-wrap: wrap; gap: 16px; align-items: flex-end; margin: 8px 0; }
.sleuth-control { min-width: 200px; }
.sleuth-control label { display: block; font-size: 12px; color: #555; margin-bottom: 2px; }
.sleuth-empty { padding: 16px; margin: 8px 0; border: 1px dashed #999; border-radius: 6px; color: #555;
  background: #fff; }
.sleuth-error { padding: 12px 16px; margin: 8px 0; border: 1px solid #d32f2f; border-left-width: 6px;
  border-radius: 6px; color: #b71c1c; background: #ffebee; white-space: pre-wrap; }
.sleuth-card { background: #fff; border: 1px solid #ddd; border-radius: 6px; padding: 8px 16px; margin: 8px 0; }
.sleuth-kv th { text-align: left; padding-right: 12px; color: #555; font-weight: normal; }
.sleuth-badges { margin: 8px 0; }
.sleuth-badge { display: inline-block; padding: 2px 8px; margin: 2px 4px 2px 0; border-radius: 10px;
  font-size: 12px; text-decoration: none; }
.sleuth-badge.on { background: #c8e6c9; color: #1b5e20; }
.sleuth-badge.off { background: #eee; color: #888; }
.sleuth-note { color: #444; font-size: 13px; }
.sleuth-svg { width: 100%; height: 75vh; border: 1px solid #ddd; background: #fff; }
.sleuth-panel { background: #fff; margin: 8px 0; }
.sleuth-links a { margin-right: 12px; }
"""

_INDEX = """<!DOCTYPE html>
<html>
  <head>
    {%metas%}
    <title>{%title%}</title>
    {%favicon%}
    {%css%}
    <style>""" + _CSS + """</style>
  </head>
  <body>
    {%app_entry%}
    <footer>{%config%}{%scripts%}{%renderer%}</footer>
  </body>
</html>"""


def create_app(run_dirs: Iterable[str | os.PathLike[str]], *, refresh_s: float = 5.0) -> Any:
    """A Dash app over `run_dirs`: Runs, Scalars, Histograms, Profile, Dumps, Diff and Graph
    pages. Serve it with `dashboard.serve(app)` (127.0.0.1) or `app.run()`.

    Args:
        run_dirs: one or more run directories; only files under them are ever served.
        refresh_s: how often the page checks the runs' files for changes (a run still
            training); 0 turns refreshing off.

    Raises:
        RunDirError: a run directory does not exist.
    """
    import dash
    from dash import Input, Output, State, dcc, html, no_update

    ctx = Context(runs=load_runs(run_dirs))
    app = dash.Dash(__name__, title="Sleuth", suppress_callback_exceptions=True, update_title=None,
                    assets_folder=os.path.join(os.path.dirname(__file__), "_no_assets"),
                    serve_locally=True)
    app.index_string = _INDEX
    nav = [html.Span("Sleuth", className="brand")] + [
        dcc.Link(title, href=path, id=f"nav-{title.lower()}") for path, (title, _) in PAGES.items()]
    app.layout = html.Div([
        dcc.Location(id="url"),
        dcc.Interval(id="refresh", interval=max(refresh_s, 0.5) * 1000, disabled=refresh_s <= 0),
        dcc.Store(id="data-version", data=_version(ctx)),
        html.Nav(nav, className="sleuth-nav"),
        html.Div(id="page"),
    ])

    @app.callback(Output("page", "children"), Input("url", "pathname"), State("url", "search"))
    def route(pathname: str | None, search: str | None) -> Any:
        pathname = text(pathname) or "/"
        entry = PAGES.get(pathname.rstrip("/") or "/")
        if entry is None:
            shown = pathname if len(pathname) <= 80 else pathname[:80] + "..."
            return empty_state(f"no page at {shown!r}: choose one above")
        return entry[1].layout(ctx, query(search))

    @app.callback(Output("data-version", "data"), Input("refresh", "n_intervals"),
                  State("data-version", "data"), prevent_initial_call=True)
    def poll(_n: int, current: str) -> Any:
        new = _version(ctx)
        return no_update if new == current else new

    for _, module in PAGES.values():
        module.register(app, ctx)
    register_routes(app.server, ctx, pages=PAGES, callbacks=app.callback_map)
    app.sleuth_context = ctx  # for tests and the CLI: which runs this app shows
    return app


def _version(ctx: Context) -> str:
    """A token that changes when any run's files change: page callbacks take it as an input."""
    return str(hash(tuple(fingerprint(r.root) for r in ctx.runs)))
