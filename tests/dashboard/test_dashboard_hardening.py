"""The dashboard server against hostile or damaged input: Host headers that are not its names
(DNS rebinding) are refused, a bind beyond loopback warns and prints real URLs, files stream in
chunks with bounded memory, and a damaged file shows an error panel naming it."""
from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from dashboard_helpers import REPO, callback, free_port, runs_page, write_run
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


@pytest.mark.slow
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


# ---------------------------------------------------------------- hostile run files


def _dashboard_cli(*runs) -> tuple[subprocess.Popen, str]:
    """`sleuth dashboard RUNS --port 0` in a subprocess, and the URL it printed."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-m", "sleuth", "dashboard", *map(str, runs), "--port", "0",
                             "--no-browser", "--refresh", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    line = proc.stdout.readline()
    if "http://" not in line:
        proc.kill()
        raise AssertionError(f"the dashboard did not start: {line}{proc.stderr.read()[-2000:]}")
    return proc, line.split()[3].rstrip("/")


class _Http:
    """The `get`/`post` of a test client, over real HTTP to a served dashboard."""

    def __init__(self, url: str) -> None:
        self.url = url

    def get(self, path: str):
        import requests

        return requests.get(self.url + path, timeout=60)

    def post(self, path: str, json: dict):
        import requests

        return requests.post(self.url + path, json=json, timeout=60)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def _scalar_tags(client, runs: list[int]) -> tuple[int, dict | None]:
    status, out, _ = callback(client, [("scalars-tags", "options"), ("scalars-tags", "value"),
                                       ("scalars-empty", "children")],
                              [("scalars-runs", "value", runs), ("data-version", "data", "x")],
                              [("scalars-tags", "value", [])])
    return status, out


@pytest.mark.slow
def test_deep_run_json_and_deep_metrics_line_do_not_stop_the_dashboard(tmp_path):
    """A 200k-deep run.json killed `sleuth dashboard` at start (RecursionError), and a deeply
    nested metrics line crashes pyarrow's parser (the server process dies). Now the run's card
    and the Scalars page say what is wrong, and the other run still shows."""
    good = write_run(tmp_path / "good", name="tiny", steps=5)
    bad = write_run(tmp_path / "bad", name="tiny", steps=5)
    (bad / "run.json").write_text("[" * 200_000 + "]" * 200_000)
    with open(bad / "metrics.jsonl", "a") as f:
        f.write('{"step": 9, "x": ' + "[" * 200_000 + "]" * 200_000 + "}\n")
    proc, url = _dashboard_cli(good, bad)
    try:
        session = _Http(url)
        status, page = runs_page(session)
        assert status == 200
        assert "nested deeper than 64 levels" in page and str(bad / "run.json") in page
        assert page.count("metrics: yes") == 2  # the good run's card, and the bad run's data
        status, out = _scalar_tags(session, [0, 1])
        assert status == 200, "the Scalars page failed on a deeply nested metrics line"
        notes = json.dumps(out["scalars-empty"])
        assert "1 malformed line(s) skipped (line 6: JSON nested deeper than 64 levels" in notes
        assert [o["value"] for o in out["scalars-tags"]["options"]][:2] == ["loss", "lr"]
        assert proc.poll() is None
    finally:
        _stop(proc)


def test_malformed_metrics_line_is_counted_not_a_server_error(tmp_path):
    import dashboard

    run = write_run(tmp_path / "r", name="r", steps=5)
    with open(run / "metrics.jsonl", "a") as f:
        f.write("{not json\n[1, 2]\n" + json.dumps({"step": 5, "loss": 0.25}) + "\n")
    client = dashboard.create_app([run], refresh_s=0).server.test_client()
    status, out = _scalar_tags(client, [0])
    assert status == 200
    note = json.dumps(out["scalars-empty"])
    assert "2 malformed line(s) skipped (line 6: invalid JSON" in note and "sleuth-error" in note
    from dashboard import _data

    assert len(_data.scalars(run)["loss"]) == 6  # every good line, the one after the bad ones too


def test_large_run_json_is_refused_not_sent(tmp_path):
    """A run.json of tens of MB went out whole in the Runs page's response."""
    import dashboard

    good = write_run(tmp_path / "good", name="tiny", steps=3)
    big = write_run(tmp_path / "big", name="tiny", steps=3)
    with open(big / "run.json", "w") as f:
        f.write('{"name": "big", "pad": "' + "x" * (24 << 20) + '"}')
    client = dashboard.create_app([good, big], refresh_s=0).server.test_client()
    status, out, size = callback(client, [("page", "children")], [("url", "pathname", "/")],
                                 [("url", "search", "")])
    assert status == 200 and size < 256 << 10, f"the Runs page sent {size:,} bytes"
    page = json.dumps(out)
    assert "more than the 1,048,576 sleuth reads" in page and str(big / "run.json") in page


