"""The Profile page's comparison of two runs (`profiler.diff_profiles`, as `sleuth profile diff`
prints it): the verdict line, the causes, the step breakdown side by side, the ranked ops,
modules and source lines with their contribution (one-side-only rows marked), the GPU figures
(or the line saying a trace has none) with, for several ranks, each rank's and which rank is
the slowest and which got slower, and links into each run's traces.

`compare_data` turns a ProfileDiff into plain data (tested without a browser); `compare_panel`
lays it out; the page calls them with run A (the page's run) and run B (the one to compare).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import plotly.graph_objects as go
from dash import dcc, html

from dashboard._figures import PALETTE
from dashboard._routes import FILE_ROUTE
from dashboard._widgets import data_table, table_records

TOP = 25
"""Rows shown of each ranked table (the rest are in `sleuth profile diff --csv`)."""

# each side's shapes: ops pair by them, so without them one op's rows of two shapes read as the
# same row twice
OP_COLS = ["name", "input_shapes_a", "input_shapes_b", "module", "source", "side", "calls_a",
           "calls_b", "self_a_us", "self_b_us", "device_a_us", "device_b_us", "delta_us"]
MOD_COLS = ["module", "type", "side", "calls_a", "calls_b", "self_a_us", "self_b_us",
            "device_a_us", "device_b_us", "delta_us"]
LINE_COLS = ["source", "side", "ops", "delta_us"]
GPU_COLS = ["figure", "a", "b", "delta"]
KERNEL_COLS = ["module", "type", "kernel_a_us", "kernel_b_us", "delta_us"]
RANK_COLS = ["rank", "idle_a", "idle_b", "host_a", "host_b", "data_a", "data_b", "comm_a",
             "comm_b", "overlap_a", "overlap_b"]
"""The per-rank GPU table: idle time and its host-bound, data-bound and communication parts
(us per step) and the overlap share of communication, A beside B."""
_RANK_KEYS = (("gpu_idle_us", "idle"), ("host_wait_us", "host"), ("data_wait_us", "data"),
              ("comm_wait_us", "comm"), ("overlap_share", "overlap"))


def compare_data(d: Any, *, top: int = TOP) -> dict[str, Any]:
    """The comparison as plain data: verdict (slower, faster, no change), headline, causes,
    notes, and per table its records (breakdown, ops, modules, lines, gpu, kernels,
    gpu_ranks: one row per rank, empty with one rank); gpu is empty when neither trace has
    GPU events (a note says so); rank_lines: the slowest rank of each run and the rank that
    got slower the most, in words."""
    def rows(df: Any, cols: list[str], n: int | None = top) -> list[dict[str, Any]]:
        if df is None or df.empty:
            return []
        df = df.head(n) if n else df
        if "source" in df:
            df = df.assign(source=df["source"].fillna("").map(lambda s: _short(s) if s else ""))
        return table_records(df, [c for c in cols if c in df])

    gpu = d.gpu if d.gpu is not None else None
    return {"verdict": d.verdict, "exit_code": d.exit_code, "headline": d.headline(),
            "gpu_ranks": _rank_rows(d.gpu_ranks),
            "rank_lines": d.rank_lines(),
            "causes": list(d.causes), "notes": list(d.notes),
            "breakdown": rows(d.breakdown, ["phase", "a_us", "b_us", "delta_us"], None),
            "ops": rows(d.ops, OP_COLS), "modules": rows(d.modules, MOD_COLS),
            "lines": rows(d.lines, LINE_COLS), "gpu": rows(gpu, GPU_COLS, None),
            "kernels": rows(d.kernels, KERNEL_COLS)}


def _rank_rows(gpu_ranks: Any) -> list[dict[str, Any]]:
    """One row per rank (RANK_COLS) when the runs have several ranks with GPU figures."""
    if gpu_ranks is None or gpu_ranks.empty or gpu_ranks["rank"].nunique() < 2:
        return []
    rows = []
    for rank, g in gpu_ranks.groupby("rank", sort=True):
        by_key = g.set_index("key")
        row: dict[str, Any] = {"rank": int(rank)}
        for key, short in _RANK_KEYS:
            for side in ("a", "b"):
                v = by_key[side].get(key)
                row[f"{short}_{side}"] = None if v is None or v != v else float(v)
        rows.append(row)
    return rows


def _short(source: str) -> str:
    """A source line as a user reads it, its path printed as the dump prints one."""
    from sleuth.common import short_path
    path, sep, line = source.rpartition(":")
    return f"{short_path(path)}:{line}" if sep and path else source


def breakdown_figure(breakdown: list[dict[str, Any]], label_a: str, label_b: str) -> go.Figure:
    """The step breakdown of both runs as grouped bars (mean us per step)."""
    phases = [r["phase"] for r in breakdown]
    fig = go.Figure()
    for key, name, color in (("a_us", f"A: {label_a}", PALETTE[0]),
                             ("b_us", f"B: {label_b}", PALETTE[1])):
        fig.add_trace(go.Bar(x=phases, y=[r[key] for r in breakdown], name=name,
                             marker_color=color))
    fig.update_layout(template="plotly_white", margin=dict(l=60, r=20, t=40, b=40),
                      barmode="group", title="step breakdown, A and B (mean us per step)",
                      yaxis_title="us per step", height=360)
    return fig


def compare_panel(d: Any, run_a: int, run_b: int, roots: tuple[Path, Path],
                  labels: tuple[str, str]) -> html.Div:
    """The comparison's components, under the id `profile-compare`."""
    data = compare_data(d)
    verdict = html.P(data["headline"], id="profile-verdict",
                     className=f"sleuth-verdict sleuth-verdict-{data['verdict'].replace(' ', '-')}",
                     style={"fontWeight": "bold"})
    parts: list[Any] = [html.H3(f"A: {labels[0]}  vs  B: {labels[1]}"), verdict]
    if data["causes"]:
        parts += [html.P("what accounts for it, the likeliest first:"),
                  html.Ol([html.Li(c) for c in data["causes"]], id="profile-causes")]
    if data["notes"]:
        parts.append(html.Ul([html.Li(n) for n in data["notes"]], id="profile-notes",
                             className="sleuth-note"))
    parts.append(dcc.Graph(id="profile-compare-breakdown", className="sleuth-panel",
                           figure=breakdown_figure(data["breakdown"], *labels),
                           config={"displaylogo": False}))
    parts += _table("profile-compare-steps", "step breakdown (mean us per step)",
                    data["breakdown"], ["phase", "a_us", "b_us", "delta_us"])
    parts += _table("profile-compare-ops", "ops by contribution to the difference (us and calls "
                    "per step; side: found in both runs, or in A or B only)", data["ops"], OP_COLS)
    parts += _table("profile-compare-modules", "modules by contribution (self = forward + "
                    "backward self time)", data["modules"], MOD_COLS)
    if data["lines"]:
        parts += _table("profile-compare-lines", "source lines by contribution", data["lines"],
                        LINE_COLS)
    if data["gpu"]:
        parts += _table("profile-compare-gpu", "GPU time (us per step; idle = host-bound + "
                        "data-bound + waiting on communication; overlap share as a fraction)",
                        data["gpu"], GPU_COLS)
        if data["kernels"]:
            parts += _table("profile-compare-kernels", "kernel time by module (us per step)",
                            data["kernels"], KERNEL_COLS)
        if data["gpu_ranks"]:
            parts += _table("profile-compare-gpu-ranks", "GPU time per rank (us per step: idle "
                            "and its host-bound, data-bound and communication parts; overlap "
                            "share of communication as a fraction)", data["gpu_ranks"],
                            RANK_COLS)
            parts.append(html.Ul([html.Li(line) for line in data["rank_lines"]],
                                 id="profile-compare-rank-lines"))
    parts.append(_trace_links(d, run_a, run_b, roots))
    return html.Div(parts, id="profile-compare")


