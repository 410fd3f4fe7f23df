"""Pure figure functions: DataFrames (or arrays) in, a plotly Figure out. No Dash, no files:
the callbacks in the page modules are thin shells around these, and tests call them directly."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dashboard._downsample import DEFAULT_POINTS, downsample, minmax_indices

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2")
_LAYOUT = dict(template="plotly_white", margin=dict(l=60, r=20, t=40, b=40))
DIFF_LABEL_SHIFT_PX = 22  # the diff figure's "first divergence" label sits this far above its row titles


def empty_figure(message: str) -> go.Figure:
    """A blank figure that says why it is blank."""
    fig = go.Figure(layout=_LAYOUT)
    fig.add_annotation(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper",
                       font=dict(size=14, color="#666"))
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return fig


def ema(values: np.ndarray, weight: float) -> np.ndarray:
    """TensorBoard-style exponential moving average with debiasing (the first points are not
    pulled toward zero); NaNs are skipped, not propagated."""
    if weight <= 0:
        return values
    return pd.Series(values).ewm(alpha=1.0 - weight, adjust=True, ignore_na=True).mean().to_numpy()


def scalars_figure(series: Mapping[str, Mapping[str, pd.DataFrame]], tags: Sequence[str], *,
                   x: Literal["step", "wall_time"] = "step", smoothing: float = 0.0,
                   log_y: bool = False, x_range: tuple[float, float] | None = None,
                   max_points: int = DEFAULT_POINTS) -> go.Figure:
    """One row per tag, one colour per run, all rows sharing the x axis.

    Args:
        series: run label -> tag -> DataFrame[step, wall_time, value] sorted by step.
        tags: the tags to draw, top to bottom.
        x: `step` or `wall_time` (seconds since the run's first record).
        smoothing: EMA weight in [0, 1); above 0 the raw line is drawn faint under the smooth one.
        log_y: log scale on every row.
        x_range: the visible x window (from a zoom); only it is read, at full resolution when
            it holds fewer than `max_points` points.
        max_points: points per trace after min/max downsampling.
    """
    if not tags:
        return empty_figure("choose one or more series")
    fig = make_subplots(rows=len(tags), cols=1, shared_xaxes=True, vertical_spacing=0.04,
                        subplot_titles=list(tags))
    lo, hi = x_range if x_range else (None, None)
    for row, tag in enumerate(tags, start=1):
        for i, (run, by_tag) in enumerate(series.items()):
            df = by_tag.get(tag)
            if df is None or df.empty:
                continue
            xs = df[x].to_numpy(np.float64) if x in df else df["step"].to_numpy(np.float64)
            ys = df["value"].to_numpy(np.float64)
            if x != "step" and np.isnan(xs).all():
                xs = df["step"].to_numpy(np.float64)  # no wall time logged: fall back to steps
            color = PALETTE[i % len(PALETTE)]
            show = row == 1
            if smoothing > 0:
                sx, sy = downsample(xs, ema(ys, smoothing), lo=lo, hi=hi, max_points=max_points)
                rx, ry = downsample(xs, ys, lo=lo, hi=hi, max_points=max_points)
                fig.add_trace(go.Scatter(x=rx, y=ry, mode="lines", line=dict(color=color, width=1),
                                         opacity=0.25, name=f"{run} (raw)", legendgroup=run,
                                         showlegend=False, hoverinfo="skip"), row=row, col=1)
                fig.add_trace(go.Scatter(x=sx, y=sy, mode="lines", line=dict(color=color, width=2),
                                         name=run, legendgroup=run, showlegend=show), row=row, col=1)
            else:
                dx, dy = downsample(xs, ys, lo=lo, hi=hi, max_points=max_points)
                fig.add_trace(go.Scatter(x=dx, y=dy, mode="lines", line=dict(color=color, width=1.5),
                                         name=run, legendgroup=run, showlegend=show), row=row, col=1)
    fig.update_layout(**_LAYOUT, height=max(320, 260 * len(tags)), uirevision="scalars",
                      hovermode="x unified", legend=dict(orientation="h", y=1.08, x=0))
    if log_y:
        fig.update_yaxes(type="log")
    if x_range:
        fig.update_xaxes(range=list(x_range), autorange=False)
    fig.update_xaxes(title_text="wall time (s)" if x == "wall_time" else "step", row=len(tags), col=1)
    return fig


def histogram_heatmap(df: pd.DataFrame, tag: str, *, bins: int = 64,
                      max_steps: int = DEFAULT_POINTS // 2) -> go.Figure:
    """Heatmap of one tensor's histograms over steps: x step, y value, colour log(1 + count).

    Args:
        df: DataFrame[step, edges, counts] of one tag (edges has len(counts) + 1 entries);
            steps may use different edges, so every histogram is re-binned onto one grid.
        max_steps: columns drawn at most; more steps are thinned evenly (first and last kept).
    """
    if df.empty:
        return empty_figure(f"no histograms for {tag}")
    df = df.sort_values("step")
    if len(df) > max_steps:
        df = df.iloc[np.unique(np.linspace(0, len(df) - 1, max_steps).astype(np.int64))]
    lo = min(float(np.min(e)) for e in df["edges"])
    hi = max(float(np.max(e)) for e in df["edges"])
    if not np.isfinite([lo, hi]).all() or hi <= lo:
        hi = lo + 1.0
    grid = np.linspace(lo, hi, bins + 1)
    z = np.zeros((bins, len(df)))
    for j, (edges, counts) in enumerate(zip(df["edges"], df["counts"])):
        edges = np.asarray(edges, np.float64)
        centers = (edges[:-1] + edges[1:]) / 2
        z[:, j] = np.histogram(centers, bins=grid, weights=np.asarray(counts, np.float64))[0]
    fig = go.Figure(go.Heatmap(x=df["step"].to_numpy(), y=(grid[:-1] + grid[1:]) / 2, z=np.log1p(z),
                               colorscale="Viridis", colorbar=dict(title="log(1+n)"),
                               customdata=z, hovertemplate="step %{x}<br>value %{y:.4g}<br>count %{customdata:.0f}<extra></extra>"))
    fig.update_layout(**_LAYOUT, title=tag, xaxis_title="step", yaxis_title="value", height=420)
    return fig


def tensor_histogram(values: np.ndarray, name: str, *, bins: int = 80) -> go.Figure:
    """Histogram of a tensor's finite values, the NaN/Inf counts in the title."""
    flat = np.asarray(values, dtype=np.float64).ravel()
    finite = flat[np.isfinite(flat)]
    nan, inf = int(np.isnan(flat).sum()), int(np.isinf(flat).sum())
    counts, edges = np.histogram(finite, bins=bins) if finite.size else (np.zeros(1), np.array([0.0, 1.0]))
    fig = go.Figure(go.Bar(x=(edges[:-1] + edges[1:]) / 2, y=counts, width=np.diff(edges),
                           marker_color=PALETTE[0]))
    extra = f" · NaN {nan} · Inf {inf}" if nan or inf else ""
    fig.update_layout(**_LAYOUT, title=f"{name}<br><sub>{flat.size} elements{extra}</sub>",
                      xaxis_title="value", yaxis_title="count", height=360, bargap=0)
    return fig


def bar_top(df: pd.DataFrame, label: str, value: str, *, n: int = 20, title: str = "",
            unit: str = "") -> go.Figure:
    """Horizontal bars of the `n` largest `value`s, largest on top."""
    if df.empty or label not in df or value not in df:
        return empty_figure(f"no {title or value} data")
    top = df.nlargest(n, value).iloc[::-1]
    fig = go.Figure(go.Bar(x=top[value], y=top[label].astype(str), orientation="h",
                           marker_color=PALETTE[0]))
    fig.update_layout(**_LAYOUT, title=title, xaxis_title=f"{value} {unit}".strip(),
                      height=max(300, 22 * len(top) + 100))
    fig.update_yaxes(automargin=True)
    return fig


def stacked_steps(df: pd.DataFrame, step: str, parts: Sequence[str], *, title: str = "step time",
                  max_bars: int = DEFAULT_POINTS // 2) -> go.Figure:
    """Stacked bars of each step's time split into `parts` (data, forward, backward, ...); more
    than `max_bars` steps are drawn as the means of buckets of consecutive steps."""
    if df.empty or step not in df:
        return empty_figure(f"no {title} data")
    if len(df) > max_bars:  # a bar per bucket of consecutive steps, their mean
        k = -(-len(df) // max_bars)
        keep = [p for p in parts if p in df]
        df = df.sort_values(step).reset_index(drop=True)
        bucket = df.index // k
        df = df.groupby(bucket).agg({step: "first", **{p: "mean" for p in keep}})
        title = f"{title} (each bar: the mean of {k} steps)"
    fig = go.Figure()
    for i, part in enumerate(p for p in parts if p in df):
        fig.add_trace(go.Bar(x=df[step], y=df[part], name=part, marker_color=PALETTE[i % len(PALETTE)]))
    fig.update_layout(**_LAYOUT, barmode="stack", title=title, xaxis_title=step, height=360)
    return fig


def lines(df: pd.DataFrame, x: str, ys: Sequence[str], *, title: str = "", group: str | None = None,
          max_points: int = DEFAULT_POINTS) -> go.Figure:
    """Downsampled lines of columns `ys` against `x`, one line per `group` value when given."""
    if df.empty or x not in df:
        return empty_figure(f"no {title} data")
    fig = go.Figure()
    groups = df.groupby(group, sort=True) if group and group in df else [(None, df)]
    i = 0
    for key, g in groups:
        g = g.sort_values(x)
        for y in ys:
            if y not in g:
                continue
            dx, dy = downsample(g[x].to_numpy(np.float64), g[y].to_numpy(np.float64), max_points=max_points)
            name = y if key is None else f"{group} {key} {y}"
            fig.add_trace(go.Scatter(x=dx, y=dy, mode="lines", name=name,
                                     line=dict(color=PALETTE[i % len(PALETTE)])))
            i += 1
    fig.update_layout(**_LAYOUT, title=title, xaxis_title=x, height=360)
    return fig


def diff_figure(records: pd.DataFrame, metrics: Sequence[str], *, first: int | None = None,
                order: str = "seq", label: str = "name", max_points: int = DEFAULT_POINTS) -> go.Figure:
    """Error metrics of a diff along execution order, one row per metric, the first divergent
    record marked with a red line on every row.

    Args:
        records: DiffResult.records (one row per matched record).
        metrics: columns to plot (e.g. max_abs_err, max_rel_err, cosine).
        first: the `order` value of the first divergent record, or None when the runs agree.
        max_points: points per metric after min/max downsampling (a step of a million records
            is drawn from its extremes, so every spike shows); diverged markers beyond it are
            thinned evenly, the first always kept.
    """
    metrics = [m for m in metrics if m in records]
    if records.empty or not metrics:
        return empty_figure("no matched records to compare")
    x = (records[order] if order in records else pd.Series(np.arange(len(records)))).to_numpy()
    fig = make_subplots(rows=len(metrics), cols=1, shared_xaxes=True, vertical_spacing=0.05,
                        subplot_titles=list(metrics))
    names = records[label].astype(str).to_numpy() if label in records else None
    for row, m in enumerate(metrics, start=1):
        y = pd.to_numeric(records[m], errors="coerce").to_numpy(np.float64)
        idx = minmax_indices(y, max_points)
        fig.add_trace(go.Scatter(x=x[idx], y=y[idx], mode="lines+markers", marker=dict(size=4),
                                 line=dict(color=PALETTE[(row - 1) % len(PALETTE)]), name=m,
                                 text=None if names is None else names[idx],
                                 hovertemplate="%{text}<br>" + m + " %{y:.4g}<extra></extra>"),
                      row=row, col=1)
    if "verdict" in records:
        # A NaN or Inf error has no y position: mark every diverged record on the top row instead
        # so divergences after the first one stay visible.
        bad = records[records["verdict"] == "diverged"]
        if len(bad) > max_points:
            bad = bad.iloc[np.unique(np.linspace(0, len(bad) - 1, max_points).astype(np.int64))]
        if len(bad):
            bx = bad[order] if order in bad else bad.index
            fig.add_trace(go.Scatter(x=bx, y=[0] * len(bad), mode="markers", name="diverged",
                                     marker=dict(symbol="x", color="red", size=6), yaxis="y",
                                     text=bad[label].astype(str) if label in bad else None,
                                     hovertemplate="%{text}<br>diverged<extra></extra>"), row=1, col=1)
    if first is not None:
        fig.add_vline(x=first, line=dict(color="red", width=2, dash="dash"))
        # Above the first row's subplot title, in a band of its own: at the title's height the
        # two collide whenever the first divergence falls near the middle of execution order.
        fig.add_annotation(x=first, y=1.0, yref="paper", text="first divergence", showarrow=False,
                           font=dict(color="red"), xanchor="left", yanchor="bottom",
                           yshift=DIFF_LABEL_SHIFT_PX)
    fig.update_layout(**_LAYOUT, height=max(320, 200 * len(metrics)), showlegend=False)
    fig.update_layout(margin=dict(_LAYOUT["margin"], t=_LAYOUT["margin"]["t"] + DIFF_LABEL_SHIFT_PX))
    fig.update_xaxes(title_text="execution order", row=len(metrics), col=1)
    return fig


RANK_STATES = ("same", "diverged", "interrupted", "missing", "unreadable")
"""The cells of the rank x step grid, in colour order; any other problem state is "unreadable"."""
_RANK_COLOURS = ("#c8e6c9", "#d62728", "#ffb74d", "#bdbdbd", "#6a1b9a")


def rank_grid_figure(table: Mapping[int, Mapping[int, str]],
                     earliest: tuple[int, int] | None = None) -> go.Figure:
    """Rank x step grid of a diff over ranks, one cell per (rank, step) coloured by its status
    (DiffResult tables: same, diverged, interrupted, missing, or a state that did not read),
    the earliest divergence outlined. A click on a cell gives its rank (y) and step (x)."""
    ranks = sorted(table)
    steps = sorted({s for row in table.values() for s in row})
    if not ranks or not steps:
        return empty_figure("no step compared")
    code = {state: i for i, state in enumerate(RANK_STATES)}
    z, text = [], []
    for r in ranks:
        row = table[r]
        states = [row.get(s, "missing") for s in steps]
        states = [st if st in code else "unreadable" for st in states]
        z.append([code[st] for st in states])
        text.append(states)
    n = len(RANK_STATES)
    scale = []
    for i, colour in enumerate(_RANK_COLOURS):  # a step function: one colour per state
        scale += [[i / n, colour], [(i + 1) / n, colour]]
    fig = go.Figure(go.Heatmap(
        z=z, x=steps, y=ranks, text=text, zmin=-0.5, zmax=n - 0.5, colorscale=scale,
        xgap=1, ygap=1, colorbar=dict(tickvals=list(range(n)), ticktext=list(RANK_STATES)),
        hovertemplate="rank %{y} step %{x}: %{text}<extra></extra>"))
    if earliest is not None and earliest[0] in ranks and earliest[1] in steps:
        # category axes place shapes by a category's index
        i, j = steps.index(earliest[1]), ranks.index(earliest[0])
        fig.add_shape(type="rect", x0=i - 0.5, x1=i + 0.5, y0=j - 0.5, y1=j + 0.5,
                      line=dict(color="black", width=3))
    fig.update_layout(xaxis=dict(title="step", type="category"),
                      yaxis=dict(title="rank", type="category", autorange="reversed"),
                      height=min(180 + 18 * len(ranks), 900), margin=dict(l=50, r=20, t=30, b=40))
    return fig


def headroom_figure(history: pd.DataFrame, name: str, *, max_points: int = DEFAULT_POINTS) -> go.Figure:
    """A record's numeric headroom over the dumped steps (dashboard._data.record_history): the
    doublings of its largest |x| left before its dtype overflows (0: Inf), and the share of
    its elements that are exactly zero; the same numbers `sleuth check --headroom` fits."""
    if history.empty or history["overflow_bits"].isna().all():
        return empty_figure(f"{name}: no headroom over the steps (not a floating-point record, "
                            f"or NaN in every step)")
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=("headroom to overflow (bits: doublings of max |x| left)",
                                        "share of exact zeros"))
    if len(history) > max_points:  # keep each bucket's extremes of the headroom
        history = history.sort_values("step").iloc[
            minmax_indices(history["overflow_bits"].to_numpy(np.float64), max_points)]
    fig.add_trace(go.Scatter(x=history["step"], y=history["overflow_bits"], mode="lines+markers",
                             name="overflow headroom"), row=1, col=1)
    fig.add_hline(y=0, line_dash="dash", line_color="#c62828", annotation_text="Inf",
                  row=1, col=1)
    fig.add_trace(go.Scatter(x=history["step"], y=history["zero_share"], mode="lines+markers",
                             name="zeros"), row=2, col=1)
    fig.update_yaxes(range=[0, 1], row=2, col=1)
    fig.update_xaxes(title_text="step", row=2, col=1)
    fig.update_layout(template="plotly_white",
                      title=f"{name} ({history['dtype'].iloc[-1]}) over the steps",
                      height=420, showlegend=False, margin=dict(l=50, r=20, t=60, b=40))
    return fig