def test_huge_metrics_file_is_read_up_to_its_limit(tmp_path, monkeypatch):
    import dashboard
    import dashboard._data as data
    from dashboard import _metrics

    for module, name in ((_metrics, "MAX_BYTES"), (data, "METRICS_MAX_BYTES")):
        monkeypatch.setattr(module, name, 64 << 10)
    monkeypatch.setattr(_metrics, "CHUNK_BYTES", 16 << 10)
    run = write_run(tmp_path / "r", name="r", steps=3000)  # about 500 KB
    client = dashboard.create_app([run], refresh_s=0).server.test_client()
    status, out = _scalar_tags(client, [0])
    assert status == 200
    size = (run / "metrics.jsonl").stat().st_size
    assert f"{size:,} bytes; only its first 65,536 bytes are read and shown" in json.dumps(out["scalars-empty"])
    n = len(data.scalars(run)["loss"])
    assert 0 < n < 3000 and n * 100 <= 64 << 10


def test_links_out_of_the_run_are_refused_and_named(tmp_path):
    """A run folder whose profile/ and metrics.jsonl are symbolic links to elsewhere: the
    dashboard shows neither (the elsewhere may be `/`, walked whole to stamp it) and says why."""
    pytest.importorskip("profiler")
    import dashboard

    outside = write_run(tmp_path / "outside", name="outside", steps=7)
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text('{"name": "run"}')
    os.symlink(outside / "metrics.jsonl", run / "metrics.jsonl")
    os.symlink("/", run / "profile")
    client = dashboard.create_app([run], refresh_s=0).server.test_client()
    status, page = runs_page(client)
    assert status == 200
    assert f"{run / 'profile'} is a symbolic link to /, outside the run directory" in page
    assert "metrics: no" in page
    status, out = _scalar_tags(client, [0])
    assert status == 200 and out["scalars-tags"]["options"] == []
    assert "is a symbolic link to" in json.dumps(out["scalars-empty"])
    status, out, _ = callback(client, [("profile-body", "children")],
                              [("profile-run", "value", 0), ("data-version", "data", "x")])
    panel = out["profile-body"]["children"]
    assert status == 200 and panel["props"]["className"] == "sleuth-error"
    assert "outside the run directory" in json.dumps(panel)


def _dumps_table(client, *, page=0, size=25, sort_by=None, filter_query=""):
    return callback(client, [("dumps-table", "data"), ("dumps-table", "page_count"),
                             ("dumps-table", "page_current"), ("dumps-detail", "children")],
                    [("dumps-step", "value", 0), ("dumps-table", "page_current", page),
                     ("dumps-table", "page_size", size), ("dumps-table", "sort_by", sort_by or []),
                     ("dumps-table", "filter_query", filter_query)],
                    [("dumps-rank", "value", 0), ("dumps-run", "value", 0)],
                    changed=["dumps-table.page_current"] if page else None)


