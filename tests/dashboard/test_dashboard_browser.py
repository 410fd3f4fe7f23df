"""The dashboard in a real headless Chromium: every page loads with no error on the page or in
the browser console, the main interactions work, and a screenshot of each page is kept under
artifacts/screenshots/."""
from __future__ import annotations

import time
import urllib.parse
import urllib.request

import pytest

from dashboard_helpers import free_port, screenshot, severe_logs, wait_for, wait_idle, write_tool_data

pytestmark = pytest.mark.browser

PAGES = ("/", "/scalars", "/histograms", "/profile", "/dumps", "/diff", "/graph")


@pytest.fixture(scope="module")
def tools(runs_dir) -> dict[str, dict[str, str]]:
    """Both runs also get a dump, a profile, a summary and IR graphs from the tools' public
    writers; `lr-up` feeds a NaN from step 2 on, so its dump has NaN rows and the diff diverges."""
    return {"base": write_tool_data(runs_dir / "base"),
            "lr-up": write_tool_data(runs_dir / "lr-up", nan_step=2)}


def need(tools, kind: str) -> None:
    for run, done in tools.items():
        if done.get(kind) != "ok":
            pytest.skip(f"no {kind} data for run {run}: {done.get(kind)}")


@pytest.fixture(scope="module")
def server(runs_dir, tools):
    import dashboard

    empty = runs_dir / "empty"  # a run that has only its run.json: every page shows its empty state
    empty.mkdir(exist_ok=True)
    (empty / "run.json").write_text('{"name": "empty", "world_size": 1}')
    app = dashboard.create_app([runs_dir / "base", runs_dir / "lr-up", empty], refresh_s=1.0)
    handle = dashboard.serve(app, port=free_port(), background=True)
    handle.runs = [runs_dir / "base", runs_dir / "lr-up"]
    try:
        yield handle
    finally:
        handle.close()


def open_page(browser, server, path: str):
    from selenium.webdriver.common.by import By

    browser.get(server.url + path)
    wait_idle(browser)
    assert not browser.find_elements(By.CSS_SELECTOR, ".dash-fe-error__title, .dash-error-card"), path
    body = browser.find_element(By.TAG_NAME, "body").text
    for bad in ("Traceback", "Internal Server Error", "Callback error"):
        assert bad not in body, f"{path}: {bad}"
    return browser


@pytest.mark.slow
@pytest.mark.parametrize("path", PAGES)
def test_page_loads_without_errors(browser, server, path):
    severe_logs(browser)  # drop what earlier tests left
    open_page(browser, server, path)
    name = "runs" if path == "/" else path.strip("/")
    screenshot(browser, name)
    assert severe_logs(browser) == []


def test_runs_page_lists_runs_and_their_data(browser, server):
    from selenium.webdriver.common.by import By

    open_page(browser, server, "/")
    cards = browser.find_elements(By.CSS_SELECTOR, ".sleuth-card")
    assert [c.find_element(By.TAG_NAME, "h3").text for c in cards] == ["base", "lr-up", "empty"]
    text = cards[0].text
    assert "world size" in text and "metrics: yes" in text and "dump: yes" in text and "checkpoints: no" in text


