"""The Runs page: each run's run.json (name, created, world size, versions, config) and which
kinds of data it holds, with links to the pages that show them. A run.json that cannot be read
(too large, too deep, not JSON) is said on that run's card; the other runs show as usual."""
from __future__ import annotations

import json
from typing import Any

from dash import Input, Output, dcc, html

from dashboard._context import Context
from dashboard._routes import FILE_ROUTE
from dashboard._runs import Run, available, link_problems, load_run_json
from dashboard._widgets import ERROR_CLASS, empty_state, error_panel

CONFIG_SHOWN_CHARS = 64 * 1024
"""The config is shown up to this many characters; the rest is a link to run.json itself."""

_PAGE_OF = {"metrics": "/scalars", "summary": "/scalars", "dump": "/dumps", "profile": "/profile",
            "ir": "/graph", "checkpoints": None}


def layout(ctx: Context, q: dict[str, str]) -> html.Div:
    return html.Div([html.H2("Runs"), html.Div(id="runs-cards", children=_cards(ctx))],
                    id="page-runs")


def register(app: Any, ctx: Context) -> None:
    @app.callback(Output("runs-cards", "children"), Input("data-version", "data"),
                  prevent_initial_call=True)
    def refresh(_version: Any) -> list[html.Div]:
        return _cards(ctx)


def _cards(ctx: Context) -> list[html.Div]:
    return [_card(r) for r in ctx.runs]


def _card(run: Run) -> html.Div:
    info, problem = load_run_json(run.root)
    have = available(run.root)
    versions = {k: v for k, v in info.items() if k.endswith("_version") or k == "versions"}
    rows = [("path", str(run.root)), ("name", info.get("name", "?")),
            ("created", info.get("created", "?")),
            ("world size", info.get("world_size", "?")),
            ("argv", _argv(info.get("argv")))]
    rows += [(k, json.dumps(v) if not isinstance(v, str) else v) for k, v in versions.items()]
    badges = []
    for kind, present in have.items():
        page = _PAGE_OF.get(kind)
        cls = "sleuth-badge " + ("on" if present else "off")
        text = f"{kind}: {'yes' if present else 'no'}"
        badges.append(dcc.Link(text, href=f"{page}?run={run.index}", className=cls)
                      if present and page else html.Span(text, className=cls))
    config = {k: v for k, v in info.items() if k not in {"name", "created", "argv", "world_size"}
              and k not in versions}
    body: list[Any] = [
        html.H3(run.label),
        html.Table([html.Tr([html.Th(k), html.Td(str(v))]) for k, v in rows], className="sleuth-kv"),
        html.Div(badges, className="sleuth-badges"),
    ]
    links = [m for m in link_problems(run.root) if m != problem]
    body += [error_panel(m) for m in ([problem] if problem else []) + links]
    body += _live_marks(run)
    if not info and not problem:
        body.append(empty_state("no run.json in this folder: runs made by `sleuth train` or "
                                "`sleuth run` write one; the data below is still shown"))
    if config:
        text = json.dumps(config, indent=2, sort_keys=True, default=str)
        shown: list[Any] = [html.Pre(text[:CONFIG_SHOWN_CHARS])]
        if len(text) > CONFIG_SHOWN_CHARS:
            shown.append(html.P([f"the first {CONFIG_SHOWN_CHARS:,} of {len(text):,} characters; "
                                 "the whole file: ", html.A("run.json", href=f"{FILE_ROUTE}/{run.index}/run.json")],
                                className="sleuth-note"))
        body.append(html.Details([html.Summary("config"), *shown]))
    return html.Div(body, className="sleuth-card", id=f"run-card-{run.index}")


def _live_marks(run: Run) -> list[html.Div]:
    """The first divergence each rank's live reference found (`sleuth run --reference`), one
    mark a rank, with the diff that names it again; a file that does not read is said."""
    from tracer import read_live_reference

    marks = []
    for found in read_live_reference(run.root):
        if "error" in found:
            marks.append(error_panel(f"live reference of rank {found['rank']}: {found['error']}"))
            continue
        line = str(found["line"]).removeprefix("live reference: ")
        reference = str(found.get("reference", "?"))
        marks.append(html.Div([
            html.Strong(f"Diverged from its reference (rank {found['rank']}): "), line,
            html.Div([f"reference {reference}; again, with every record: ",
                      html.Code(f"sleuth diff {reference} {run.root}")], className="sleuth-note")],
            className=ERROR_CLASS, role="alert", id=f"run-live-{run.index}-{found['rank']}"))
    return marks


def _argv(argv: Any) -> str:
    """run.json's argv as one line; any other shape (a hand-edited or forged file) as JSON."""
    if isinstance(argv, list):
        return " ".join(map(str, argv)) or "?"
    return "?" if argv is None else json.dumps(argv, default=str)