def _table(id_: str, title: str, records: list[dict[str, Any]], cols: list[str]) -> list[Any]:
    if not records:
        return [html.H4(title), html.P("(none)", className="sleuth-note")]
    from dash.dash_table.Format import Format

    present = [c for c in cols if c in records[0]]
    columns = [{"name": c, "id": c, "type": "numeric", "format": Format(precision=4)}
               if isinstance(records[0][c], float) or c.endswith(("_us", "_a", "_b"))
               or c in ("a", "b", "delta") else {"name": c, "id": c} for c in present]
    table = data_table(id_, columns=columns, data=records, page_size=len(records),
                       style_data_conditional=[
                           {"if": {"filter_query": '{side} = "B only"'}, "color": PALETTE[1]},
                           {"if": {"filter_query": '{side} = "A only"'}, "color": PALETTE[0]}])
    return [html.H4(title), table]


def _trace_links(d: Any, run_a: int, run_b: int, roots: tuple[Path, Path]) -> html.Div:
    """Each run's trace files, served by the dashboard (only files inside the run's folder)."""
    items: list[Any] = [html.Span("traces (open in ui.perfetto.dev): ")]
    for side, run, root in (("a", run_a, roots[0]), ("b", run_b, roots[1])):
        for t in d.sides.get(side, {}).get("traces", []):
            p = Path(t)
            try:
                rel = p.resolve().relative_to(root.resolve()).as_posix()
            except (OSError, ValueError):
                continue
            items.append(html.A(f"{side.upper()}: {p.name}", href=f"{FILE_ROUTE}/{int(run)}/{rel}",
                                download=p.name, className=f"profile-trace-{side}",
                                style={"marginRight": "1em"}))
    return html.Div(items, id="profile-compare-traces", className="sleuth-links")