def test_a_step_of_many_records_goes_out_one_page_at_a_time(tmp_path):
    """A step of 100,000 records went out as one response of tens of MB (every row of the
    table); the server now sends one page, and filters and sorts the whole step itself."""
    pytest.importorskip("tracer")
    import dashboard
    from dashboard_helpers import write_big_export

    run = write_run(tmp_path / "r", name="r", steps=2)
    write_big_export(run, 100_000)
    client = dashboard.create_app([run], refresh_s=0).server.test_client()
    status, out, size = _dumps_table(client)
    assert status == 200 and size < 64 << 10, f"one page of the table was {size:,} bytes"
    table = out["dumps-table"]
    assert len(table["data"]) == 25 and table["page_count"] == 4000
    assert "100000 records · 100 with NaN/Inf" in json.dumps(out["dumps-detail"], ensure_ascii=False)
    # a page far into the step, and a page size no table asks for, stay one bounded page
    status, out, size = _dumps_table(client, page=3999, size=10**9)
    assert status == 200 and size < 256 << 10
    assert len(out["dumps-table"]["data"]) == 500 and out["dumps-table"]["data"][0]["seq"] == 99_500
    # the filter and the sort apply to the whole step, not to the page on screen
    status, out, _ = _dumps_table(client, filter_query="{nonfinite} > 0",
                                  sort_by=[{"column_id": "seq", "direction": "desc"}])
    rows = out["dumps-table"]["data"]
    assert out["dumps-table"]["page_count"] == 4 and rows[0]["seq"] == 99_699
    assert all(r["nonfinite"] > 0 for r in rows) and "100 match the filter" in json.dumps(out["dumps-detail"], ensure_ascii=False)
    status, out, _ = _dumps_table(client, filter_query='{name} contains "layers.12345."')
    assert [r["seq"] for r in out["dumps-table"]["data"]] == list(range(98_760, 98_768))


def test_odd_rank_and_step_in_the_url_are_ignored(tmp_path):
    """`/dumps?rank=abc` made the Dumps page's callback fail (int('abc'))."""
    pytest.importorskip("tracer")
    import dashboard
    from dashboard_helpers import write_big_export

    run = write_run(tmp_path / "r", name="r", steps=2)
    write_big_export(run, 3)
    client = dashboard.create_app([run], refresh_s=0).server.test_client()
    for want in ({"rank": "abc", "step": "-1"}, {"rank": "9" * 5000, "step": "x"}, "junk"):
        status, out, _ = callback(client, [("dumps-rank", "options"), ("dumps-rank", "value"),
                                           ("dumps-summary", "children")],
                                  [("dumps-run", "value", 0), ("data-version", "data", "x")],
                                  [("dumps-rank", "value", None), ("dumps-want", "data", want)])
        assert status == 200 and out["dumps-rank"]["value"] == 0, want


def test_fifo_as_a_summary_file_is_named_not_waited_on(tmp_path):
    """A FIFO as summary/rank0.h5 blocked every page that read the summary (and, holding h5py's
    lock, the others) in HDF5's open. Only regular files are opened: Histograms names the FIFO,
    Scalars still shows metrics.jsonl. In a real process with a timeout, so a hang fails."""
    from dashboard_helpers import write_summary

    run = write_run(tmp_path / "r", name="r", steps=3)
    if not write_summary(run):
        pytest.skip("the summary writer is not available")
    fifo = run / "summary" / "rank0.h5"
    fifo.unlink()
    os.mkfifo(fifo)
    script = ("import sys\nfrom pathlib import Path\nfrom dashboard import _data\n"
              "run = Path(sys.argv[1])\nprint(sorted(_data.scalars(run)))\n"
              "try:\n    _data.histograms(run)\nexcept _data.ReadError as e:\n    print(e)\n")
    try:
        done = subprocess.run([sys.executable, "-c", script, str(run)], cwd=REPO,
                              env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                              text=True, timeout=60)
    except subprocess.TimeoutExpired:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # let the blocked reader go
        pytest.fail("the dashboard waited on a FIFO named summary/rank0.h5")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert "'loss'" in done.stdout and "FIFO" in done.stdout and str(fifo) in done.stdout, \
        done.stdout


