"""Dashboard load benchmark: a run with 1,000,000 steps of 5 series.

Prints ONE JSON object:
- read_metrics_s: first parse of metrics.jsonl (cached afterwards; a training run's new lines
  are parsed incrementally);
- scalars_figure_s: server time of the Scalars callback on the cached series (read + min/max
  downsample + figure), median of interleaved repetitions, next to the same figure built at full
  resolution (`full_resolution_figure_s`) and their ratio; payload sizes likewise;
- zoom_figure_s: the callback for a 1,000-step zoom window (full resolution there);
- page_load_interactive_s: Chromium, from navigation to the Scalars graph drawn with its traces
  (median of 3 loads), or the reason it was skipped.

Run: PYTHONPATH=. python3 benchmarks/dashboard_load.py [--steps N]
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

_ROOT = Path(__file__).resolve().parent.parent
if (_ROOT / "tracer" / "__init__.py").is_file():  # run from a checkout: measure its code
    sys.path.insert(0, str(_ROOT))

SERIES = ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s")


def write_metrics(run: Path, steps: int) -> None:
    rng = np.random.default_rng(0)
    s = np.arange(steps)
    cols = {"loss": 3 * np.exp(-s / steps * 3) + rng.normal(0, 0.05, steps), "lr": np.full(steps, 3e-4),
            "grad_norm": np.abs(rng.normal(1, 0.2, steps)), "tokens_per_s": rng.normal(5e4, 1e3, steps),
            "step_time_s": np.abs(rng.normal(0.1, 0.01, steps))}
    run.mkdir(parents=True, exist_ok=True)
    (run / "run.json").write_text(json.dumps({"name": "long", "world_size": 1}))
    with open(run / "metrics.jsonl", "w") as f:
        block = 100_000
        for lo in range(0, steps, block):
            hi = min(steps, lo + block)
            f.write("".join(
                f'{{"step": {i}, "loss": {a:.6g}, "lr": {b:.6g}, "grad_norm": {c:.6g}, '
                f'"tokens_per_s": {d:.6g}, "step_time_s": {e:.6g}}}\n'
                for i, a, b, c, d, e in zip(range(lo, hi), *(cols[k][lo:hi] for k in SERIES))))


def full_resolution_figure(series: dict, tags: list[str]):
    """The naive figure: every point of every series, no downsampling (the baseline)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=len(tags), cols=1, shared_xaxes=True)
    for row, tag in enumerate(tags, start=1):
        for run, by_tag in series.items():
            df = by_tag[tag]
            fig.add_trace(go.Scatter(x=df["step"].to_numpy(), y=df["value"].to_numpy(), name=run), row=row, col=1)
    return fig


def page_load(run: Path) -> dict:
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        return {"page_load_interactive_s": None, "page_load_skipped": "selenium not installed"}
    if not Path("/usr/bin/chromium").exists() or not Path("/usr/bin/chromedriver").exists():
        return {"page_load_interactive_s": None, "page_load_skipped": "chromium/chromedriver not installed"}
    import dashboard

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    handle = dashboard.serve(dashboard.create_app([run], refresh_s=0), port=port, background=True)
    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
              "--disable-background-networking", "--disable-component-update", "--disable-sync",
              "--no-first-run", "--window-size=1400,1000", f"--user-data-dir={tempfile.mkdtemp()}"):
        opts.add_argument(a)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)
    times = []
    try:
        for _ in range(3):
            t0 = time.perf_counter()
            driver.get(f"{handle.url}/scalars")
            while time.perf_counter() - t0 < 60:
                n = driver.execute_script("var g = document.querySelector('#scalars-graph .js-plotly-plot');"
                                          "return g && g._fullData ? g._fullData.length : 0;")
                if n >= 3:
                    break
                time.sleep(0.02)
            times.append(time.perf_counter() - t0)
    finally:
        driver.quit()
        handle.close()
    return {"page_load_interactive_s": round(statistics.median(times), 3),
            "page_load_runs_s": [round(t, 3) for t in times]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from dashboard import _data
    from dashboard._figures import scalars_figure

    run = Path(tempfile.mkdtemp()) / "long"
    t0 = time.perf_counter()
    write_metrics(run, args.steps)
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    _data.scalars(run)
    read_s = time.perf_counter() - t0
    tags = list(SERIES)

    def callback(x_range=None):  # what the Scalars figure callback does per request
        return scalars_figure({"long": _data.scalars(run)}, tags, x_range=x_range)

    callback(), full_resolution_figure({"long": _data.scalars(run)}, tags)  # warm plotly validators
    down, full, zoom = [], [], []
    for _ in range(args.repeats):  # interleaved so machine noise hits both alike
        t0 = time.perf_counter(); fig_d = callback(); down.append(time.perf_counter() - t0)
        t0 = time.perf_counter(); fig_f = full_resolution_figure({"long": _data.scalars(run)}, tags)
        full.append(time.perf_counter() - t0)
        mid = args.steps // 2
        t0 = time.perf_counter(); callback((mid, mid + 1000)); zoom.append(time.perf_counter() - t0)
    payload_d, payload_f = len(fig_d.to_json()), len(fig_f.to_json())
    out = {
        "steps": args.steps, "series": len(tags), "write_metrics_s": round(write_s, 3),
        "read_metrics_s": round(read_s, 3),
        "scalars_figure_s": round(statistics.median(down), 4),
        "full_resolution_figure_s": round(statistics.median(full), 4),
        "figure_time_ratio_full_over_downsampled": round(statistics.median(full) / statistics.median(down), 2),
        "zoom_figure_s": round(statistics.median(zoom), 4),
        "points_drawn": sum(len(t.x) for t in fig_d.data),
        "payload_bytes": payload_d, "full_resolution_payload_bytes": payload_f,
        "payload_ratio_full_over_downsampled": round(payload_f / payload_d, 1),
        "goal_scalars_figure_s": 0.5,
    }
    out.update(page_load(run))
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
