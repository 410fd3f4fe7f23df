"""The Profile page's comparison of two runs at the data level: what `compare_data` and
`compare_panel` show for two GPU profiles (B syncs the host each step) and for CPU profiles,
the URL that opens it, and the trace links, fetched from the dashboard's server."""
from __future__ import annotations

import pytest

from dashboard_helpers import wait_for, write_gpu_profile, write_run


@pytest.fixture(scope="module")
def gpu_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pcompare")
    a = write_gpu_profile(write_run(root / "a", name="a", steps=5))
    b = write_gpu_profile(write_run(root / "b", name="b", steps=5), sync_us=400)
    return a, b


def _ids(component) -> dict:
    """Every component with an id under `component`, by id."""
    out, stack = {}, [component]
    while stack:
        c = stack.pop()
        if getattr(c, "id", None):
            out[c.id] = c
        kids = getattr(c, "children", None)
        stack.extend(kids if isinstance(kids, list) else [kids] if kids is not None else [])
    return out


def test_compare_data_ranks_the_sync_and_shows_gpu_time(gpu_runs):
    from dashboard import _data
    from dashboard._profile_compare import compare_data

    d = compare_data(_data.profile_diff(*gpu_runs))
    assert d["verdict"] == "slower" and d["exit_code"] == 1
    assert d["headline"].startswith("B is slower: step time 1 ms -> 1.4 ms")
    top = d["ops"][0]
    assert top["name"] == "aten::item" and top["side"] == "B only" and top["delta_us"] == 500
    assert {"input_shapes_a", "input_shapes_b"} <= set(top)  # rows of two shapes tell apart
    assert d["causes"][0].startswith("op aten::item in fc: +500 us a step, calls 0 -> 1 a step; "
                                    "in B only")
    phases = {r["phase"]: r for r in d["breakdown"]}
    assert phases["forward"]["a_us"] == 300 and phases["forward"]["b_us"] == 700
    gpu = {r["figure"]: r for r in d["gpu"]}
    # A idles in data 0-100, waits on the all-reduce 600-700, and on the host 400-450 and
    # 700-1000; B's sync adds 400 us of host-bound idle
    assert gpu["idle: data-bound"]["a"] == 100 and gpu["idle: waiting on communication"]["a"] == 100
    assert gpu["idle: host-bound"]["a"] == 350 and gpu["idle: host-bound"]["b"] == 750
    assert gpu["overlap share of communication"]["a"] == 0.5
    assert d["kernels"][0]["module"] == "fc" and d["kernels"][0]["kernel_a_us"] == 300


def test_compare_two_ranks_names_the_straggler(tmp_path):
    """Two DDP ranks of a torch-shaped CUDA trace (tests/profiler/data), rank 1 of B a
    straggler with an .item() sync: each rank's GPU figures, and which rank got slower."""
    from pathlib import Path

    from dashboard import _data
    from dashboard._profile_compare import compare_data, compare_panel

    data = Path(__file__).resolve().parents[1] / "profiler" / "data"
    runs = {}
    for run, rank1 in (("a", "base_rank1"), ("b", "slow_rank1")):
        for rank, name in ((0, "base_rank0"), (1, rank1)):
            d = tmp_path / run / "profile" / f"rank{rank}"
            d.mkdir(parents=True)
            (d / "window0.trace.json").write_text((data / f"{name}.trace.json").read_text())
        runs[run] = tmp_path / run
    diff = _data.profile_diff(runs["a"], runs["b"])
    d = compare_data(diff)
    ranks = {r["rank"]: r for r in d["gpu_ranks"]}
    assert ranks[0]["host_a"] == ranks[0]["host_b"] == 270
    assert ranks[1]["host_b"] == 495 and ranks[1]["comm_b"] == 170 and ranks[1]["overlap_b"] == 0
    assert "slowest rank in B: 1; GPU idle 725 us a step" in d["rank_lines"][1]
    assert d["rank_lines"][2].startswith("the rank that got slower the most: 1")
    ids = _ids(compare_panel(diff, 0, 1, (runs["a"], runs["b"]), ("a", "b")))
    assert "profile-compare-gpu-ranks" in ids and "profile-compare-rank-lines" in ids


@pytest.mark.slow
def test_cpu_profiles_compare_without_gpu_figures(tmp_path):
    from dashboard import _data
    from dashboard._profile_compare import compare_data, compare_panel
    from dashboard_helpers import write_tool_data

    a, b = tmp_path / "a", tmp_path / "b"
    for r in (a, b):
        write_run(r, name=r.name, steps=5)
        done = write_tool_data(r)
        if done.get("profile") != "ok":
            pytest.skip(f"no profile: {done.get('profile')}")
    diff = _data.profile_diff(a, b)
    d = compare_data(diff)
    assert d["gpu"] == [] and any("CPU trace: no GPU figures on either side" in n for n in d["notes"])
    assert d["ops"] and d["breakdown"]
    ids = _ids(compare_panel(diff, 0, 1, (a, b), ("a", "b")))
    assert "profile-compare-ops" in ids and "profile-compare-gpu" not in ids
    assert "CPU trace: no GPU figures" in str(ids["profile-notes"].children)


