"""Plain HTTP routes next to the Dash app: files of a run (a trace to download, a graph's SVG),
served only from under that run's root. Every path goes through `_runs.safe_path`."""
from __future__ import annotations

import mimetypes
import re

from flask import Flask, Response, abort, request

from dashboard._context import Context
from dashboard._errors import UnsafePathError
from dashboard._runs import safe_path

FILE_ROUTE = "/_sleuth/file"
SVG_ROUTE = "/_sleuth/svg"

_HIGHLIGHT_STYLE = ("<style>.sleuth-hit polygon, .sleuth-hit ellipse, .sleuth-hit path "
                    "{fill: #ffd54f !important; stroke: #d62728 !important; stroke-width: 3px !important;}</style>")


def register_routes(server: Flask, ctx: Context) -> None:
    """Add the file and SVG routes to the Flask server behind the Dash app."""

    def resolve(run: int, rel: str):
        root = ctx.root(run)
        if root is None:
            abort(404)
        try:
            path = safe_path(root, rel)
        except UnsafePathError:
            abort(403)
        if not path.is_file():
            abort(404)
        return path

    @server.before_request
    def only_our_routes() -> None:
        # Dash answers any unknown path with its index page; under /_sleuth/ an unmatched URL
        # (`//etc/passwd`, a bad run id) must be an error, not a page that looks like success.
        if request.path.startswith("/_sleuth/"):
            rule = request.url_rule
            if rule is None or rule.endpoint not in ("sleuth_file", "sleuth_svg"):
                abort(404)

    @server.route(f"{FILE_ROUTE}/<int:run>/<path:rel>")
    def sleuth_file(run: int, rel: str) -> Response:
        path = resolve(run, rel)
        mime = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
        resp = Response(path.read_bytes(), mimetype=mime)
        # A run's files are data, never pages of this site: no sniffing, no scripts.
        resp.headers["X-Content-Type-Options"] = "nosniff"
        resp.headers["Content-Security-Policy"] = "default-src 'none'; style-src 'unsafe-inline'"
        return resp

    @server.route(f"{SVG_ROUTE}/<int:run>/<path:rel>")
    def sleuth_svg(run: int, rel: str) -> Response:
        if not rel.endswith(".svg"):
            abort(404)
        path = resolve(run, rel)
        svg = highlight_svg(path.read_text(encoding="utf-8", errors="replace"),
                            request.args.get("highlight", ""))
        resp = Response(svg, mimetype="image/svg+xml")
        resp.headers["X-Content-Type-Options"] = "nosniff"
        resp.headers["Content-Security-Policy"] = "default-src 'none'; style-src 'unsafe-inline'"
        return resp


_GROUP = re.compile(r'<g id="(?P<id>[^"]+)" class="node">\s*<title>(?P<title>[^<]*)</title>(?P<body>.*?)</g>',
                    re.S)


_TEXT_XY = re.compile(r'<text[^>]* x="(?P<x>-?[\d.]+)" y="(?P<y>-?[\d.]+)"')
_TRANSLATE = re.compile(r'<g id="graph0" class="graph" transform="[^"]*translate\((?P<tx>-?[\d.]+)[ ,](?P<ty>-?[\d.]+)\)')
_SVG_OPEN = re.compile(r"<svg\b[^>]*>", re.S)


def highlight_svg(svg: str, name: str, *, focus: tuple[float, float] = (1400.0, 900.0)) -> str:
    """Graphviz SVG with the nodes whose title or label contains `name` marked `sleuth-hit`
    (filled yellow, outlined red), the view cropped to a `focus`-sized window around the first
    one so a large graph opens on the match. A pure string transform, tested without a server."""
    if not name:
        return svg
    needle = _escape(name)
    first: list[tuple[float, float]] = []

    def mark(m: re.Match[str]) -> str:
        if needle in m.group("title") or needle in m.group("body"):
            xy = _TEXT_XY.search(m.group("body"))
            if xy and not first:
                first.append((float(xy.group("x")), float(xy.group("y"))))
            return m.group(0).replace('class="node"', 'class="node sleuth-hit"', 1)
        return m.group(0)

    out = _GROUP.sub(mark, svg)
    tr = _TRANSLATE.search(out)
    if first and tr:
        w, h = focus
        cx, cy = first[0][0] + float(tr.group("tx")), first[0][1] + float(tr.group("ty"))
        view = f'<svg width="100%" height="100%" viewBox="{cx - w / 2:.0f} {cy - h / 2:.0f} {w:.0f} {h:.0f}"'
        out = _SVG_OPEN.sub(lambda m: re.sub(r"^<svg\b(\s+(width|height|viewBox)=\"[^\"]*\")*", view, m.group(0)),
                            out, count=1)
    end = out.rfind("</svg>")
    return out if end < 0 else out[:end] + _HIGHLIGHT_STYLE + out[end:]


def _escape(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
