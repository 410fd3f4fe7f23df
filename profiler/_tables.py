"""Build the profile tables from one saved Chrome trace: ops, modules, steps, memory, comm.

Pure functions over the trace's event list (and the window's metadata), so they run after
training (`read_profile`, `sleuth profile`) instead of in the training loop, and are tested on
hand-made traces. Times in the tables are microseconds, as in the trace. The trace is read and
its events nested in profiler._trace (with the torch.profiler defects that nesting handles); an
op's and an autograd node's module, and the module table, come from profiler._attribution.

A defect handled here: CPU-only traces have no device events: device columns are 0, not
missing.
"""
from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from typing import Any

from profiler import _gpu_time
from profiler._attribution import (_BACKWARD_EVAL, MODULE_PREFIX, _module_rows, _node_seq,
                                   _op_module, _sleuth_module_name, _stack_module_name)
from profiler._own import tool_work
from profiler._sources import PYTHON_EVENT, LineFinder, user_line
from profiler._trace import _STEP_RE, _ancestors, _Ev, _nest, _union_us

PHASE_LABELS = ("data", "forward", "backward", "optimizer")
_COMM_RE = re.compile(r"^(c10d::|gloo:|nccl:|nccl|ProcessGroup|record_param_comms)", re.I)
_DEVICE_CATS = _gpu_time.DEVICE_CATS


def _shapes(args: dict[str, Any]) -> str:
    dims = args.get("Input Dims")
    if not dims:
        return ""
    return json.dumps(dims, separators=(",", ":"))


def _host_rows(host: list[_Ev], hidden: set[int], steps: list[_Ev],
               finder: LineFinder | None) -> list[dict[str, Any]]:
    """Time outside every op that a with_stack trace can still place: the user's calls of
    builtins (`time.sleep`, a socket read, `tensor.tolist()`), by the user line that called
    them, each call's time less the ops it made. A builtin that makes an op only to start with
    (`tolist` makes `aten::resolve_conj`, then builds its Python list outside any op) keeps the
    rest of its time here, which no op holds; a builtin that is mostly its op (`torch.relu`)
    keeps only its wrapper's time, so nothing is counted both here and in the ops. Python work
    of the user's own code is no such call and stays unplaced, also where a builtin called it
    back (a generator that `list()` drains), so no time is counted in two rows."""
    from profiler._sources import builtin_name, builtin_token, frame_of
    from sleuth.common import USER, short_frame_kind
    spans = [(st.ts, st.end) for st in steps]
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for ev in host:
        if ev.cat != PYTHON_EVENT or not ev.name.startswith("<built-in") or id(ev) in hidden:
            continue
        if spans and not any(a <= ev.ts < b for a, b in spans):
            continue
        p = ev.parent
        while p is not None and p.cat != PYTHON_EVENT:  # a range (ProfilerStep#N) between
            p = p.parent
        frame = frame_of(p.name) if p is not None else None
        if frame is None or short_frame_kind(frame[0]) != USER:  # the user's calls only
            continue
        made, stack = [], list(ev.children)
        while stack:  # the outermost ops below it: an op's own children are inside its time
            c = stack.pop()
            inner = frame_of(c.name) if c.cat == PYTHON_EVENT else None
            # the user's code it called back (`list(x.tolist() for x in xs)`): its builtins
            # are rows of their own, and its Python work is no call of this one
            if c.cat == "cpu_op" or inner is not None and short_frame_kind(inner[0]) == USER:
                made.append((max(c.ts, ev.ts), min(c.end, ev.end)))
            else:
                stack.extend(c.children)
        token = builtin_token(ev.name)
        line = (finder.find(frame, token, strict=True) if finder and token else "") or (
            finder.find(frame, None) if finder else f"{frame[0]}:{frame[1]}")
        name = builtin_name(ev.name)
        row = rows.setdefault((name, line), {"name": name, "source": line, "calls": 0,
                                             "time_us": 0.0})
        row["calls"] += 1
        row["time_us"] += max(0.0, ev.dur - _union_us(made))
    return list(rows.values())


def _profiled_at(meta: dict[str, Any]) -> float | None:
    """When the window was saved (its metadata's `created`), seconds since the epoch; None
    when it is missing or unreadable (source files are then not checked for changes)."""
    from datetime import datetime
    try:
        return datetime.fromisoformat(str(meta["created"])).timestamp()
    except (KeyError, ValueError, TypeError, OverflowError):
        return None