def test_one_loss_written_as_text_keeps_the_loss_series(tmp_path):
    """One `"loss": "nan"` (text, not a number) in metrics.jsonl made the loss column text, and
    the whole loss series vanished from Scalars without a word. The series stays, the value is
    read as the number it spells (a gap when it spells none), and a note says so."""
    import dashboard
    from dashboard import _data

    run = write_run(tmp_path / "r", name="r", steps=5)
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 5, "loss": "nan"}) + "\n")
        f.write(json.dumps({"step": 6, "loss": "high"}) + "\n")
    loss = _data.scalars(run)["loss"]
    assert len(loss) == 7 and loss["value"].iloc[:5].notna().all()
    assert loss["value"].iloc[5:].isna().all()
    client = dashboard.create_app([run], refresh_s=0).server.test_client()
    status, out = _scalar_tags(client, [0])
    assert status == 200
    note = json.dumps(out["scalars-empty"])
    assert "loss: 2 value(s) written as text" in note and "'nan' at step 5" in note, note


def test_fifo_as_a_run_file_is_refused_by_the_file_routes_and_scalars(tmp_path):
    """A FIFO as an IR text held the graph reader forever at open; as metrics.jsonl it made the
    metrics vanish without a word. Refused before any byte is read: a note on Scalars,
    IrFormatError for the graph reader; the file routes open without blocking too (404)."""
    import dashboard
    from dashboard import _data
    from irdump import IrFormatError, read_ir

    run = write_run(tmp_path / "r", name="r", steps=3)
    (run / "metrics.jsonl").unlink()
    os.mkfifo(run / "metrics.jsonl")
    (run / "ir").mkdir()
    os.mkfifo(run / "ir" / "00_forward.ir")
    os.mkfifo(run / "ir" / "00_forward.svg")
    done: dict = {}

    def go():
        client = dashboard.create_app([run], refresh_s=0).server.test_client()
        done["file"] = client.get("/_sleuth/file/0/ir/00_forward.ir")
        done["svg"] = client.get("/_sleuth/svg/0/ir/00_forward.svg")
        done["scalars"] = _data.scalars(run)
        done["notes"] = _data.scalar_notes(run)
        try:
            read_ir(run / "ir" / "00_forward.ir")
        except IrFormatError as e:
            done["ir"] = str(e)

    worker = threading.Thread(target=go, daemon=True)
    worker.start()
    worker.join(30)
    if worker.is_alive():
        for name in ("metrics.jsonl", "ir/00_forward.ir", "ir/00_forward.svg"):
            try:
                os.close(os.open(run / name, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        pytest.fail(f"a FIFO in the run held the dashboard (done: {sorted(done)})")
    assert done["file"].status_code in (403, 404) and done["svg"].status_code in (403, 404)
    assert done["scalars"] == {} and any("FIFO" in n for n in done["notes"]), done["notes"]
    assert "FIFO" in done["ir"] and "00_forward.ir" in done["ir"]


@pytest.mark.parametrize("name", ["metrics.rank\u00b9.jsonl", "metrics.rank00.jsonl",
                                  "metrics.rank\u0660.jsonl", "metrics.rank.jsonl"])
def test_metrics_lookalike_is_no_rank_file(tmp_path, name):
    """A superscript digit in a per-rank metrics name (which `str.isdigit` takes and `int`
    refuses) failed the Scalars page with a server error; a leading zero or a Unicode digit was
    read as rank 0's metrics. Only the trainer's names (`metrics.rank{R}.jsonl`) are read."""
    import dashboard
    from dashboard import _data

    run = write_run(tmp_path / "r", name="r", steps=3)
    (run / name).write_text(json.dumps({"step": 0, "loss": 9.0}) + "\n")
    (run / "metrics.rank1.jsonl").write_text(json.dumps({"step": 0, "loss": 1.5}) + "\n")
    assert sorted(t for t in _data.scalars(run) if t.startswith("loss")) == ["loss", "loss [rank 1]"]
    client = dashboard.create_app([run], refresh_s=0).server.test_client()
    status, out = _scalar_tags(client, [0])
    assert status == 200 and "loss [rank 1]" in json.dumps(out)
