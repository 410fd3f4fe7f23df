"""Plain HTTP routes next to the Dash app: files of a run (a trace to download, a graph's SVG),
served only from under that run's root, streamed in chunks. Every path goes through
`_runs.safe_path`. Every request, Dash's own included, must name this server in its Host
header: a page on another site that rebinds its DNS name to 127.0.0.1 sends its own name there,
and is refused. A URL that names no page, no file and no Dash resource (too long, undecodable,
a page that does not exist) is a 404 page, never Dash's index nor a server error."""
from __future__ import annotations

import ipaddress
import mimetypes
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, BinaryIO

from flask import Flask, Response, abort, request

from dashboard._context import Context
from dashboard._errors import UnsafePathError
from dashboard._runs import MAX_REL_CHARS, safe_path
from dashboard._serve import ALLOWED_HOSTS, ANY_ADDRESS, LOOPBACK_NAMES

CHUNK_BYTES = 1 << 20
"""Bytes read and sent at a time by the file route: memory stays at this, whatever the file."""
FILE_ROUTE = "/_sleuth/file"
SVG_ROUTE = "/_sleuth/svg"
SVG_HIGHLIGHT_MAX_BYTES = 32 << 20
"""A larger SVG is served as it is, in chunks, without highlighting (which reads it whole)."""
HIGHLIGHT_MAX_CHARS = 1000
"""The longest node name the SVG route highlights (a node name is far shorter)."""
_NOT_FOUND = ("<!DOCTYPE html><html><head><title>Sleuth: no such page</title></head><body>"
              "<h1>404: no such page</h1><p>This dashboard has no page at this address. "
              "Its pages: {links}.</p></body></html>")

_HIGHLIGHT_STYLE = ("<style>.sleuth-hit polygon, .sleuth-hit ellipse, .sleuth-hit path "
                    "{fill: #ffd54f !important; stroke: #d62728 !important; stroke-width: 3px !important;}</style>")


CALLBACK_ROUTE = "/_dash-update-component"
"""Where the page posts its callbacks (Dash's route under the app's path prefix "/")."""


def callback_problem(body: Any, callbacks: Mapping[str, Any]) -> str | None:
    """What is wrong with a callback request's JSON body, in one line, or None when Dash can
    dispatch it: an object naming a callback the app registers (`output`, a key of
    `callbacks`, Dash's `callback_map`), with its `outputs` and one {id, property} entry for
    each input and state the callback takes. The values are each callback's to judge
    (dashboard._values); Dash itself fails with a server error on any other shape."""
    if not isinstance(body, dict):
        return "the body is not a JSON object"
    output = body.get("output")
    if not isinstance(output, str) or output not in callbacks:
        return "`output` names no callback of this dashboard"
    spec = callbacks[output]
    outputs = body.get("outputs")
    if not all(_slot(o) for o in (outputs if isinstance(outputs, list) else [outputs])):
        return "`outputs` is not an {id, property} object or a list of them"
    changed = body.get("changedPropIds", [])
    if not (isinstance(changed, list) and all(isinstance(c, str) for c in changed)):
        return "`changedPropIds` is not a list of strings"
    for key in ("inputs", "state"):
        slots = body.get(key, [])
        if not (isinstance(slots, list) and all(_slot(x) for x in slots)):
            return f"`{key}` is not a list of {{id, property}} objects"
        if len(slots) != len(spec.get(key) or []):
            return f"`{key}` holds {len(slots)} entries where this callback takes " \
                   f"{len(spec.get(key) or [])}"
    return None


def _slot(x: Any) -> bool:
    return isinstance(x, dict) and isinstance(x.get("id"), (str, dict)) \
        and isinstance(x.get("property"), str)


