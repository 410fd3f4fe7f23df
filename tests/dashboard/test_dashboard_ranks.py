"""The Diff page over many ranks: with no rank chosen and more than one rank, a rank x step grid
coloured by status, the earliest divergence across ranks named and outlined, a rank on one side
only named; a click on a cell opens that rank and step (in a real headless Chromium)."""
from __future__ import annotations

import time

import pytest

from dashboard._context import Context
from dashboard._page_diff import body, cell_of
from dashboard._runs import load_runs
from dashboard_helpers import free_port, wait_idle
from tests.dashboard.test_dashboard_diff import _texts
from tests.tracer.analysis.test_diff_ranks import write_run


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rankpage")
    a = write_run(root / "a", 4)
    b = write_run(root / "b", 4, bump={(1, 3, 0): 1.0, (2, 2, 1): 0.5})
    c = write_run(root / "c", 3)
    return a, b, c


def _grid(children):
    graphs = [c for c in children if getattr(c, "id", None) == "diff-rank-grid"]
    assert graphs, "no rank grid"
    return graphs[0].figure


def test_grid_colours_each_rank_and_step_and_outlines_the_earliest(runs):
    ctx = Context(runs=load_runs(list(runs[:2])))
    out = body(ctx, 0, 1, None, None, None, None)
    texts = _texts(out)
    assert ("diff-status", "status: diverged") in texts
    first = next(t for i, t in texts if i == "diff-first")
    assert first.startswith("earliest divergence: rank 2 step 2 · name: layers.1.forward.0.output.0")
    assert "source: model.py:11" in first
    fig = _grid(out)
    heat = fig.data[0]
    assert list(heat.y) == [0, 1, 2, 3] and list(heat.x) == [1, 2, 3]
    assert [list(row) for row in heat.text] == [
        ["same", "same", "same"], ["same", "same", "diverged"],
        ["same", "diverged", "same"], ["same", "same", "same"]]
    box = fig.layout.shapes[0]
    assert (box.x0, box.x1, box.y0, box.y1) == (0.5, 1.5, 1.5, 2.5)  # step 2, rank 2 (indices)
    # one rank chosen: the one-pair page, with its records
    one = _texts(body(ctx, 0, 1, 2, None, None, None))
    assert ("diff-status", "status: diverged") in one
    assert not any(i == "diff-first" and t.startswith("earliest") for i, t in one)


def test_a_rank_on_one_side_is_named_never_same(runs):
    ctx = Context(runs=load_runs([runs[0], runs[2]]))
    texts = _texts(body(ctx, 0, 1, None, None, None, None))
    assert ("diff-status", "status: diverged") in texts
    assert any(i == "diff-problems" and "rank(s) only in A: 3" in t for i, t in texts)


def test_a_click_opens_that_rank_and_step():
    from dash.exceptions import PreventUpdate

    assert cell_of({"points": [{"x": 3, "y": 1, "z": 1}]}) == (1, 3)
    with pytest.raises(PreventUpdate):
        cell_of(None)


@pytest.mark.slow
@pytest.mark.browser
def test_grid_in_the_browser(browser, runs):
    import dashboard
    from selenium.webdriver.common.by import By

    app = dashboard.create_app(list(runs[:2]), refresh_s=60.0)
    handle = dashboard.serve(app, port=free_port(), background=True)
    try:
        browser.get(handle.url + "/diff?a=0&b=1")
        wait_idle(browser)
        cells = _wait(lambda: browser.execute_script(
            "var g = document.querySelector('#diff-rank-grid .js-plotly-plot');"
            "return g && g._fullData && g._fullData.length ? g._fullData[0].text : null;"))
        assert cells[2][1] == "diverged" and cells[1][2] == "diverged"
        first = browser.find_element(By.ID, "diff-first").text
        assert first.startswith("earliest divergence: rank 2 step 2")
        # what a click on the cell (step 3, rank 1) sends; the page opens that rank and step
        browser.execute_script(
            "var g = document.querySelector('#diff-rank-grid .js-plotly-plot');"
            "g.emit('plotly_click', {points: [{curveNumber: 0, pointNumber: [1, 2], x: 3, y: 1,"
            " z: 1, data: g.data[0], fullData: g._fullData[0]}]});")
        graph = _wait(lambda: browser.find_elements(By.ID, "diff-graph"))
        assert graph
        assert browser.find_element(By.ID, "diff-rank").get_attribute("value") == "1"
        assert browser.find_element(By.ID, "diff-step").get_attribute("value") == "3"
        first = _wait(lambda: (e := browser.find_elements(By.ID, "diff-first")) and e[0].text)
        assert first.startswith("first divergence: name: layers.0.forward.0.output.0")
    finally:
        handle.close()


def _wait(fn, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = fn()
        except Exception:  # noqa: BLE001 - an element replaced while read: try again
            value = None
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.2)
