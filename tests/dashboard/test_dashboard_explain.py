"""The Diff page's explain panel in a real headless Chromium: two op-level tensor dumps of a
Hugging Face Llama built from a config, one with a wrong RMSNorm epsilon; a click on the button
shows the verdict (bug, the op named), the chain figure with the blamed op marked, and a link to
its graph node when the run has graphs."""
from __future__ import annotations

import pytest

from dashboard_helpers import free_port, screenshot, severe_logs
from test_dashboard_browser import open_page, text_of, wait_for

pytestmark = pytest.mark.browser


@pytest.mark.slow
def test_the_explain_panel_names_the_bug_and_draws_the_chain(browser, tmp_path):
    from selenium.webdriver.common.by import By

    import dashboard
    pytest.importorskip("transformers")
    from tests.tracer.analysis.test_explain import _dump_llama

    a, b = _dump_llama(tmp_path / "ref"), _dump_llama(tmp_path / "eps", eps=1e-2)
    handle = dashboard.serve(dashboard.create_app([a, b], refresh_s=1.0), port=free_port(),
                             background=True)
    try:
        open_page(browser, handle, "/diff?a=0&b=1")
        button = wait_for(lambda: browser.find_elements(By.ID, "diff-explain-btn"))
        assert button, "the diff diverges at an op record: the explain button is shown"
        button[0].click()
        verdict = text_of(browser, "diff-explain-verdict", timeout=60)
        assert verdict.startswith("bug: op aten.add") and "input_layernorm" in verdict
        traces = wait_for(lambda: browser.execute_script(
            "var g = document.querySelector('#diff-explain-chain .js-plotly-plot');"
            "return g && g._fullData ? g._fullData.map(t => t.name) : null;"))
        assert traces and "blamed: a bug" in traces and any("introduced" in t for t in traces)
        screenshot(browser, "diff-explain")
        assert severe_logs(browser) == []
    finally:
        handle.close()


@pytest.mark.slow
def test_a_diff_at_a_module_record_has_no_explain_button():
    from dashboard._explain_panel import panel

    assert panel({"name": "layers.0.forward.0.output.0", "op": ""}) is None
    # a mix dump: explain judges a module record by the op records around it
    assert panel({"name": "layers.0.forward.0.output.0", "op": ""}, op_records=True) is not None
    assert panel(None) is None
    assert panel({"name": "m::aten.mm.forward.0.output.0", "op": "aten.mm"}) is not None
