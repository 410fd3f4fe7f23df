"""GPU time of a profiled step: idle time and why, compute/communication overlap, kernels by module.

Pure functions over a trace's device events (categories `kernel`, `gpu_memcpy`, `gpu_memset`),
called by `profiler._tables.build_tables`; a trace without device events (a CPU run) has no GPU
figures, and says so (`NO_GPU`), while every CPU figure stays as it was. Times are microseconds.

Definitions, per step (the `ProfilerStep#N` range), all over the union of events of all streams:

- `gpu_busy_us`: time with any device work running that is not communication (compute kernels,
  copies, memsets). `gpu_idle_us` = step time - `gpu_busy_us`: the GPU's compute sits idle.
- the idle time split in three parts that sum to it, in this order of precedence:
  `comm_wait_us`, idle while a communication kernel (NCCL, RCCL) or a host communication call
  (c10d, gloo, nccl ranges) runs: the step waits on communication; `data_wait_us`, the rest of
  the idle time inside the step's data loading (the trainer's `sleuth.data` label, or torch's
  `enumerate(DataLoader)` range); `host_wait_us`, the rest: the GPU waits while the host
  launches (Python, the dispatcher, a `.item()` sync, the optimizer's many small kernels).
- `compute_us`: union of compute kernels (`kernel` events that are not communication);
  `comm_kernel_us`: union of communication kernels; `overlap_us`: the time both run at once.
  The overlap share is `overlap_us / comm_kernel_us`: the part of communication hidden under
  compute (1.0: fully hidden; 0: the compute waited for every collective).

Kernel time by module comes from the module table's device columns (`forward_device_us`,
`backward_device_us`), where each kernel is charged to the host op that launched it: the
kernel's `correlation` id names its runtime call (cudaLaunchKernel), whose enclosing op lies in
the module's range; `flow_correlations` recovers that id from the trace's flow events (`ac2g`)
for traces whose kernels lack it.
"""
from __future__ import annotations

import re
from typing import Any

NO_GPU = "CPU trace: no GPU figures"
"""What a report says instead of GPU figures when a trace holds no device events."""

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
COMM_KERNEL_RE = re.compile(r"nccl|rccl", re.I)
"""Communication kernels, by name (ncclDevKernel_AllReduce_..., ncclKernel_..., rccl...)."""
DATA_RANGE_RE = re.compile(r"^(sleuth\.data$|enumerate\(DataLoader\))")
"""Host ranges that load the step's data: the trainer's label, torch's DataLoader range."""

STEP_COLUMNS = ["step", "step_us", "gpu_busy_us", "gpu_idle_us", "host_wait_us", "data_wait_us",
                "comm_wait_us", "compute_us", "comm_kernel_us", "overlap_us", "copy_us"]
"""The per-step GPU table's columns (`Profile.gpu`)."""

Intervals = list[tuple[float, float]]


# ---- interval arithmetic over sorted, disjoint lists ---------------------------------------------
def union(intervals: Intervals) -> Intervals:
    """The intervals merged into a sorted list of disjoint ones (empty ones dropped)."""
    out: Intervals = []
    for s, e in sorted(i for i in intervals if i[1] > i[0]):
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def length(a: Intervals) -> float:
    return sum(e - s for s, e in a)


def clip(a: Intervals, s0: float, s1: float) -> Intervals:
    return [(max(s, s0), min(e, s1)) for s, e in a if s < s1 and e > s0]


def intersect(a: Intervals, b: Intervals) -> Intervals:
    """Intersection of two disjoint sorted lists."""
    out: Intervals = []
    i = j = 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: Intervals, b: Intervals) -> Intervals:
    """`a` without `b` (both disjoint sorted lists)."""
    out: Intervals = []
    j = 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:
            j += 1
        k, cur = j, s
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


# ---- per-step figures ----------------------------------------------------------------------------
def is_comm_kernel(name: str) -> bool:
    return bool(COMM_KERNEL_RE.search(name))


def step_rows(steps: list[tuple[int, float, float]], device: list[Any], data_ranges: Intervals,
              host_comm: Intervals) -> list[dict[str, Any]]:
    """The GPU table of one window: one row per step `(number, start, end)` (STEP_COLUMNS).

    `device`: the device events (objects with `name`, `cat`, `ts`, `end`); `data_ranges`: the
    host's data-loading ranges; `host_comm`: the host's communication calls. Empty when there
    are no device events (a CPU trace).
    """
    if not device:
        return []
    compute = union([(k.ts, k.end) for k in device
                     if k.cat == "kernel" and not is_comm_kernel(k.name)])
    comm = union([(k.ts, k.end) for k in device if is_comm_kernel(k.name)])
    copies = union([(k.ts, k.end) for k in device if k.cat != "kernel"])
    busy = union(compute + copies)
    data, comm_host = union(data_ranges), union(host_comm)
    rows = []
    for number, s0, s1 in steps:
        step_busy = clip(busy, s0, s1)
        idle = subtract([(s0, s1)], step_busy)
        waiting_comm = intersect(idle, union(clip(comm, s0, s1) + clip(comm_host, s0, s1)))
        rest = subtract(idle, waiting_comm)
        waiting_data = intersect(rest, clip(data, s0, s1))
        step_compute, step_comm = clip(compute, s0, s1), clip(comm, s0, s1)
        rows.append({
            "step": int(number), "step_us": s1 - s0, "gpu_busy_us": length(step_busy),
            "gpu_idle_us": length(idle), "host_wait_us": length(subtract(rest, waiting_data)),
            "data_wait_us": length(waiting_data), "comm_wait_us": length(waiting_comm),
            "compute_us": length(step_compute), "comm_kernel_us": length(step_comm),
            "overlap_us": length(intersect(step_compute, step_comm)),
            "copy_us": length(clip(copies, s0, s1))})
    return rows