def set_input(browser, css: str, text: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    box = browser.find_element(By.CSS_SELECTOR, css)
    box.click()
    box.send_keys(Keys.CONTROL, "a")
    box.send_keys(text, Keys.ENTER)
    box.send_keys(Keys.TAB)
    time.sleep(0.3)
    wait_idle(browser)


def text_of(browser, element_id: str, timeout: float = 15.0) -> str:
    from selenium.webdriver.common.by import By

    return wait_for(lambda: (e := browser.find_elements(By.ID, element_id)) and e[0].text, timeout) or ""


def _traces(browser, graph_id: str) -> list[dict]:
    return browser.execute_script(
        f"var g = document.querySelector('#{graph_id} .js-plotly-plot');"
        "return g && g._fullData ? g._fullData.map(t => ({name: t.name, n: t.x.length, opacity: t.opacity, "
        "x0: t.x[0], x1: t.x[t.x.length - 1]})) : null;")


@pytest.mark.slow
def test_scalars_overlay_smoothing_and_zoom(browser, server):
    from selenium.webdriver.common.by import By

    open_page(browser, server, "/scalars")
    traces = wait_for(lambda: _traces(browser, "scalars-graph"))
    # loss, lr, grad_norm by default, two runs each
    assert len(traces) == 6 and {t["name"] for t in traces} == {"base", "lr-up"}
    assert all(t["n"] == 400 for t in traces)  # 400 steps: under the display cap, all drawn
    # smoothing: the End key moves the slider to 0.99; the raw line stays, faint, under the smooth one
    from selenium.webdriver.common.keys import Keys

    thumb = browser.find_element(By.CSS_SELECTOR, "#scalars-smoothing [role=slider]")
    thumb.click()
    thumb.send_keys(Keys.END)
    time.sleep(0.5)
    wait_idle(browser)
    assert thumb.get_attribute("aria-valuenow") == "0.99"
    traces = wait_for(lambda: (t := _traces(browser, "scalars-graph")) and len(t) == 12 and t)
    assert len(traces) == 12 and any(t["opacity"] == 0.25 for t in traces)
    # zoom: a relayout to steps 100..120 re-reads that window at full resolution
    browser.execute_script("Plotly.relayout(document.querySelector('#scalars-graph .js-plotly-plot'),"
                           " {'xaxis.range[0]': 100, 'xaxis.range[1]': 120});")
    time.sleep(0.3)
    wait_idle(browser)
    traces = wait_for(lambda: (t := _traces(browser, "scalars-graph")) and t[0]["x0"] >= 99 and t)
    assert all(99 <= t["x0"] and t["x1"] <= 121 for t in traces), traces
    screenshot(browser, "scalars-zoomed")
    assert severe_logs(browser) == []


@pytest.mark.slow
def test_scalars_slow_first_draw_still_draws(browser, runs_dir, monkeypatch):
    """A slow server: the graph's first autosize fires while the first draw is still running,
    and Dash's renderer drops that draw. The autosize call must then draw the figure: answering
    no_update would leave "loading" on the page for good."""
    import dashboard
    import dashboard._page_scalars as page

    draw = page.scalars_figure
    calls: list[float] = []

    def slow_first(*args, **kwargs):
        calls.append(time.monotonic())
        if len(calls) == 1:
            time.sleep(3.0)
        return draw(*args, **kwargs)

    monkeypatch.setattr(page, "scalars_figure", slow_first)
    app = dashboard.create_app([runs_dir / "base", runs_dir / "lr-up"], refresh_s=0)
    handle = dashboard.serve(app, port=free_port(), background=True)
    try:
        open_page(browser, handle, "/scalars")
        traces = wait_for(lambda: _traces(browser, "scalars-graph"), timeout=20.0)
        assert traces is not None and len(traces) == 6, (len(calls), traces)
    finally:
        handle.close()


@pytest.mark.slow
def test_scalars_refresh_while_training(browser, server, runs_dir):
    import json

    from selenium.webdriver.common.by import By

    open_page(browser, server, "/scalars?run=0")
    ok = wait_for(lambda: (t := _traces(browser, "scalars-graph")) and t[0]["x1"] == 399)
    assert ok, (_traces(browser, "scalars-graph"), browser.get_log("browser"),
                browser.find_element(By.ID, "page").text[:500])
    with open(runs_dir / "base" / "metrics.jsonl", "a") as f:  # the run trains on
        for s in range(400, 450):
            f.write(json.dumps({"step": s, "loss": 1.0, "lr": 1e-3, "grad_norm": 1.0,
                                "tokens_per_s": 1.0, "wall_time": 1_700_000_100.0 + s}) + "\n")
    assert wait_for(lambda: (t := _traces(browser, "scalars-graph")) and t[0]["x1"] == 449, timeout=20)


@pytest.mark.slow
def test_histograms_heatmap(browser, server, tools):
    need(tools, "summary")
    open_page(browser, server, "/histograms?run=0")
    kinds = wait_for(lambda: browser.execute_script(
        "var g = document.querySelector('#hist-graph .js-plotly-plot');"
        "return g && g._fullData ? g._fullData.map(t => t.type + ':' + t.x.length) : null;"))
    assert kinds and kinds[0].startswith("heatmap:") and kinds[0] != "heatmap:0"
    screenshot(browser, "histograms")
    assert severe_logs(browser) == []


@pytest.mark.slow
def test_profile_panels(browser, server, tools):
    from selenium.webdriver.common.by import By

    need(tools, "profile")
    open_page(browser, server, "/profile?run=0")
    n = wait_for(lambda: browser.execute_script(
        "var g = document.querySelector('#profile-ops .js-plotly-plot');"
        "return g && g._fullData && g._fullData.length ? g._fullData[0].y.length : 0;"))
    assert n > 0
    assert browser.find_elements(By.CSS_SELECTOR, "#profile-steps .js-plotly-plot")
    summary = text_of(browser, "profile-summary")  # as `sleuth profile` prints it
    assert "1 rank(s), 1 window(s)" in summary and " ms " in summary and "MFU" in summary
    assert "step_time_s" not in summary and "e-0" not in summary.split("MFU")[0]
    screenshot(browser, "profile")
    assert severe_logs(browser) == []


@pytest.mark.slow
def test_dumps_table_highlight_filter_and_tensor(browser, server, tools):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    import tracer

    need(tools, "dump")
    dump = tracer.open_dump(server.runs[1])
    bad = [s for s in dump.steps(0) if (dump.stats(0, s)[["nan", "posinf", "neginf"]].to_numpy() > 0).any()]
    assert bad, "fixture run lr-up should have NaN records"
    open_page(browser, server, f"/dumps?run=1&rank=0&step={bad[0]}")
    rows = wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "#dumps-table tr td[data-dash-column='name']"))
    assert rows
    note = text_of(browser, "dumps-detail")
    assert "with NaN/Inf" in note and not note.startswith("0 records")
    # filter the NaN/Inf rows: all of them are highlighted red
    nonfinite = browser.find_element(By.CSS_SELECTOR, "#dumps-table th.dash-filter[data-dash-column='nonfinite'] input")
    nonfinite.send_keys("> 0", Keys.ENTER)
    time.sleep(0.5)
    red = browser.execute_script(
        "return Array.from(document.querySelectorAll(\"#dumps-table td[data-dash-column='nonfinite']\"))"
        ".map(td => getComputedStyle(td).backgroundColor);")
    assert red and all(c in ("rgb(253, 224, 220)", "rgb(251, 196, 189)") for c in red), red
    screenshot(browser, "dumps")
    nonfinite.send_keys(Keys.CONTROL, "a")
    nonfinite.send_keys(Keys.DELETE, Keys.ENTER)
    # filter by name
    box = browser.find_element(By.CSS_SELECTOR, "#dumps-table th.dash-filter[data-dash-column='name'] input")
    box.send_keys("aten.addmm", Keys.ENTER)
    time.sleep(0.5)
    names = [td.text for td in browser.find_elements(By.CSS_SELECTOR, "#dumps-table td[data-dash-column='name']")]
    assert names and all("aten.addmm" in n for n in names), names
    # click a record: its tensor's histogram and a link to the graph
    browser.find_element(By.CSS_SELECTOR, "#dumps-table td[data-dash-column='name']").click()
    assert wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "#dumps-tensor .js-plotly-plot"))
    # and its headroom over the dumped steps
    title = wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "#dumps-headroom .gtitle"))
    assert "over the steps" in title[0].text and "aten.addmm" in title[0].text
    link = wait_for(lambda: (e := browser.find_elements(By.ID, "dumps-graph-link")) and e[0].get_attribute("href"))
    assert "/graph?" in link and "aten.addmm.forward." in urllib.parse.unquote(link)
    screenshot(browser, "dumps-tensor")
    assert severe_logs(browser) == []


