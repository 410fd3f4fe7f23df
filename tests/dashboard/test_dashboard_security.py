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