def build_tables(trace: dict[str, Any], meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """Tables of one window's trace.

    Returns a dict of plain row lists (`ops`, `modules`, `steps`, `memory`, `gpu`: GPU time
    per step, empty for a CPU trace, profiler._gpu_time) and `summary`
    (step_time_s, tokens_per_s, mfu, comm_share, clamped_events, ...). `meta` is the window's
    metadata written by the collector (flop counts, tokens per step, peak, module types).
    """
    meta = meta or {}
    raw = trace.get("traceEvents", [])
    host: list[_Ev] = []
    device: list[_Ev] = []
    memory_events: list[dict[str, Any]] = []
    negative_durations = 0
    for e in raw:
        if not isinstance(e, dict):
            continue
        ph = e.get("ph")
        if ph == "X":
            if float(e.get("dur", 0.0) or 0.0) < 0:
                negative_durations += 1
            ev = _Ev(e)
            if ev.cat == "gpu_user_annotation":
                # a range's span on a GPU stream (Kineto repeats record_function ranges there,
                # ProfilerStep#N too): as a host event it would be a second step or phase
                continue
            (device if ev.cat in _DEVICE_CATS else host).append(ev)
        elif ph == "i" and e.get("name") == "[memory]":
            memory_events.append(e)
    clamped = _nest(host) + negative_durations
    hidden, tool_pieces = tool_work(host)

    steps = sorted((ev for ev in host if _STEP_RE.match(ev.name)), key=lambda x: x.ts)
    if meta.get("steps") is not None:
        # only steps that ended with a step() call: the one begun by the last call before
        # close() never ran and would only drag the averages down
        done = {int(s) for s in meta["steps"]}
        steps = [st for st in steps if int(_STEP_RE.match(st.name).group(1)) in done]
    if steps:
        win0, win1 = steps[0].ts, max(s.end for s in steps)
    else:
        times = [ev.ts for ev in host] or [0.0]
        win0, win1 = min(times), max([ev.end for ev in host] or [0.0])

    if device:  # kernels linked by flow events only: their ids become correlation ids
        flow_starts, flow_ends = _gpu_time.flow_correlations(raw)
        for ev in device if flow_ends else ():
            if "correlation" not in ev.args and (cid := flow_ends.get((*ev.tid, ev.ts))) is not None:
                ev.args = {**ev.args, "correlation": cid}
        for ev in host if flow_starts else ():
            if (ev.cat in ("cuda_runtime", "cuda_driver") and "correlation" not in ev.args
                    and (cid := flow_starts.get((*ev.tid, ev.ts))) is not None):
                ev.args = {**ev.args, "correlation": cid}

    # Device time per launching host op: a kernel's "correlation" names the runtime call
    # (cudaLaunchKernel ...) that launched it, whose innermost enclosing cpu_op is the owner;
    # without a matching runtime event, the kernel's "External id" names the op.
    runtime = {ev.args["correlation"]: ev for ev in host
               if ev.cat in ("cuda_runtime", "cuda_driver") and "correlation" in ev.args}
    ext_to_op = {ev.args["External id"]: ev for ev in host
                 if ev.cat == "cpu_op" and "External id" in ev.args}
    by_ext: dict[int, float] = defaultdict(float)  # id(host op event) -> device us
    for k in device:
        owner = None
        rt = runtime.get(k.args.get("correlation"))
        if rt is not None:
            owner = rt.parent
            while owner is not None and owner.cat != "cpu_op":
                owner = owner.parent
        if owner is None:
            owner = ext_to_op.get(k.args.get("External id"))
        if owner is not None:
            by_ext[id(owner)] += k.dur

    # ---- modules --------------------------------------------------------------------------
    # sleuth's own ranges carry dotted names; with_stack's events are the fallback, never both
    _module_name = (_sleuth_module_name
                    if any(ev.name.startswith(MODULE_PREFIX) for ev in host)
                    else _stack_module_name)
    mods, seq_to_module, module_ranges = _module_rows(host, _module_name, by_ext, meta)

    # ---- ops ----------------------------------------------------------------------------
    flop_counts: dict[str, float] = meta.get("flop_counts") or {}
    n_steps = max(1, len(steps))
    ops: dict[tuple[str, str, str, str, str], dict[str, Any]] = {}
    # an op's module is named only from Sleuth's ranges (tracer.capture.CallNames' names), so
    # two profiles pair an op by the same module name; with_stack's class names are not those
    named, owners = _module_name is _sleuth_module_name and bool(module_ranges), {}
    stacks = any(ev.cat == PYTHON_EVENT for ev in host)
    frames: dict[tuple[int, bool], tuple[str, int]] = {}
    finder = (LineFinder([*(meta.get("python_path") or []), *sys.path, ""],
                         profiled_at=_profiled_at(meta), hashes=meta.get("source_hashes"),
                         call_lines=meta.get("module_call_lines"),
                         own_lines=meta.get("collector_call_lines"))
              if stacks else None)
    # a backward op's line is its forward op's (by its autograd node's Sequence number): the
    # user wrote that line; `loss.backward()` only ran it (a new cast's backward is the cast's)
    fwd_lines: dict[Any, tuple[str, str]] = {}
    if stacks:
        for ev in host:
            if (ev.cat == "cpu_op" and "Sequence number" in ev.args and id(ev) not in hidden
                    and _node_seq(ev) is None):
                lines = user_line(ev, frames, finder)
                if lines[0]:
                    fwd_lines.setdefault(ev.args["Sequence number"], lines)
    nodes: dict[int, Any] = {}
    for ev in host:
        if ev.cat != "cpu_op" or id(ev) in hidden:  # tool work is not the model's
            continue
        line, caller = "", ""
        if stacks:
            seq = _node_seq(ev, nodes)
            line, caller = ((fwd_lines.get(seq) if seq is not None else None)
                            or user_line(ev, frames, finder))
        key = (ev.name, _shapes(ev.args), line, caller,
               _op_module(ev, _module_name, seq_to_module, owners) if named else "")
        row = ops.get(key)
        if row is None:
            row = ops[key] = {"name": ev.name, "input_shapes": key[1], "source": key[2],
                              "caller": key[3], "module": key[4], "calls": 0, "cpu_total_us": 0.0,
                              "cpu_self_us": 0.0, "device_us": 0.0}
        row["calls"] += 1
        row["cpu_total_us"] += ev.dur
        row["cpu_self_us"] += ev.self_us
        row["device_us"] += by_ext.get(id(ev), 0.0)
    op_rows = list(ops.values())
    # FLOPs are counted per op name on one step; shared out over the shape groups by calls.
    calls_by_name: dict[str, int] = defaultdict(int)
    for row in op_rows:
        calls_by_name[row["name"]] += row["calls"]
    for row in op_rows:
        per_step = flop_counts.get(row["name"].replace("::", ".", 1))
        row["flops"] = (float(per_step) * n_steps * row["calls"] / calls_by_name[row["name"]]
                        if per_step is not None else float("nan"))

    # ---- steps ----------------------------------------------------------------------------
    labels = {f"sleuth.{p}": p for p in PHASE_LABELS}
    label_evs = [ev for ev in host if ev.name in labels]
    opt_evs = [ev for ev in host if ev.name.startswith(("Optimizer.step#", "Optimizer.zero_grad#"))]
    bwd_evs = [ev for ev in host if ev.name.startswith(_BACKWARD_EVAL)
               or ev.name.endswith(("Backward0", "Backward1"))]
    top_modules = [ev for ev in module_ranges
                   if not any(_module_name(a) is not None for a in _ancestors(ev))]
    comm_evs = [ev for ev in host + device if _COMM_RE.match(ev.name)]
    data_ranges = [(ev.ts, ev.end) for ev in host if _gpu_time.DATA_RANGE_RE.match(ev.name)]
    step_rows = []
    for st in steps:
        s0, s1 = st.ts, st.end
        row = {"step": int(_STEP_RE.match(st.name).group(1)), "step_us": st.dur}
        inside = [ev for ev in label_evs if ev.ts < s1 and ev.end > s0]
        if inside:
            row["source"] = "labels"
            for p in PHASE_LABELS:
                row[f"{p}_us"] = _union_us([(max(ev.ts, s0), min(ev.end, s1)) for ev in inside
                                            if labels[ev.name] == p])
        else:
            row["source"] = "inferred"
            # a plain loop's data loading: torch's own `enumerate(DataLoader)` range
            row["data_us"] = _union_us([(max(a, s0), min(b, s1)) for a, b in data_ranges
                                        if a < s1 and b > s0])
            opt = _union_us([(max(ev.ts, s0), min(ev.end, s1)) for ev in opt_evs
                             if ev.ts < s1 and ev.end > s0])
            bw = [ev for ev in bwd_evs if ev.ts < s1 and ev.end > s0]
            if bw:
                b0, b1 = max(s0, min(ev.ts for ev in bw)), min(s1, max(ev.end for ev in bw))
            else:
                b0 = b1 = s0
            row["optimizer_us"] = opt
            row["backward_us"] = max(0.0, b1 - b0)
            fw = [ev for ev in top_modules if ev.ts < s1 and ev.end > s0]
            if fw:
                row["forward_us"] = _union_us([(max(ev.ts, s0), min(ev.end, s1)) for ev in fw])
            elif bw:  # no module ranges: everything before the backward counts as forward
                row["forward_us"] = max(0.0, b0 - s0)
            else:
                row["forward_us"] = 0.0
        parts = sum(row[f"{p}_us"] for p in PHASE_LABELS)
        if parts > row["step_us"] > 0:  # overlapping phases: scale so the parts sum to the step
            for p in PHASE_LABELS:
                row[f"{p}_us"] *= row["step_us"] / parts
            parts = row["step_us"]
        row["other_us"] = max(0.0, row["step_us"] - parts)
        row["comm_us"] = _union_us([(max(ev.ts, s0), min(ev.end, s1)) for ev in comm_evs
                                    if ev.ts < s1 and ev.end > s0])
        # tool time sits inside the phases above; a piece's share is its overlap with the step
        row["tools_us"] = _union_us([(max(a, s0), min(b, s1)) for a, b, _ in tool_pieces
                                     if a < s1 and b > s0])
        step_rows.append(row)

    gpu_rows = _gpu_time.step_rows(
        [(int(_STEP_RE.match(st.name).group(1)), st.ts, st.end) for st in steps], device,
        data_ranges, [(ev.ts, ev.end) for ev in host if _COMM_RE.match(ev.name)])

    # ---- memory ---------------------------------------------------------------------------
    mem_rows = []
    for e in sorted(memory_events, key=lambda x: x.get("ts", 0.0)):
        a = e.get("args") or {}
        dev_type, dev_id = a.get("Device Type", 0), a.get("Device Id", -1)
        device_name = "cpu" if dev_type == 0 else f"cuda:{dev_id}" if dev_type == 1 else f"{dev_type}:{dev_id}"
        mem_rows.append({"time_us": float(e.get("ts", 0.0)) - win0, "device": device_name,
                         "bytes": int(a.get("Bytes", 0)),
                         "allocated_bytes": int(a.get("Total Allocated", 0)),
                         "reserved_bytes": int(a.get("Total Reserved", 0))})

    # ---- summary --------------------------------------------------------------------------
    step_time_s = (sum(r["step_us"] for r in step_rows) / len(step_rows) / 1e6) if step_rows else float("nan")
    tokens = meta.get("tokens_per_step")
    flops = meta.get("flops_per_step")
    peak = meta.get("peak_tflops")
    total_step_us = sum(r["step_us"] for r in step_rows)
    summary = {
        "steps": len(step_rows),
        "step_time_s": step_time_s,
        "tokens_per_s": (tokens / step_time_s) if tokens and step_rows else float("nan"),
        "flops_per_step": float(flops) if flops else float("nan"),
        "peak_tflops": float(peak) if peak else float("nan"),
        "mfu": (flops / step_time_s / (peak * 1e12)) if flops and peak and step_rows else float("nan"),
        "comm_share": (sum(r["comm_us"] for r in step_rows) / total_step_us) if total_step_us else 0.0,
        "clamped_events": clamped,
        "window_us": win1 - win0,
        "gpu": bool(device),
        # where each top-level module was called from (the collector's record), so a diff can
        # name a call site one run has and the other has not
        "module_call_lines": {str(k): [str(x) for x in v] for k, v in
                              (meta.get("module_call_lines") or {}).items()
                              if isinstance(v, list)},
        **_tool_summary(tool_pieces, step_rows, [(st.ts, st.end) for st in steps]),
    }
    return {"ops": op_rows, "modules": list(mods.values()), "steps": step_rows,
            "memory": mem_rows, "gpu": gpu_rows, "summary": summary,
            "host": _host_rows(host, hidden, steps, finder) if stacks else []}


def _tool_summary(pieces: list[tuple[float, float, str]], step_rows: list[dict[str, Any]],
                  spans: list[tuple[float, float]]) -> dict[str, Any]:
    """`tools`: microseconds per step of each tool's own work in the steps (e.g. {"tracer":
    812.5}); `tool_share`: the share of the step time that was tool work; `dump_on`: the tracer
    ran in the steps."""
    per_tool: dict[str, float] = {}
    for t in sorted({tool for _, _, tool in pieces}):
        us = sum(_union_us([(max(a, s0), min(b, s1)) for a, b, tool in pieces
                            if tool == t and a < s1 and b > s0]) for s0, s1 in spans)
        if us > 0:
            per_tool[t] = us / max(1, len(spans))
    total_step = sum(r["step_us"] for r in step_rows)
    return {"tools": per_tool,
            "tool_share": sum(r["tools_us"] for r in step_rows) / total_step if total_step else 0.0,
            "dump_on": "tracer" in per_tool}