@pytest.mark.slow
def test_diff_marks_first_divergence(browser, server, tools):
    from selenium.webdriver.common.by import By

    need(tools, "dump")
    open_page(browser, server, "/diff?a=0&b=1")
    status = wait_for(lambda: (e := browser.find_elements(By.ID, "diff-status")) and e[0].text, timeout=30)
    assert status and "diverged" in status
    first = text_of(browser, "diff-first")
    assert "<root>.forward.0.input.0" in first  # the NaN entered with the input at step 2
    shapes = wait_for(lambda: browser.execute_script(
        "var g = document.querySelector('#diff-graph .js-plotly-plot');"
        "return g && g.layout ? (g.layout.shapes || []).length : 0;"))
    assert shapes >= 1
    # the "first divergence" label lies wholly above the first row's title, never across it
    boxes = browser.execute_script(
        "var out = {}; document.querySelectorAll('#diff-graph .annotation-text').forEach("
        "function (t) { var r = t.getBoundingClientRect(); out[t.textContent] = [r.top, r.bottom]; });"
        "return out;")
    assert boxes["first divergence"][1] <= boxes["max_abs_err"][0] + 1, boxes
    assert browser.find_elements(By.CSS_SELECTOR, "#diff-table td[data-dash-column='name']")
    screenshot(browser, "diff")
    assert severe_logs(browser) == []


def test_graph_search_highlights_node(browser, server, tools):
    from selenium.webdriver.common.by import By

    need(tools, "ir")
    open_page(browser, server, "/graph?run=0&stage=3&node=aten.addmm")
    items = wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "#graph-match-list li"))
    assert items and all("aten.addmm" in li.text for li in items)
    src = wait_for(lambda: (e := browser.find_elements(By.ID, "graph-svg")) and e[0].get_attribute("src"))
    assert "highlight=aten.addmm" in src
    svg = urllib.request.urlopen(src).read().decode()
    assert 'class="node sleuth-hit"' in svg
    time.sleep(0.5)
    screenshot(browser, "graph")
    assert severe_logs(browser) == []


