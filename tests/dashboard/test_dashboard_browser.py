"""The dashboard in a real headless Chromium: every page loads with no error on the page or in
the browser console, the main interactions work, and a screenshot of each page is kept under
artifacts/screenshots/."""
from __future__ import annotations

import time
import urllib.request

import pytest

from conftest import free_port, screenshot, severe_logs, wait_idle, write_summary

pytestmark = pytest.mark.browser

PAGES = ("/", "/scalars", "/histograms", "/profile", "/dumps", "/diff", "/graph")


@pytest.fixture(scope="module")
def server(runs_dir):
    import dashboard

    app = dashboard.create_app([runs_dir / "base", runs_dir / "lr-up"], refresh_s=1.0)
    handle = dashboard.serve(app, port=free_port(), background=True)
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
    assert [c.find_element(By.TAG_NAME, "h3").text for c in cards] == ["base", "lr-up"]
    text = cards[0].text
    assert "world size" in text and "metrics: yes" in text and "dump: no" in text


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


def wait_for(fn, timeout: float = 15.0):
    """Poll `fn()` until it returns something truthy (Plotly draws after Dash settles)."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


def _traces(browser, graph_id: str) -> list[dict]:
    return browser.execute_script(
        f"var g = document.querySelector('#{graph_id} .js-plotly-plot');"
        "return g && g._fullData ? g._fullData.map(t => ({name: t.name, n: t.x.length, opacity: t.opacity, "
        "x0: t.x[0], x1: t.x[t.x.length - 1]})) : null;")


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
