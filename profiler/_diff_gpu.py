"""GPU time of two profiles side by side, for `diff_profiles`: all ranks, each rank, and kernels.

The figures are `profiler._gpu_time`'s (GPU busy and idle per step, the idle time split into
host-bound, data-bound and waiting on communication, compute and communication kernels, their
overlap and its share), each run's per-step means; kernel time by module charges each kernel to
the module whose range launched it. Per rank, each rank of A is set beside the same rank of B,
so a slowdown on one rank of eight is not averaged away; the GPU cause the diff names is read
on the rank that got slower the most when the runs have several.
"""
from __future__ import annotations

import math
from typing import Any

GPU_FIGURES = (("gpu_busy_us", "GPU busy"), ("gpu_idle_us", "GPU idle"),
               ("host_wait_us", "idle: host-bound"), ("data_wait_us", "idle: data-bound"),
               ("comm_wait_us", "idle: waiting on communication"),
               ("compute_us", "compute kernels"), ("comm_kernel_us", "communication kernels"),
               ("overlap_us", "communication overlapped by compute"),
               ("overlap_share", "overlap share of communication"))
"""(key, label) of each GPU figure a diff sets side by side, in the order shown."""

GPU_COLS = ["figure", "key", "a", "b", "delta"]
GPU_RANK_COLS = ["rank", *GPU_COLS]
KERNEL_COLS = ["module", "type", "kernel_a_us", "kernel_b_us", "delta_us"]
KERNEL_RANK_COLS = ["rank", *KERNEL_COLS]
_IDLE_PARTS = ("host_wait_us", "data_wait_us", "comm_wait_us")


def _figures(ga: dict[str, Any] | None, gb: dict[str, Any] | None) -> list[dict[str, Any]]:
    rows = []
    for key, label in GPU_FIGURES:
        va = ga.get(key) if ga else None
        vb = gb.get(key) if gb else None
        va = math.nan if va is None else float(va)
        vb = math.nan if vb is None else float(vb)
        rows.append({"figure": label, "key": key, "a": va, "b": vb, "delta": vb - va})
    return rows


def _ranked(df: Any, descending: bool, by: str = "delta_us") -> Any:
    if df.empty:
        return df.reset_index(drop=True)
    return df.sort_values(by, ascending=not descending, kind="stable").reset_index(drop=True)


def _rank_table(p: Any) -> Any:
    """A profile's per-rank GPU figures (`Profile.gpu_ranks`, computed when a Profile was
    built without them)."""
    from profiler._gpu_time import summarize_ranks
    got = getattr(p, "gpu_ranks", None)
    return got if got is not None else summarize_ranks(getattr(p, "gpu", None))


def _kernel_table(p: Any) -> Any:
    from profiler._gpu_time import kernels_by_rank
    got = getattr(p, "kernels", None)
    return got if got is not None else kernels_by_rank(p.modules, p.steps)


def gpu_diff(pa: Any, pb: Any, na: int, nb: int, notes: list[str],
             descending: bool) -> tuple[Any, Any]:
    """GPU figures side by side over all ranks (us per step; the overlap share as a fraction)
    and kernel time by module; a note names a side whose trace has no GPU events."""
    import pandas as pd

    from profiler._gpu_time import NO_GPU, kernels_by_module, summarize
    ga, gb = summarize(getattr(pa, "gpu", None)), summarize(getattr(pb, "gpu", None))
    if ga is None and gb is None:
        notes.append(f"{NO_GPU} on either side (GPU idle, overlap and kernel time need a trace "
                     "of a CUDA run); every CPU figure is compared")
    elif ga is None or gb is None:
        notes.append(f"{'A' if ga is None else 'B'}: {NO_GPU}; GPU figures are shown for "
                     f"{'B' if ga is None else 'A'} only")
    rows = _figures(ga, gb) if ga is not None or gb is not None else []
    gpu = pd.DataFrame(rows, columns=GPU_COLS)
    return gpu, _kernel_diff(kernels_by_module(pa.modules, na),
                             kernels_by_module(pb.modules, nb), descending)


def _kernel_diff(ka: Any, kb: Any, descending: bool) -> Any:
    import pandas as pd
    ka, kb = ka.set_index("module"), kb.set_index("module")
    k = pd.concat([ka["kernel_us"].rename("kernel_a_us"), kb["kernel_us"].rename("kernel_b_us")],
                  axis=1).fillna(0.0)
    k.index.name = "module"
    k = k.reset_index()
    types = pd.concat([kb["type"], ka["type"]])
    k.insert(1, "type", k["module"].map(types[~types.index.duplicated()]).fillna(""))
    k["delta_us"] = k["kernel_b_us"] - k["kernel_a_us"]
    return _ranked(k[KERNEL_COLS], descending)