@pytest.mark.parametrize("path, message", [
    ("/scalars?run=2", "logged no scalars"),
    ("/histograms?run=2", "no summary histograms: run with --summary"),
    ("/profile?run=2", "no profile: run with --profile"),
    ("/dumps?run=2", "no tensor dump: run with --dump"),
    ("/diff?a=2&b=0", "has no tensor dump to diff"),
    ("/graph?run=2", "no IR graphs: run with --save-graphs"),
])
def test_empty_states(browser, server, path, message):
    from selenium.webdriver.common.by import By

    severe_logs(browser)
    open_page(browser, server, path)
    texts = wait_for(lambda: [e.text for e in browser.find_elements(By.CSS_SELECTOR, ".sleuth-empty")
                              if message in e.text])
    assert texts, f"{path}: no empty state saying {message!r}"
    if path.startswith("/profile"):
        screenshot(browser, "empty-profile")
    assert severe_logs(browser) == []


@pytest.mark.slow
def test_dumps_page_reads_a_parquet_export(browser, runs_dir, tools):
    """A run folder holding only the Parquet export of a dump (`sleuth dump export`): the Dumps
    page reads its statistics, NaN rows and headroom, and says that tensors are not there."""
    from selenium.webdriver.common.by import By

    import dashboard
    import tracer
    from tracer.storage import export_parquet

    need(tools, "dump")
    exp = runs_dir / "exported"
    exp.mkdir()
    (exp / "run.json").write_text('{"name": "exported", "world_size": 1}')
    export_parquet(runs_dir / "lr-up", exp / "export.parquet")
    dump = tracer.open_dump(runs_dir / "lr-up")
    bad = [s for s in dump.steps(0)
           if (dump.stats(0, s)[["nan", "posinf", "neginf"]].to_numpy() > 0).any()]
    n = len(dump.stats(0, bad[0]))
    handle = dashboard.serve(dashboard.create_app([exp], refresh_s=1.0), port=free_port(),
                             background=True)
    try:
        open_page(browser, handle, f"/dumps?run=0&rank=0&step={bad[0]}")
        note = wait_for(lambda: browser.find_elements(By.ID, "dumps-export-note"))
        assert "Parquet export" in note[0].text and "no tensor bytes" in note[0].text
        assert wait_for(lambda: text_of(browser, "dumps-detail").startswith(f"{n} records"))
        assert "with NaN/Inf" in text_of(browser, "dumps-detail")
        browser.find_element(By.CSS_SELECTOR, "#dumps-table td[data-dash-column='name']").click()
        title = wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "#dumps-headroom .gtitle"))
        assert "over the steps" in title[0].text
        assert "statistics only" in text_of(browser, "dumps-detail")
        screenshot(browser, "dumps-export")
        assert severe_logs(browser) == []
    finally:
        handle.close()


@pytest.mark.slow
def test_dumps_table_pages_on_the_server(browser, tmp_path):
    """A step of 100,000 records: the page receives one page of rows at a time (it received the
    whole step, tens of MB, before), the pager counts the step's pages, and the next page, the
    filter and the sort are answered by the server over the whole step."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    pytest.importorskip("tracer")
    import dashboard
    from dashboard_helpers import write_big_export, write_run

    run = write_run(tmp_path / "big", name="big", steps=2)
    write_big_export(run, 100_000)
    handle = dashboard.serve(dashboard.create_app([run], refresh_s=0), port=free_port(), background=True)
    severe_logs(browser)
    try:
        open_page(browser, handle, "/dumps?run=0&rank=0&step=0")

        def seqs():
            return [int(td.text) for td in browser.find_elements(
                By.CSS_SELECTOR, "#dumps-table td[data-dash-column='seq']")]

        assert wait_for(lambda: seqs() == list(range(25)), timeout=30), seqs()
        sizes = browser.execute_script(
            "return performance.getEntriesByType('resource').filter(e => e.name.includes('_dash-update-component'))"
            ".map(e => e.encodedBodySize);")
        assert sizes and max(sizes) < 256 << 10, f"a callback response of {max(sizes):,} bytes"
        assert "4000" in browser.find_element(By.CSS_SELECTOR, "#dumps-table .previous-next-container").text
        browser.find_element(By.CSS_SELECTOR, "#dumps-table button.next-page").click()
        assert wait_for(lambda: seqs() == list(range(25, 50))), seqs()
        box = browser.find_element(By.CSS_SELECTOR, "#dumps-table th.dash-filter[data-dash-column='nonfinite'] input")
        box.send_keys("> 0", Keys.ENTER)
        assert wait_for(lambda: seqs()[:3] == [996, 1993, 2990]), seqs()
        assert "100 match the filter" in text_of(browser, "dumps-detail")
        screenshot(browser, "dumps-paged")
        assert severe_logs(browser) == []
    finally:
        handle.close()