def register_routes(server: Flask, ctx: Context, pages: Iterable[str] = ("/",),
                    callbacks: Mapping[str, Any] | None = None) -> None:
    """Add the file and SVG routes to the Flask server behind the Dash app, and answer a URL
    that is none of `pages` (the Dash app's page paths), a file route or a Dash resource with
    a 404 page; a callback request whose body is no call of one of `callbacks` (the app's
    `callback_map`) with a 400 naming what is wrong."""
    page_paths = frozenset(pages)

    def resolve(run: str, rel: str):
        # The run id is parsed by the context, not by werkzeug's int converter, which fails (a
        # 500) on more digits than Python converts.
        root = ctx.root(run)
        if root is None or len(rel) > MAX_REL_CHARS or any(len(p) > 255 for p in rel.split("/")):
            abort(404)  # no run, or a name no file system holds
        try:
            path = safe_path(root, rel)
        except UnsafePathError:
            abort(403)
        try:
            if not path.is_file():
                abort(404)
        except OSError:
            abort(404)
        return path

    server.config.setdefault(ALLOWED_HOSTS, LOOPBACK_NAMES)

    from dash.exceptions import DependencyException

    @server.errorhandler(DependencyException)
    def no_such_resource(_e: Exception) -> Response:
        # Dash raises this (a 500) for any script path it did not register: a URL, not a fault.
        return Response("no such resource\n", status=404, mimetype="text/plain")

    @server.before_request
    def check_host() -> Response | None:
        raw = request.environ.get("HTTP_HOST", "")
        name = host_name(raw)
        allowed = server.config[ALLOWED_HOSTS]
        if name in allowed or (server.config.get(ANY_ADDRESS) and _is_address(name)):
            return None
        return Response(f"Host {raw!r} is not a name this dashboard serves "
                        f"({', '.join(sorted(allowed))}). Open it by one of those names, or "
                        f"start it with --allow-host NAME if you trust {name or 'that name'!r}.\n",
                        status=403, mimetype="text/plain")

    @server.before_request
    def only_our_routes() -> Response | None:
        # Dash answers any unknown path with its index page; under /_sleuth/ an unmatched URL
        # (`//etc/passwd`, a bad run id) must be an error, not a page that looks like success,
        # and elsewhere a path that is no page (a typo, 8,000 characters) says so.
        rule = request.url_rule
        if request.path.startswith("/_sleuth/"):
            if rule is None or rule.endpoint not in ("sleuth_file", "sleuth_svg"):
                abort(404)
        elif rule is not None and rule.rule == "/<path:path>":
            if ("/" + request.path.strip("/")) not in page_paths:
                links = ", ".join(f'<a href="{p}">{p}</a>' for p in sorted(page_paths))
                return Response(_NOT_FOUND.format(links=links), status=404, mimetype="text/html")
        return None

    @server.before_request
    def callbacks_dash_can_dispatch() -> Response | None:
        if callbacks is None or request.path != CALLBACK_ROUTE or request.method != "POST":
            return None
        problem = callback_problem(request.get_json(silent=True), callbacks)
        if problem is None:
            return None
        return Response(f"not a callback request of this dashboard: {problem}\n", status=400,
                        mimetype="text/plain")

    @server.route(f"{FILE_ROUTE}/<run>/<path:rel>")
    def sleuth_file(run: str, rel: str) -> Response:
        path = resolve(run, rel)
        mime = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
        f = _open_regular(path)
        size = os.fstat(f.fileno()).st_size
        resp = Response(file_chunks(f), mimetype=mime, direct_passthrough=True)
        resp.headers["Content-Length"] = str(size)
        # A run's files are data, never pages of this site: no sniffing, no scripts.
        resp.headers["X-Content-Type-Options"] = "nosniff"
        resp.headers["Content-Security-Policy"] = "default-src 'none'; style-src 'unsafe-inline'"
        return resp

    @server.route(f"{SVG_ROUTE}/<run>/<path:rel>")
    def sleuth_svg(run: str, rel: str) -> Response:
        if not rel.endswith(".svg"):
            abort(404)
        path = resolve(run, rel)
        highlight = request.args.get("highlight", "")
        if len(highlight) > HIGHLIGHT_MAX_CHARS:
            abort(400, f"highlight is {len(highlight):,} characters; no node name is longer than "
                       f"{HIGHLIGHT_MAX_CHARS}")
        f = _open_regular(path)
        size = os.fstat(f.fileno()).st_size
        if size > SVG_HIGHLIGHT_MAX_BYTES:
            resp = Response(file_chunks(f), mimetype="image/svg+xml", direct_passthrough=True)
            resp.headers["Content-Length"] = str(size)
        else:
            with f:
                text = f.read(SVG_HIGHLIGHT_MAX_BYTES).decode("utf-8", errors="replace")
            resp = Response(highlight_svg(text, highlight), mimetype="image/svg+xml")
        resp.headers["X-Content-Type-Options"] = "nosniff"
        resp.headers["Content-Security-Policy"] = "default-src 'none'; style-src 'unsafe-inline'"
        return resp