def gpu_rank_diff(pa: Any, pb: Any, descending: bool) -> tuple[Any, Any]:
    """Each rank's GPU figures side by side (GPU_RANK_COLS; ranks of both runs, a rank on one
    side only with NaN on the other) and each rank's kernel time by module
    (KERNEL_RANK_COLS, largest change first within a rank). Empty when neither run has GPU
    events."""
    import pandas as pd
    ra, rb = _rank_table(pa), _rank_table(pb)
    rows: list[dict[str, Any]] = []
    if not (ra.empty and rb.empty):
        by_a = {int(r["rank"]): r for r in ra.to_dict("records")}
        by_b = {int(r["rank"]): r for r in rb.to_dict("records")}
        for rank in sorted(set(by_a) | set(by_b)):
            rows += [{"rank": rank, **row} for row in _figures(by_a.get(rank), by_b.get(rank))]
    ka, kb = _kernel_table(pa), _kernel_table(pb)
    frames = []
    for rank in sorted(set(ka["rank"]) | set(kb["rank"])):
        k = _kernel_diff(ka[ka["rank"] == rank].drop(columns="rank"),
                         kb[kb["rank"] == rank].drop(columns="rank"), descending)
        frames.append(k.assign(rank=int(rank))[KERNEL_RANK_COLS])
    kernels = (pd.concat(frames, ignore_index=True) if frames
               else pd.DataFrame(columns=KERNEL_RANK_COLS))
    return pd.DataFrame(rows, columns=GPU_RANK_COLS), kernels


def idle_part(gpu: Any, gpu_ranks: Any, slower_rank: int | None, sign: int,
              floor_us: float) -> tuple[str, float, float, float, int | None] | None:
    """(figure, A's us, B's us, change, the rank it is read on or None): the part of GPU idle
    time (host-bound, data-bound, communication) that moved the most in the verdict's
    direction, when both sides have GPU figures and it moved over `floor_us`. With several
    ranks it is read on `slower_rank`, the rank that got slower the most."""
    on_rank, table = None, gpu
    ranks = gpu_ranks if gpu_ranks is not None and not gpu_ranks.empty else None
    if ranks is not None and ranks["rank"].nunique() > 1 and slower_rank is not None:
        table = ranks[ranks["rank"] == slower_rank]
        on_rank = int(slower_rank)
    if table is None or table.empty:
        return None
    parts = table[table["key"].isin(_IDLE_PARTS)].dropna(subset=["a", "b"])
    if parts.empty:
        return None
    top = parts.loc[(sign * parts["delta"]).idxmax()]
    if sign * top["delta"] <= floor_us:
        return None
    return (str(top["figure"]), float(top["a"]), float(top["b"]), float(top["delta"]),
            on_rank)


def rank_lines(gpu_ranks: Any, slowest: tuple[Any, Any], slower_rank: int | None) -> list[str]:
    """Which rank is the slowest on each side and which got slower the most, with the GPU idle
    and its parts on those ranks, in words (the CLI and the dashboard)."""
    if gpu_ranks is None or gpu_ranks.empty or gpu_ranks["rank"].nunique() < 2:
        return []
    t = gpu_ranks.set_index(["rank", "key"])

    def idle(rank: Any, side: str) -> str:
        try:
            v = {k: float(t.loc[(int(rank), k), side]) for k in ("gpu_idle_us", *_IDLE_PARTS)}
        except (KeyError, TypeError, ValueError):
            return "no GPU figures"
        if any(math.isnan(x) for x in v.values()):
            return "no GPU figures"
        return (f"GPU idle {v['gpu_idle_us']:.4g} us a step (host-bound {v['host_wait_us']:.4g}, "
                f"data-bound {v['data_wait_us']:.4g}, communication {v['comm_wait_us']:.4g})")

    out = []
    for label, side, rank in (("A", "a", slowest[0]), ("B", "b", slowest[1])):
        if rank is not None:
            out.append(f"slowest rank in {label}: {rank}; {idle(rank, side)}")
    if slower_rank is not None:
        out.append(f"the rank that got slower the most: {slower_rank}; A {idle(slower_rank, 'a')}"
                   f" -> B {idle(slower_rank, 'b')}")
    return out