def summarize(gpu: Any) -> dict[str, Any] | None:
    """Per-step means of a GPU table (all ranks and windows), plus the shares a user reads:
    `idle_share` of the step, `overlap_share` of the communication kernels' time. None for a
    CPU trace (an empty table). A share that cannot be computed (no communication) is None,
    so the dict stays plain JSON."""
    if gpu is None or gpu.empty:
        return None
    out: dict[str, Any] = {c: float(gpu[c].mean()) for c in STEP_COLUMNS if c != "step"}
    step, comm = float(gpu["step_us"].sum()), float(gpu["comm_kernel_us"].sum())
    out["idle_share"] = float(gpu["gpu_idle_us"].sum()) / step if step > 0 else None
    out["overlap_share"] = float(gpu["overlap_us"].sum()) / comm if comm > 0 else None
    return out


RANK_COLUMNS = ["rank", "steps", *(c for c in STEP_COLUMNS if c != "step"), "idle_share",
                "overlap_share", "slowest"]
"""The per-rank GPU table's columns (`Profile.gpu_ranks`): per-step means of each rank."""


def summarize_ranks(gpu: Any, slowest: int | None = None) -> Any:
    """`summarize` for each rank of a GPU table: one row per rank (RANK_COLUMNS), `slowest`
    marking rank `slowest` (the cluster's slowest by step time; None: the rank whose GPU steps
    are longest). Empty for a CPU trace."""
    import pandas as pd
    if gpu is None or gpu.empty or "rank" not in gpu:
        return pd.DataFrame(columns=RANK_COLUMNS)
    rows = []
    for rank, g in gpu.groupby("rank", sort=True):
        rows.append({"rank": int(rank), "steps": int(len(g)), **summarize(g)})
    out = pd.DataFrame(rows)
    if slowest is None:
        slowest = int(out.loc[out["step_us"].idxmax(), "rank"])
    out["slowest"] = out["rank"] == slowest
    return out[RANK_COLUMNS]


def kernels_by_rank(modules: Any, steps: Any) -> Any:
    """`kernels_by_module` for each rank: rank, module, type, forward_us, backward_us,
    kernel_us per step of that rank (its own count of profiled steps), largest first within
    each rank; empty without device time."""
    import pandas as pd
    cols = ["rank", "module", "type", "forward_us", "backward_us", "kernel_us"]
    if modules is None or modules.empty or "rank" not in modules:
        return pd.DataFrame(columns=cols)
    counts = steps.groupby("rank").size() if steps is not None and not steps.empty else {}
    frames = []
    for rank, g in modules.groupby("rank", sort=True):
        k = kernels_by_module(g, int(counts.get(rank, 1)) if len(counts) else 1)
        if not k.empty:
            frames.append(k.assign(rank=int(rank)))
    if not frames:
        return pd.DataFrame(columns=cols)
    return pd.concat(frames, ignore_index=True)[cols]


def kernels_by_module(modules: Any, n_steps: int) -> Any:
    """Kernel time per module and step (forward, backward, total; nested modules included, as
    in the module table), largest first; empty without device time."""
    import pandas as pd
    cols = ["module", "type", "forward_us", "backward_us", "kernel_us"]
    if modules is None or modules.empty or "forward_device_us" not in modules:
        return pd.DataFrame(columns=cols)
    g = modules.groupby("module", dropna=False).agg(
        type=("type", "first"), forward_us=("forward_device_us", "sum"),
        backward_us=("backward_device_us", "sum")).reset_index()
    g[["forward_us", "backward_us"]] = g[["forward_us", "backward_us"]].astype(float) / max(1, n_steps)
    g["kernel_us"] = g["forward_us"] + g["backward_us"]
    g = g[g["kernel_us"] > 0]
    return g.sort_values("kernel_us", ascending=False, kind="stable").reset_index(drop=True)[cols]


def flow_correlations(raw: list[Any]) -> tuple[dict[Any, Any], dict[Any, Any]]:
    """The trace's CPU-to-GPU flow events (`ac2g`) as two maps keyed by (pid, tid, ts): where a
    flow starts (the runtime call) and where it ends (the kernel), each to the flow's id, which
    torch.profiler sets to the correlation id."""
    starts: dict[Any, Any] = {}
    ends: dict[Any, Any] = {}
    for e in raw:
        if not isinstance(e, dict) or e.get("cat") != "ac2g" or "id" not in e:
            continue
        key = (e.get("pid"), e.get("tid"), float(e.get("ts", 0.0)))
        if e.get("ph") == "s":
            starts[key] = e["id"]
        elif e.get("ph") == "f":
            ends[key] = e["id"]
    return starts, ends


def gpu_lines(g: dict[str, Any] | None) -> list[str]:
    """The GPU figures in words (`summary_lines` and the dashboard), or NO_GPU."""
    if not g:
        return [NO_GPU]

    def ms(v: float) -> str:
        return f"{v / 1e3:.3g} ms"

    def pct(v: float) -> str:
        return "n/a" if v is None or v != v else f"{v * 100:.3g} %"

    line = (f"GPU idle {ms(g['gpu_idle_us'])} a step ({pct(g['idle_share'])} of it): host-bound "
            f"{ms(g['host_wait_us'])}, data-bound {ms(g['data_wait_us'])}, waiting on "
            f"communication {ms(g['comm_wait_us'])}")
    comm = (f"communication kernels {ms(g['comm_kernel_us'])} a step, "
            f"{pct(g['overlap_share'])} overlapped by compute" if g["comm_kernel_us"] > 0
            else "no communication kernels")
    return [line, f"GPU compute kernels {ms(g['compute_us'])} a step; {comm}"]
