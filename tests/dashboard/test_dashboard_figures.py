"""Figure functions and page logic, without a browser: DataFrames in, figures out."""
from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from dashboard._downsample import downsample, minmax_indices, window
from dashboard._figures import diff_figure, ema, histogram_heatmap, scalars_figure, tensor_histogram


def _series(n: int, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    step = np.arange(n, dtype=np.float64)
    return pd.DataFrame({"step": step, "wall_time": step * 0.5, "value": rng.normal(size=n)})


def test_minmax_keeps_extremes_and_nan_gaps():
    y = np.zeros(100_000)
    y[12_345] = 50.0   # a spike
    y[67_890] = -7.0   # a dip
    y[99_000] = np.nan  # a NaN must stay visible as a gap
    idx = minmax_indices(y, 1000)
    assert len(idx) <= 1004
    assert {12_345, 67_890, 0, 99_999} <= set(idx.tolist())
    assert np.isnan(y[idx]).any()
    assert np.all(np.diff(idx) > 0)


def test_small_series_are_not_touched():
    x = np.arange(50.0)
    dx, dy = downsample(x, x * 2, max_points=100)
    assert np.array_equal(dx, x) and np.array_equal(dy, x * 2)


def test_window_reads_full_resolution_when_zoomed():
    x = np.arange(1_000_000, dtype=np.float64)
    s = window(x, 1000.5, 1999.5)
    assert s.start == 1000 and s.stop == 2001
    dx, dy = downsample(x, x, lo=1000, hi=2000, max_points=2000)
    assert len(dx) == 1003 and dx[0] == 999 and dx[-1] == 2001  # every point, plus one each side


def test_ema_debiased_and_nan_tolerant():
    v = np.array([1.0, 1.0, np.nan, 1.0])
    assert np.allclose(ema(v, 0.9)[[0, 1, 3]], 1.0)  # debiased: a constant stays constant
    assert np.array_equal(ema(v, 0.0), v, equal_nan=True)


def test_scalars_figure_overlays_runs_and_rows():
    series = {"a": {"loss": _series(500), "lr": _series(500, 1)}, "b": {"loss": _series(300, 2)}}
    fig = scalars_figure(series, ["loss", "lr"], smoothing=0.6, log_y=False)
    names = [(t.name, t.yaxis) for t in fig.data]
    assert ("a", "y") in names and ("b", "y") in names and ("a", "y2") in names
    assert sum(t.opacity == 0.25 for t in fig.data) == 3  # raw under each smoothed line
    log = scalars_figure(series, ["loss"], log_y=True, x="wall_time")
    assert log.layout.yaxis.type == "log"
    assert log.data[0].x[-1] == pytest.approx(499 * 0.5)


def test_scalars_figure_one_million_points_is_fast_and_bounded():
    n = 1_000_000
    series = {"run": {f"s{i}": _series(n, i) for i in range(5)}}
    scalars_figure(series, list(series["run"]))  # warm plotly's validators
    t0 = time.perf_counter()
    fig = scalars_figure(series, list(series["run"]))
    took = time.perf_counter() - t0
    assert all(len(t.x) <= 2004 for t in fig.data)
    assert took < 2.0  # goal 0.5 s (benchmarks/dashboard_load.py); slack for a shared CI machine
    zoomed = scalars_figure(series, ["s0"], x_range=(10_000, 10_500))
    assert len(zoomed.data[0].x) == 503


def test_histogram_heatmap_rebins_varying_edges():
    rows = []
    for s in range(5):
        edges = np.linspace(-1 - s, 1 + s, 11)
        rows.append({"step": s, "edges": edges, "counts": np.full(10, 10.0)})
    fig = histogram_heatmap(pd.DataFrame(rows), "w", bins=16)
    z = np.asarray(fig.data[0].customdata)
    assert z.shape == (16, 5)
    assert np.allclose(z.sum(axis=0), 100.0)  # no count lost by re-binning


def test_tensor_histogram_reports_nonfinite():
    fig = tensor_histogram(np.array([1.0, 2.0, np.nan, np.inf]), "x")
    assert "NaN 1" in fig.layout.title.text and "Inf 1" in fig.layout.title.text


def test_diff_figure_marks_first_divergence():
    rec = pd.DataFrame({"order": range(10), "name": [f"r{i}" for i in range(10)],
                        "max_abs_err": [0.0] * 6 + [1.0] * 3 + [np.nan], "cosine": [1.0] * 6 + [0.5] * 4,
                        "verdict": ["same"] * 6 + ["diverged"] * 4})
    fig = diff_figure(rec, ["max_abs_err", "cosine"], first=6, order="order")
    assert len(fig.data) == 3  # two metrics, and the diverged records (NaN errors included)
    assert list(fig.data[2].x) == [6, 7, 8, 9]
    assert any(s.x0 == 6 for s in fig.layout.shapes)
    assert any(a.text == "first divergence" for a in fig.layout.annotations)


def test_profile_figures_from_profile_tables():
    from dashboard._page_profile import profile_figures

    prof = SimpleNamespace(
        ops=pd.DataFrame({"rank": 0, "window": 0, "name": ["aten::mm", "aten::add", "aten::mm"],
                          "cpu_self_us": [10.0, 3.0, 5.0]}),
        modules=pd.DataFrame({"rank": 0, "window": 0, "module": ["a", "b"], "forward_self_us": [1.0, 2.0],
                              "backward_self_us": [2.0, 2.0]}),
        steps=pd.DataFrame({"rank": 0, "window": 0, "step": [1, 2], "step_us": [10, 11], "data_us": [1, 1],
                            "forward_us": [3, 3], "backward_us": [4, 5], "optimizer_us": [2, 2]}),
        memory=pd.DataFrame({"rank": 0, "window": 0, "time_us": [0, 1, 2], "allocated_bytes": [0, 2**20, 0],
                             "reserved_bytes": [2**21] * 3}),
        cluster=pd.DataFrame({"rank": [0, 1], "step_time_s": [0.1, 0.2]}), summary={"mfu": 0.1})
    figs = profile_figures(prof)
    assert list(figs["ops"].data[0].y) == ["aten::add", "aten::mm"] and figs["ops"].data[0].x[-1] == 15
    assert len(figs["steps"].data) == 4 and figs["steps"].layout.barmode == "stack"
    assert max(figs["memory"].data[0].y) == 1.0  # MiB
    assert len(figs["cluster"].data[0].x) == 2
    assert list(figs["modules"].data[0].y) == ["a", "b"]
    # a CPU trace: no GPU figures, said in one line
    assert not figs["gpu"].data and "CPU trace: no GPU figures" in str(figs["gpu"].layout)


def test_profile_page_shows_each_ranks_gpu_time(tmp_path):
    """Two DDP ranks of a torch-shaped CUDA trace (tests/profiler/data), rank 1 a straggler
    with an .item() sync: each rank's GPU time a step, busy and idle by cause, the slowest
    rank marked (the figures hand-computed in tests/profiler/test_profiler_gpu_time.py)."""
    from pathlib import Path

    import profiler
    from dashboard._page_profile import profile_figures

    data = Path(__file__).resolve().parents[1] / "profiler" / "data"
    for rank, name in ((0, "base_rank0"), (1, "slow_rank1")):
        d = tmp_path / "profile" / f"rank{rank}"
        d.mkdir(parents=True)
        (d / "window0.trace.json").write_text((data / f"{name}.trace.json").read_text())
    fig = profile_figures(profiler.read_profile(tmp_path))["gpu"]
    bars = {bar.name: dict(zip(bar.x, bar.y)) for bar in fig.data}
    assert set(bars) == {"busy", "idle: host-bound", "idle: data-bound",
                         "idle: waiting on communication"}
    assert bars["idle: host-bound"] == {"rank 0": 270, "rank 1 (slowest)": 495}
    assert bars["idle: waiting on communication"]["rank 1 (slowest)"] == 170
    assert fig.layout.barmode == "stack"


def test_scalars_relayout_parsing():
    from dashboard._page_scalars import x_range_from_relayout as f

    assert f({"xaxis.range[0]": 1, "xaxis.range[1]": 5}) == (1.0, 5.0)
    assert f({"xaxis2.range[0]": 1, "xaxis2.range[1]": 5}) == (1.0, 5.0)
    assert f({"xaxis.range": [2, 3]}) == (2.0, 3.0)
    assert f({"xaxis.autorange": True}) is None
    assert f({"yaxis.range[0]": 1, "yaxis.range[1]": 2}) is False
    assert f({"autosize": True}) is False and f(None) is False


def _scalars_call(client, *, changed: str, drawn, version: str, relayout=None):
    """POST the Scalars figure callback as the browser does: all inputs, one changed."""
    inputs = [("scalars-runs", "value", [0]), ("scalars-tags", "value", ["loss"]),
              ("scalars-smoothing", "value", 0), ("scalars-x", "value", "step"),
              ("scalars-log", "value", []), ("scalars-graph", "relayoutData", relayout),
              ("data-version", "data", version)]
    body = {"output": "..scalars-graph.figure...scalars-drawn.data..",
            "outputs": [{"id": "scalars-graph", "property": "figure"},
                        {"id": "scalars-drawn", "property": "data"}],
            "inputs": [{"id": i, "property": p, "value": v} for i, p, v in inputs],
            "changedPropIds": [changed],
            "state": [{"id": "scalars-drawn", "property": "data", "value": drawn}]}
    return client.post("/_dash-update-component", json=body)


def test_scalars_autosize_draws_when_the_first_draw_was_dropped(runs_dir):
    """Dash's renderer drops a running callback when the same callback fires again: the graph's
    first autosize (a relayout that leaves x alone) can cancel the first draw. That relayout
    must then draw, not keep the "loading" placeholder; once drawn, a resize redraws nothing."""
    import dashboard

    app = dashboard.create_app([runs_dir / "base"], refresh_s=0)
    client = app.server.test_client()
    client.get("/")  # Dash finishes its set-up on the first request
    version = app.layout["data-version"].data
    first = _scalars_call(client, changed="scalars-runs.value", drawn=None, version=version)
    assert first.status_code == 200
    drawn = first.get_json()["response"]["scalars-drawn"]["data"]
    # the first draw's reply never reached the page: the autosize call must draw
    resp = _scalars_call(client, changed="scalars-graph.relayoutData", drawn=None, version=version,
                         relayout={"autosize": True})
    assert resp.status_code == 200
    figure = resp.get_json()["response"]["scalars-graph"]["figure"]
    assert [t["name"] for t in figure["data"]] == ["base"]
    # the figure on the page is current: a resize updates nothing
    again = _scalars_call(client, changed="scalars-graph.relayoutData", drawn=drawn, version=version,
                          relayout={"autosize": True})
    assert again.status_code in (200, 204) and not (again.get_json(silent=True) or {}).get("response")


def test_dump_rows_flag_nonfinite_and_hits():
    from dashboard._page_dumps import table_rows

    stats = pd.DataFrame({"seq": [0, 1], "name": ["a.forward.0.output.0", "b.forward.0.output.0"],
                          "min": [0.0, np.nan], "max": [1.0, np.inf], "nan": [0, 3], "posinf": [0, 1],
                          "neginf": [0, 0], "zeros": [0, 0], "hit": ["", "nan_inf"]})
    rows = table_rows(stats)
    assert rows[0]["nonfinite"] == 0 and rows[0]["hit"] == "-"
    assert rows[1]["nonfinite"] == 4 and rows[1]["hit"] == "nan_inf" and rows[1]["id"] == 1
    assert rows[1]["min"] is None and rows[1]["max"] == "inf"


def test_record_names_map_to_graph_nodes():
    from dashboard._data import node_name_for_record as f

    assert f("layers.0.attn::aten.mm.forward.2.input.1") == "layers.0.attn::aten.mm.forward.2"
    assert f("layers.0.attn.forward.0.output.0") == "layers.0.attn"
    assert f("<root>.forward.0.input.0") == "<root>"
    assert f("not a record") is None


def test_graph_search_and_svg_highlight():
    from dashboard._page_graph import match_nodes
    from dashboard._routes import highlight_svg

    names = pd.Series(["a::aten.mm.forward.0", "a::aten.mm.forward.1", "b::aten.add.forward.0"])
    assert match_nodes(names, "ATEN.MM") == ["a::aten.mm.forward.0", "a::aten.mm.forward.1"]
    assert match_nodes(names, "a::aten.mm.forward.1")[0] == "a::aten.mm.forward.1"
    svg = ('<svg><g id="node1" class="node"><title>a::aten.mm.forward.0</title><polygon/></g>'
           '<g id="node2" class="node"><title>b</title><polygon/></g></svg>')
    out = highlight_svg(svg, "aten.mm")
    assert out.count('class="node sleuth-hit"') == 1 and ".sleuth-hit" in out
    assert '<g id="node2" class="node">' in out


def test_diff_passes_ranks_and_steps_to_tracer(monkeypatch, tmp_path):
    import tracer
    from dashboard._page_diff import call_diff

    seen = {}

    def fake_diff(a, b, *, step=None, rank=0, b_step=None, b_rank=None):
        seen.update(a=a, b=b, step=step, rank=rank, b_step=b_step, b_rank=b_rank)
        return SimpleNamespace(status="same", first_divergence=None, records=pd.DataFrame())

    monkeypatch.setattr(tracer, "diff", fake_diff)
    for r in ("a", "b"):
        (tmp_path / r / "dump" / "rank0").mkdir(parents=True)
    call_diff(tmp_path / "a", tmp_path / "b", 0, 3, 1, 4)
    assert seen == {"a": tmp_path / "a", "b": tmp_path / "b", "step": 3, "rank": 0, "b_step": 4, "b_rank": 1}


def test_diff_label_sits_above_the_row_titles():
    """The "first divergence" label has a band of its own above the first row's title: at the
    title's height the two overlapped whenever the divergence fell mid-way."""
    from dashboard._figures import DIFF_LABEL_SHIFT_PX

    rec = pd.DataFrame({"seq": np.arange(10), "max_abs_err": np.arange(10.0),
                        "max_rel_err": np.arange(10.0)})
    fig = diff_figure(rec, ["max_abs_err", "max_rel_err"], first=5)
    label = next(a for a in fig.layout.annotations if a.text == "first divergence")
    title = next(a for a in fig.layout.annotations if a.text == "max_abs_err")
    assert label.yanchor == title.yanchor == "bottom" and label.y >= title.y
    assert label.yshift >= 18  # one line of title text below it
    assert fig.layout.margin.t >= 40 + DIFF_LABEL_SHIFT_PX  # and room for it inside the figure


@pytest.fixture(scope="module")
def tool_runs(tmp_path_factory):
    """A run with every tool's data (graphs included) and one with a dump but no graphs."""
    from dashboard_helpers import write_tool_data

    base = tmp_path_factory.mktemp("tool-runs")
    done = write_tool_data(base / "all")
    if any(v != "ok" for v in done.values()):
        pytest.skip(f"tool data unavailable: {done}")
    (base / "no-graphs").mkdir()
    return base


def test_profile_summary_reads_as_sleuth_profile_prints_it(tool_runs, capsys):
    import profiler

    from sleuth.cli import main

    lines = profiler.summary_lines(profiler.read_profile(tool_runs / "all").summary)
    assert main(["profile", str(tool_runs / "all")]) == 0
    cli = capsys.readouterr().out.splitlines()
    assert cli[0].endswith(f": {lines[0]}")
    assert [c.strip() for c in cli[1:len(lines)]] == lines[1:]

    assert " ms " in lines[1] and "MFU" in lines[1] and "step_time_s" not in "".join(lines)


def test_graph_links_only_where_the_run_has_graphs(tool_runs):
    from dashboard._widgets import graph_link

    record = "0::aten.addmm.forward.0.output.0"
    link = graph_link(tool_runs / "all", 0, record, "show {node} in the graph", "x")
    assert link is not None and link.href == "/graph?run=0&node=0%3A%3Aaten.addmm.forward.0"
    assert link.children == "show 0::aten.addmm.forward.0 in the graph"
    assert graph_link(tool_runs / "no-graphs", 1, record, "show {node}") is None
    assert graph_link(tool_runs / "all", 0, "not a record name", "show {node}") is None


def test_headroom_figure_shows_a_record_over_the_steps():
    import pandas as pd

    from dashboard._figures import headroom_figure

    history = pd.DataFrame({"step": [0, 1, 2], "dtype": ["float16"] * 3,
                            "overflow_bits": [9.0, 7.0, 5.0], "underflow_bits": [20.0] * 3,
                            "zero_share": [0.0, 0.1, 0.2]})
    fig = headroom_figure(history, "fc1.forward.0.output.0")
    assert list(fig.data[0].y) == [9.0, 7.0, 5.0] and list(fig.data[1].y) == [0.0, 0.1, 0.2]
    assert "fc1.forward.0.output.0 (float16)" in fig.layout.title.text
    empty = headroom_figure(history.iloc[:0], "ids")
    assert "no headroom" in empty.layout.annotations[0].text


def test_figures_of_huge_tables_are_downsampled():
    """A diff of a step of a million records drew every record (and named each in the hover
    text): hundreds of MB of figure. Figures now carry a bounded number of points, and a spike
    and the first divergence survive."""
    import numpy as np
    import pandas as pd

    from dashboard._figures import diff_figure, headroom_figure, histogram_heatmap, stacked_steps

    n = 1_000_000
    err = np.full(n, 1e-6)
    err[654_321] = 5.0
    verdict = np.where(np.arange(n) >= 500_000, "diverged", "same")
    records = pd.DataFrame({"order": np.arange(n), "name": [f"r{i}" for i in range(n)],
                            "max_abs_err": err, "verdict": verdict})
    fig = diff_figure(records, ["max_abs_err"], first=500_000)
    assert len(fig.to_json()) < 2 << 20
    line = fig.data[0]
    assert len(line.x) <= 2100 and 5.0 in list(line.y) and 654_321 in list(line.x)
    marks = fig.data[1]
    assert len(marks.x) <= 2000 and marks.x[0] == 500_000
    steps = pd.DataFrame({"step": np.arange(100_000), "forward_us": 1.0, "backward_us": 2.0})
    bars = stacked_steps(steps, "step", ["forward_us", "backward_us"])
    assert len(bars.data[0].x) <= 1000 and "mean of 100 steps" in bars.layout.title.text
    hist = pd.DataFrame({"step": np.arange(20_000), "edges": [np.linspace(0, 1, 9)] * 20_000,
                         "counts": [np.ones(8)] * 20_000})
    assert len(histogram_heatmap(hist, "w").data[0].x) <= 1000
    history = pd.DataFrame({"step": np.arange(50_000), "dtype": "float32",
                            "overflow_bits": np.linspace(100, 1, 50_000), "zero_share": 0.0})
    assert len(headroom_figure(history, "w").data[0].x) <= 2100
