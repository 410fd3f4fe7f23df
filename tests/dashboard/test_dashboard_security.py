"""Only files under the run roots are served: `..`, absolute paths, encoded tricks and symlinks
out are refused, in the path helper and over HTTP."""
from __future__ import annotations

import http.client
import os

import pytest

from dashboard_helpers import free_port, write_run
from dashboard._errors import UnsafePathError
from dashboard._runs import safe_path


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    import dashboard

    base = tmp_path_factory.mktemp("sec")
    run = write_run(base / "run", name="run", steps=5)
    (base / "secret.txt").write_text("TOP SECRET")
    (run / "ir").mkdir()
    (run / "ir" / "00_forward.svg").write_text('<svg><g id="node1" class="node"><title>a</title></g></svg>')
    os.symlink(base / "secret.txt", run / "link.txt")
    handle = dashboard.serve(dashboard.create_app([run], refresh_s=0), port=free_port(), background=True)
    try:
        yield handle, run
    finally:
        handle.close()


def get(handle, raw_path: str) -> tuple[int, bytes]:
    # http.client sends the path as written: no client-side `..` normalisation.
    conn = http.client.HTTPConnection(handle.host, handle.port, timeout=10)
    try:
        conn.request("GET", raw_path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


@pytest.mark.parametrize("rel", ["../secret.txt", "/etc/passwd", "a/../../secret.txt", "..", "",
                                 "x\\..\\secret.txt", "link.txt", "ok\x00.txt"])
def test_safe_path_refuses_escapes(served, rel):
    _, run = served
    with pytest.raises(UnsafePathError):
        safe_path(run, rel)


def test_safe_path_allows_inside(served):
    _, run = served
    assert safe_path(run, "ir/00_forward.svg") == run / "ir" / "00_forward.svg"


@pytest.mark.parametrize("path", [
    "/_sleuth/file/0/../secret.txt", "/_sleuth/file/0/..%2fsecret.txt", "/_sleuth/file/0/%2e%2e/secret.txt",
    "/_sleuth/file/0/%2e%2e%2fsecret.txt", "/_sleuth/file/0//etc/passwd", "/_sleuth/file/0/%2fetc%2fpasswd",
    "/_sleuth/file/0/link.txt", "/_sleuth/file/1/run.json", "/_sleuth/file/-1/run.json",
    "/_sleuth/svg/0/../../secret.txt", "/_sleuth/svg/0/run.json", "/_sleuth/file/0/ir/..%5c..%5csecret.txt",
    "/_sleuth/file/0/../../../../etc/passwd",
])
def test_http_traversal_is_refused(served, path):
    handle, _ = served
    status, body = get(handle, path)
    assert status in (400, 403, 404), (path, status)
    assert b"TOP SECRET" not in body and b"root:" not in body


def test_http_serves_files_inside(served):
    handle, _ = served
    status, body = get(handle, "/_sleuth/file/0/run.json")
    assert status == 200 and b'"name": "run"' in body
    status, body = get(handle, "/_sleuth/svg/0/ir/00_forward.svg?highlight=a")
    assert status == 200 and b"sleuth-hit" in body


def test_binds_loopback_by_default(served):
    handle, _ = served
    assert handle.host == "127.0.0.1"


def test_no_pickle_anywhere():
    from pathlib import Path

    src = Path(__file__).resolve().parents[2] / "dashboard"
    for f in src.glob("*.py"):
        text = f.read_text()
        assert "import pickle" not in text and "pickle." not in text, f


@pytest.mark.parametrize("path", [
    "/" + "a" * 8000, "/a/" * 2000, "/_sleuth/file/0/" + "a" * 8000, "/_sleuth/svg/0/" + "a" * 8000 + ".svg",
    "/_sleuth/file/0/" + "/".join(["b" * 250] * 40), "/_sleuth/file/0/" + "%C3%A9" * 3000, "/nope", "/%ff",
    "/scalars/extra", "/_dash-component-suites/dash/x.js", "/_dash-component-suites/dash/" + "a" * 8000,
    "/_dash-component-suites/nope/x.js", "/static/" + "a" * 8000, "/assets/" + "a" * 8000,
    "/_sleuth/file/" + "9" * 5000 + "/run.json",
], ids=lambda p: f"{p[:24]}..{len(p)}")
def test_odd_urls_are_404_never_500(served, path):
    """An 8,000-character path was a 500 (the file system refuses the name), a path that is no
    page answered with the app's index, and a script path Dash does not know was a 500."""
    handle, _ = served
    status, body = get(handle, path)
    assert status in (400, 404), (path[:60], status)


@pytest.mark.parametrize("path", ["/", "/scalars", "/scalars/", "/dumps", "/graph"])
def test_pages_are_still_served(served, path):
    handle, _ = served
    status, body = get(handle, path)
    assert status == 200 and b"_dash-config" in body


def test_over_long_highlight_is_refused(served):
    handle, _ = served
    status, _ = get(handle, "/_sleuth/svg/0/ir/00_forward.svg?highlight=" + "a" * 5000)
    assert status == 400


def test_forged_svg_highlights_in_linear_time(tmp_path):
    """A graph SVG forged to hold thousands of node groups and no `</g>` made the highlight's
    lazy regex quadratic: 8,000 groups (424 KB) took about 40 s, and a few MB hung the page."""
    import time

    import dashboard

    run = write_run(tmp_path / "run", name="run", steps=2)
    (run / "ir").mkdir()
    svg = "<svg>" + '<g id="n" class="node"><title>a</title><text>x</text>' * 40_000 + "</svg>"
    (run / "ir" / "00_forward.svg").write_text(svg)
    handle = dashboard.serve(dashboard.create_app([run], refresh_s=0), port=free_port(), background=True)
    try:
        t = time.monotonic()
        status, body = get(handle, "/_sleuth/svg/0/ir/00_forward.svg?highlight=a")
        took = time.monotonic() - t
    finally:
        handle.close()
    assert status == 200 and body.endswith(b"</svg>") and took < 5, took


def test_highlight_matches_as_before():
    from dashboard._routes import highlight_svg

    svg = ('<svg width="10pt" height="10pt" viewBox="0 0 10 10"><g id="graph0" class="graph" '
           'transform="scale(1 1) rotate(0) translate(4 40)"><g id="node1" class="node"><title>x::aten.mm</title>'
           '<text x="1" y="2">mm</text></g><g id="node2" class="node"><title>b</title><text x="5" y="6">'
           'relu</text></g><g id="node3" class="node"><title>c</title><text x="7" y="8">aten.mm.2</text></g></svg>')
    out = highlight_svg(svg, "aten.mm")
    assert out.count('class="node sleuth-hit"') == 2
    assert 'id="node2" class="node">' in out and 'viewBox="-695 -408 1400 900"' in out