def test_url_opens_the_comparison_and_the_trace_links_serve_each_trace(gpu_runs):
    import dashboard
    from dashboard import _data
    from dashboard._context import Context, query
    from dashboard._page_profile import layout
    from dashboard._profile_compare import compare_panel
    from dashboard._runs import load_runs

    a, b = gpu_runs
    page = _ids(layout(Context(runs=load_runs([a, b])), query("?run=0&b=1")))
    assert page["profile-run"].value == 0 and page["profile-b"].value == 1
    app = dashboard.create_app([a, b])
    panel = _ids(compare_panel(_data.profile_diff(a, b), 0, 1, (a, b), ("a", "b")))
    links = panel["profile-compare-traces"].children[1:]
    assert [x.children for x in links] == ["A: window0.trace.json", "B: window0.trace.json"]
    client = app.server.test_client()
    for link, root in zip(links, (a, b)):
        r = client.get(link.href)
        assert r.status_code == 200
        assert r.data == (root / "profile" / "rank0" / "window0.trace.json").read_bytes()


# ---- in a real headless Chromium ----------------------------------------------------------------


@pytest.fixture(scope="module")
def compare_server(gpu_runs, tmp_path_factory):
    """Runs 0 and 1: the GPU profiles; runs 2 and 3: two CPU profiles of a real tiny model."""
    import dashboard
    from dashboard_helpers import free_port, write_tool_data

    root = tmp_path_factory.mktemp("pcompare-cpu")
    cpu = []
    for name in ("cpu-a", "cpu-b"):
        done = write_tool_data(write_run(root / name, name=name, steps=5))
        cpu.append(root / name if done.get("profile") == "ok" else None)
    app = dashboard.create_app([*gpu_runs, *[c for c in cpu if c]], refresh_s=30.0)
    handle = dashboard.serve(app, port=free_port(), background=True)
    handle.cpu_ok = all(cpu)
    try:
        yield handle
    finally:
        handle.close()


def _open(browser, url: str) -> None:
    from selenium.webdriver.common.by import By

    from dashboard_helpers import wait_idle

    browser.get(url)
    wait_idle(browser)
    body = browser.find_element(By.TAG_NAME, "body").text
    for bad in ("Traceback", "Internal Server Error", "Callback error"):
        assert bad not in body


@pytest.mark.slow
@pytest.mark.browser
def test_browser_choose_run_b_and_read_why_it_is_slower(browser, compare_server):
    import urllib.request

    from selenium.webdriver.common.by import By

    from dashboard_helpers import screenshot, severe_logs, wait_idle

    severe_logs(browser)
    _open(browser, compare_server.url + "/profile?run=0")
    assert not browser.find_elements(By.ID, "profile-verdict")  # one run: no comparison
    browser.find_element(By.ID, "profile-b").click()
    option = wait_for(lambda: [o for o in browser.find_elements(By.CSS_SELECTOR, "[role='option']")
                            if o.text.endswith("/b")])  # labels: parent/name
    option[0].click()
    wait_idle(browser)
    verdict = wait_for(lambda: (e := browser.find_elements(By.ID, "profile-verdict")) and e[0].text,
                       timeout=20)
    assert verdict.startswith("B is slower: step time 1 ms -> 1.4 ms")
    causes = browser.find_element(By.ID, "profile-causes").text
    assert "op aten::item in fc: +500 us a step" in causes and "in B only" in causes
    first = wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "#profile-compare-ops tbody tr"))
    row = [r.text for r in first if "aten::item" in r.text]
    assert row and "B only" in row[0]
    gpu = browser.find_element(By.ID, "profile-compare-gpu").text
    assert "idle: host-bound" in gpu and "communication overlapped by compute" in gpu
    assert "fc" in browser.find_element(By.ID, "profile-compare-kernels").text
    bars = wait_for(lambda: browser.execute_script(
        "var g = document.querySelector('#profile-compare-breakdown .js-plotly-plot');"
        "return g && g._fullData ? g._fullData.map(t => t.name) : null;"))
    assert [n.split(": ")[0] for n in bars] == ["A", "B"] and bars[1].endswith("/b")
    links = browser.find_elements(By.CSS_SELECTOR, "#profile-compare-traces a")
    assert [a.text for a in links] == ["A: window0.trace.json", "B: window0.trace.json"]
    for a in links:
        with urllib.request.urlopen(a.get_attribute("href"), timeout=10) as r:
            assert r.status == 200 and b"traceEvents" in r.read()
    screenshot(browser, "profile-compare")
    assert severe_logs(browser) == []


@pytest.mark.slow
@pytest.mark.browser
def test_browser_compare_cpu_profiles_from_the_url(browser, compare_server):
    from selenium.webdriver.common.by import By

    from dashboard_helpers import severe_logs

    if not compare_server.cpu_ok:
        pytest.skip("the tiny model's CPU profiles could not be written")
    severe_logs(browser)
    _open(browser, compare_server.url + "/profile?run=2&b=3")
    verdict = wait_for(lambda: (e := browser.find_elements(By.ID, "profile-verdict")) and e[0].text,
                       timeout=20)
    assert "step time" in verdict and "noise floor" in verdict
    notes = browser.find_element(By.ID, "profile-notes").text
    assert "CPU trace: no GPU figures on either side" in notes
    assert not browser.find_elements(By.ID, "profile-compare-gpu")
    assert wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "#profile-compare-ops tbody tr"))
    # the one-run panels still follow, for run A
    assert wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "#profile-ops .js-plotly-plot"))
    assert "CPU trace: no GPU figures" in browser.find_element(By.ID, "profile-summary").text
    assert severe_logs(browser) == []
