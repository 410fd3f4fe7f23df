"""Dashboard test fixtures: two run directories and one headless Chromium per test module."""
from __future__ import annotations

from pathlib import Path

import pytest

from dashboard_helpers import have_chromium, make_driver, write_run


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("runs")
    write_run(base / "base", name="base", lr=1e-3)
    write_run(base / "lr-up", name="lr-up", lr=3e-3, nan_at=350)
    return base


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    reason = have_chromium()
    if reason:
        pytest.skip(reason)
    driver = make_driver(tmp_path_factory.mktemp("chrome-profile"))
    try:
        yield driver
    finally:
        driver.quit()