def _open_regular(path: os.PathLike) -> BinaryIO:
    """The run's file at `path`, open for reading, or the request aborted: 404 when it cannot be
    opened, 403 naming it when it is no regular file (a FIFO would hold the request forever)."""
    from tracer import UntrustedFileError
    from tracer.storage import open_regular

    try:
        return open_regular(path)
    except UntrustedFileError as e:
        abort(403, str(e))
    except OSError:
        abort(404)


def file_chunks(f: BinaryIO, size: int = CHUNK_BYTES) -> Iterator[bytes]:
    """The open file `f` in chunks of `size` bytes, closed at the end (or when the client goes
    away and the server closes the iterator)."""
    with f:
        while chunk := f.read(size):
            yield chunk


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def host_name(host: str) -> str:
    """The name in a Host header, lower case, without port or brackets: "[::1]:8050" -> "::1"."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")


_NODE_OPEN = re.compile(r'<g id="(?P<id>[^"]+)" class="node">\s*<title>(?P<title>[^<]*)</title>')
_TEXT_XY = re.compile(r'<text[^>]* x="(?P<x>-?[\d.]+)" y="(?P<y>-?[\d.]+)"')
_TRANSLATE = re.compile(r'<g id="graph0" class="graph" transform="[^"]*translate\((?P<tx>-?[\d.]+)[ ,](?P<ty>-?[\d.]+)\)')
_SVG_OPEN = re.compile(r"<svg\b[^>]*>", re.S)
_HEAD_CHARS = 1 << 16
"""Graphviz writes the <svg> tag and the graph's transform first: only this head is searched."""
_BODY_CHARS = 1 << 11
"""A node's label position is searched in this much of its body."""


def highlight_svg(svg: str, name: str, *, focus: tuple[float, float] = (1400.0, 900.0)) -> str:
    """Graphviz SVG with the nodes whose title or label contains `name` marked `sleuth-hit`
    (filled yellow, outlined red), the view cropped to a `focus`-sized window around the first
    one so a large graph opens on the match. A pure string transform, tested without a server.

    One pass over the text: a node is its opening tag and title up to the next `</g>`, and the
    scan goes on after that `</g>`, so an SVG forged to hold many unclosed groups costs no more
    than a real one of its size (a lazy regex over it is quadratic).
    """
    if not name:
        return svg
    needle = _escape(name)
    first: list[tuple[float, float]] = []
    parts: list[str] = []
    copied = pos = 0
    while (m := _NODE_OPEN.search(svg, pos)) is not None:
        end = svg.find("</g>", m.end())
        if end < 0:
            break
        body = svg[m.end():end]
        if needle in m.group("title") or needle in body:
            xy = _TEXT_XY.search(body[:_BODY_CHARS])
            if xy and not first:
                first.append((float(xy.group("x")), float(xy.group("y"))))
            parts += [svg[copied:m.start()], m.group(0).replace('class="node"', 'class="node sleuth-hit"', 1)]
            copied = m.end()
        pos = end + len("</g>")
    parts.append(svg[copied:])
    out = "".join(parts)
    head, rest = out[:_HEAD_CHARS], out[_HEAD_CHARS:]
    tr = _TRANSLATE.search(head)
    if first and tr:
        w, h = focus
        cx, cy = first[0][0] + float(tr.group("tx")), first[0][1] + float(tr.group("ty"))
        view = f'<svg width="100%" height="100%" viewBox="{cx - w / 2:.0f} {cy - h / 2:.0f} {w:.0f} {h:.0f}"'
        head = _SVG_OPEN.sub(lambda m: re.sub(r"^<svg\b(\s+(width|height|viewBox)=\"[^\"]*\")*", view, m.group(0)),
                             head, count=1)
        out = head + rest
    end = out.rfind("</svg>")
    return out if end < 0 else out[:end] + _HIGHLIGHT_STYLE + out[end:]


def _escape(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
