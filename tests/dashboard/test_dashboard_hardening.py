"""The dashboard server against hostile or damaged input: Host headers that are not its names
(DNS rebinding) are refused, a bind beyond loopback warns and prints real URLs, files stream in
chunks with bounded memory, and a damaged file shows an error panel naming it."""
from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from dashboard_helpers import REPO, free_port, write_run
from dashboard._routes import CHUNK_BYTES, file_chunks, host_name
from dashboard._serve import is_loopback, served_names, served_urls


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    import dashboard

    run = write_run(tmp_path_factory.mktemp("hard") / "run", name="run", steps=5)
    handle = dashboard.serve(dashboard.create_app([run], refresh_s=0), port=free_port(),
                             background=True, allowed_hosts=["proxy.example"])
    try:
        yield handle, run
    finally:
        handle.close()


def request(handle, path: str, host: str | None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(handle.host, handle.port, timeout=30)
    try:
        conn.putrequest("GET", path, skip_host=True)
        if host is not None:
            conn.putheader("Host", host)
        conn.endheaders()
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


@pytest.mark.parametrize("path", ["/", "/_dash-layout", "/_sleuth/file/0/run.json"])
@pytest.mark.parametrize("host", ["evil.example", "evil.example:{port}", "127.0.0.1.evil.example",
                                  "", None])
def test_foreign_host_header_is_refused(served, path, host):
    handle, _ = served
    status, body = request(handle, path, None if host is None else host.format(port=handle.port))
    assert status == 403, (host, path, status)
    assert b"is not a name this dashboard serves" in body and b'"name": "run"' not in body


@pytest.mark.parametrize("host", ["127.0.0.1:{port}", "localhost:{port}", "LOCALHOST", "[::1]:{port}",
                                  "proxy.example", "proxy.example:{port}"])
def test_own_names_are_served(served, host):
    handle, _ = served
    status, body = request(handle, "/_sleuth/file/0/run.json", host.format(port=handle.port))
    assert status == 200 and b'"name": "run"' in body


def test_host_names_and_urls():
    assert host_name("[::1]:8050") == "::1" and host_name("Example.COM.:80") == "example.com"
    assert is_loopback("127.0.0.2") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.5")
    assert served_names("127.0.0.1") == {"localhost", "127.0.0.1", "::1"}
    assert "10.1.2.3" in served_names("10.1.2.3")
    wild = served_names("0.0.0.0")
    assert socket.gethostname().lower() in wild and "127.0.0.1" in wild
    assert served_urls("10.1.2.3", 80) == ["http://10.1.2.3:80/"]
    urls = served_urls("0.0.0.0", 8050)
    assert urls[0] == "http://127.0.0.1:8050/" and f"http://{socket.gethostname()}:8050/" in urls


def test_cli_warns_and_prints_real_urls_beyond_loopback(tmp_path):
    run = write_run(tmp_path / "r", name="r", steps=3)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-m", "sleuth", "dashboard", str(run), "--host", "0.0.0.0",
                             "--port", str(port), "--no-browser"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        line = proc.stdout.readline()
        warning = proc.stderr.readline()
        assert f"http://127.0.0.1:{port}/" in line and f"http://{socket.gethostname()}:{port}/" in line
        assert "warning: --host 0.0.0.0 serves beyond this machine" in warning
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 130
    finally:
        if proc.poll() is None:
            proc.kill()


def test_file_chunks_are_bounded(tmp_path):
    path = tmp_path / "big.bin"
    with open(path, "wb") as f:
        f.truncate(3 * CHUNK_BYTES + 5)
    sizes = [len(c) for c in file_chunks(open(path, "rb"))]
    assert sizes == [CHUNK_BYTES] * 3 + [5]


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_large_download_streams_with_bounded_memory(tmp_path):
    import dashboard

    run = write_run(tmp_path / "run", name="run", steps=3)
    size = 200 << 20
    with open(run / "trace.bin", "wb") as f:  # sparse: no disk used, still 200 MB to read
        f.truncate(size)
    handle = dashboard.serve(dashboard.create_app([run], refresh_s=0), port=free_port(), background=True)
    peak, stop = [_rss()], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak.append(_rss())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    try:
        base = _rss()
        sampler.start()
        conn = http.client.HTTPConnection(handle.host, handle.port, timeout=60)
        conn.request("GET", "/_sleuth/file/0/trace.bin")
        resp = conn.getresponse()
        assert resp.status == 200 and int(resp.getheader("Content-Length")) == size
        got = 0
        while chunk := resp.read(1 << 20):
            got += len(chunk)
        conn.close()
    finally:
        stop.set()
        sampler.join()
        handle.close()
    assert got == size
    growth = max(peak) - base
    assert growth < 48 << 20, f"serving a 200 MB file grew the server's memory by {growth >> 20} MB"


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_damaged_profile_shows_an_error_panel_naming_the_file(tmp_path):
    pytest.importorskip("profiler")
    import dashboard

    run = write_run(tmp_path / "r", name="r", steps=2)
    d = run / "profile" / "rank0"
    d.mkdir(parents=True)
    (d / "window0.json").write_bytes(b"\xff\xfe not json")
    (d / "window0.trace.json").write_text('{"traceEvents": []}')
    app = dashboard.create_app([run], refresh_s=0)
    client = app.server.test_client()
    client.get("/")
    body = {"output": "profile-body.children",
            "outputs": {"id": "profile-body", "property": "children"},
            "inputs": [{"id": "profile-run", "property": "value", "value": 0},
                       {"id": "data-version", "property": "data", "value": "x"}],
            "changedPropIds": ["profile-run.value"], "state": []}
    resp = client.post("/_dash-update-component", json=body)
    assert resp.status_code == 200
    panel = resp.get_json()["response"]["profile-body"]["children"]
    assert panel["props"]["className"] == "sleuth-error"
    text = str(panel["props"]["children"])
    assert str(d / "window0.json") in text and "Traceback" not in text


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_damaged_dump_step_is_a_read_error(tmp_path):
    pytest.importorskip("tracer")
    import h5py
    import torch

    from dashboard import _data
    from dashboard._widgets import notice
    from tracer._config import DumpConfig
    from tracer.storage import RecordMeta, make_writer

    run = write_run(tmp_path / "r", name="r", steps=2)
    w = make_writer(DumpConfig(path=str(run), writer="sync"), rank=0, world_size=1)
    w.begin_step(0)
    w.add(RecordMeta("fc.forward.0.output.0", "fc", "", "forward", "output", 0, 0, "m.py:1"),
          torch.ones(2))
    w.end_step()
    w.close()
    path = run / "dump" / "rank0" / "step0.h5"
    with h5py.File(path, "r+") as f:
        del f["records"]
        f.create_group("records")
    with pytest.raises(_data.ReadError) as e:
        _data.dump_stats(run, 0, 0)
    panel = notice(e.value)
    assert panel.className == "sleuth-error" and str(path) in str(panel.children)
    assert notice(_data.NoData("this run has no profile")).className == "sleuth-empty"


def test_bound_to_every_interface_any_address_but_no_foreign_name(tmp_path):
    import dashboard

    run = write_run(tmp_path / "run", name="run", steps=3)
    handle = dashboard.serve(dashboard.create_app([run], refresh_s=0), host="0.0.0.0",
                             port=free_port(), background=True)
    try:
        for host, status in [("10.9.8.7:{port}", 200), (f"{socket.gethostname()}:{{port}}", 200),
                             ("[fe80::1]:{port}", 200), ("evil.example:{port}", 403)]:
            conn = http.client.HTTPConnection("127.0.0.1", handle.port, timeout=30)
            conn.putrequest("GET", "/_sleuth/file/0/run.json", skip_host=True)
            conn.putheader("Host", host.format(port=handle.port))
            conn.endheaders()
            assert conn.getresponse().status == status, host
            conn.close()
    finally:
        handle.close()
