"""Table building on hand-made traces: clamping, device time, comm share, memory, inference."""
from __future__ import annotations

import gzip
import json

import pytest

from profiler._tables import build_tables
from profiler._trace import load_trace


def X(name, ts, dur, cat="cpu_op", tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur,
            "args": args}


def test_child_past_parent_end_is_clipped_and_negative_duration_clamped():
    # the child runs past its parent's end (clock skew), another event has a negative duration
    events = [X("ProfilerStep#0", 0, 100, cat="user_annotation"),
              X("aten::linear", 10, 50), X("aten::addmm", 12, 60), X("aten::relu", 70, -5)]
    t = build_tables({"traceEvents": events})
    ops = {r["name"]: r for r in t["ops"]}
    assert ops["aten::linear"]["cpu_self_us"] == 2.0  # the child counts up to its parent's end
    assert ops["aten::relu"]["cpu_total_us"] == 0.0
    assert all(r["cpu_self_us"] >= 0 for r in t["ops"])
    assert t["summary"]["clamped_events"] == 1  # only the negative duration is left


def test_range_opened_inside_a_dispatch_mode_is_no_child_of_it():
    # torch.profiler's trace of a step under a Python dispatch mode (the tracer's op level):
    # record_function's enter op runs through the mode, so ProfilerStep#0 begins inside a
    # PythonDispatchMode event and outlives it; each op is recorded twice, its outer record
    # around the mode's handler, which does the tracer's own work around the real op
    events = [X("PythonDispatchMode", 0, 10),
              X("ProfilerStep#0", 8, 200, cat="user_annotation"),
              X("aten::addmm", 20, 50), X("PythonDispatchMode", 22, 46),
              X("sleuth.tool::tracer", 25, 10, cat="user_annotation"),
              X("aten::sum", 27, 5),  # the tracer's statistics
              X("aten::addmm", 40, 20), X("aten::mm", 100, 30)]
    t = build_tables({"traceEvents": events})
    assert t["summary"]["clamped_events"] == 0
    ops = {r["name"]: r for r in t["ops"]}
    assert set(ops) == {"aten::addmm", "aten::mm"}  # no PythonDispatchMode, no tracer sum
    assert ops["aten::addmm"]["calls"] == 1 and ops["aten::addmm"]["cpu_total_us"] == 20
    s = t["summary"]
    # addmm's 50 us less the op's 20, and the first mode's last 2 us, which lie in the step
    assert s["dump_on"] and s["tools"] == {"tracer": 32.0}
    assert t["steps"][0]["tools_us"] == 32.0 and s["tool_share"] == pytest.approx(32 / 200)


def test_profile_without_tools_reports_none():
    t = build_tables({"traceEvents": [X("ProfilerStep#0", 0, 100, cat="user_annotation"),
                                      X("aten::mm", 10, 50)]})
    assert t["summary"]["tools"] == {} and not t["summary"]["dump_on"]
    assert t["steps"][0]["tools_us"] == 0.0 and t["summary"]["tool_share"] == 0.0


def test_device_time_comm_share_and_memory():
    events = [X("ProfilerStep#3", 0, 1000, cat="user_annotation"),
              X("aten::mm", 100, 50, **{"External id": 7}),
              X("c10d::allreduce_", 200, 100), X("gloo:all_reduce", 250, 100),
              X("aten::addmm", 600, 50, **{"External id": 9}),
              X("cudaLaunchKernel", 610, 5, cat="cuda_runtime", correlation=33),
              {"ph": "X", "cat": "kernel", "name": "gemm2", "pid": 0, "tid": 7, "ts": 700,
               "dur": 12, "args": {"correlation": 33, "External id": 999}},
              {"ph": "X", "cat": "kernel", "name": "sgemm", "pid": 0, "tid": 7, "ts": 120,
               "dur": 30, "args": {"External id": 7}},
              {"ph": "X", "cat": "kernel", "name": "ncclKernel_AllReduce", "pid": 0, "tid": 7,
               "ts": 400, "dur": 100, "args": {}},
              {"ph": "i", "name": "[memory]", "ts": 150, "pid": 1, "tid": 1,
               "args": {"Bytes": 4096, "Total Allocated": 8192, "Total Reserved": 16384,
                        "Device Type": 1, "Device Id": 0}}]
    t = build_tables({"traceEvents": events}, {"tokens_per_step": 1000, "flops_per_step": 2e9,
                                               "peak_tflops": 1.0})
    mm = next(r for r in t["ops"] if r["name"] == "aten::mm")
    assert mm["device_us"] == 30
    addmm = next(r for r in t["ops"] if r["name"] == "aten::addmm")
    assert addmm["device_us"] == 12  # through the runtime call's correlation id
    step = t["steps"][0]
    assert step["step"] == 3 and step["comm_us"] == pytest.approx(250)  # union of 200-350 and 400-500
    assert t["summary"]["comm_share"] == pytest.approx(0.25)
    assert t["memory"] == [{"time_us": 150.0, "device": "cuda:0", "bytes": 4096,
                            "allocated_bytes": 8192, "reserved_bytes": 16384}]
    s = t["summary"]
    assert s["tokens_per_s"] == pytest.approx(1000 / 1e-3)
    assert s["mfu"] == pytest.approx(2e9 / 1e-3 / 1e12)


def test_inferred_breakdown_without_labels_sums_to_step():
    events = [X("ProfilerStep#0", 0, 1000, cat="user_annotation"),
              X("aten::linear", 10, 300),
              X("autograd::engine::evaluate_function: AddmmBackward0", 400, 200),
              X("autograd::engine::evaluate_function: TBackward0", 650, 50),
              X("Optimizer.step#AdamW.step", 800, 150, cat="user_annotation")]
    row = build_tables({"traceEvents": events})["steps"][0]
    assert row["source"] == "inferred"
    assert row["forward_us"] == 400 and row["backward_us"] == 300 and row["optimizer_us"] == 150
    parts = sum(row[k] for k in ("data_us", "forward_us", "backward_us", "optimizer_us", "other_us"))
    assert parts == pytest.approx(row["step_us"])


def test_module_backward_is_attributed_by_sequence_number():
    events = [X("ProfilerStep#0", 0, 1000, cat="user_annotation"),
              X("sleuth.module::<root>", 10, 300, cat="user_annotation"),
              X("sleuth.module::fc", 20, 100, cat="user_annotation"),
              X("aten::linear", 30, 80, **{"Sequence number": 5}),
              X("aten::relu", 200, 20, **{"Sequence number": 6}),
              X("autograd::engine::evaluate_function: AddmmBackward0", 500, 40,
                **{"Sequence number": 5}),
              X("autograd::engine::evaluate_function: ReluBackward0", 560, 10,
                **{"Sequence number": 6}),
              X("aten::addmm", 32, 40, **{"External id": 11}),  # launches a kernel in fc
              X("aten::mm", 505, 20, **{"External id": 12}),    # inside AddmmBackward0
              {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": 40,
               "dur": 25, "args": {"External id": 11}},
              {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": 510,
               "dur": 7, "args": {"External id": 12}}]
    mods = {r["module"]: r for r in build_tables({"traceEvents": events},
                                                 {"module_types": {"fc": "Linear"}})["modules"]}
    assert mods["fc"]["type"] == "Linear" and mods["fc"]["backward_self_us"] == 40
    assert mods["<root>"]["backward_self_us"] == 10 and mods["<root>"]["backward_total_us"] == 50
    assert mods["<root>"]["forward_self_us"] == 200 and mods["fc"]["forward_total_us"] == 100
    assert mods["fc"]["forward_device_us"] == 25 and mods["<root>"]["forward_device_us"] == 25
    assert mods["fc"]["backward_device_us"] == 7 and mods["<root>"]["backward_device_us"] == 0


def test_load_trace_gz_and_errors(tmp_path):
    p = tmp_path / "t.json.gz"
    with gzip.open(p, "wt") as f:
        json.dump([X("a", 0, 1)], f)  # the bare-array Chrome format
    assert load_trace(p)["traceEvents"][0]["name"] == "a"
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    from profiler import ProfileFormatError
    with pytest.raises(ProfileFormatError, match="cannot read trace"):
        load_trace(bad)


def test_host_table_keeps_a_builtins_time_outside_the_ops_it_made(tmp_path):
    """`.tolist()` makes a tiny `aten::resolve_conj`, then builds its list outside any op: that
    time is the host's, at the line, paired across steps whatever the tensor's address; a
    builtin that is mostly its op (`torch.relu`) keeps only its wrapper's time, so nothing is
    counted in the ops and here both; a sleep makes no op and keeps all of its time; `list()`
    draining the user's generator keeps only its own time, not the generator's calls."""
    (tmp_path / "loop.py").write_text("import time, torch\n"            # 1
                                      "def main(w, x):\n"               # 2
                                      "    y = torch.relu(x)\n"         # 3
                                      "    w.tolist()\n"                # 4
                                      "    time.sleep(0.01)\n"          # 5
                                      "    list(v.numpy() for v in w)\n")  # 6
    events = []
    for step, (t0, address) in enumerate(((0, "0x7f01"), (1000, "0x7fab"))):
        events += [
            X(f"ProfilerStep#{step}", t0, 1000, cat="user_annotation"),
            X("loop.py(2): main", t0 + 1, 990, "python_function"),
            X("<built-in method relu of type object at 0x7e00>", t0 + 10, 50, "python_function"),
            X("aten::relu", t0 + 12, 46),
            X("aten::clamp_min", t0 + 14, 40),
            X(f"<built-in method tolist of Tensor object at {address}>", t0 + 100, 300,
              "python_function"),
            X("aten::resolve_conj", t0 + 101, 2),
            X("aten::resolve_neg", t0 + 104, 1),
            X("<built-in function sleep>", t0 + 500, 400, "python_function"),
            # list() drains a generator of the user's, which calls numpy() (line 6): the
            # generator's time is not list()'s, nor is the numpy() counted twice
            X("<built-in method list of type object at 0x7e01>", t0 + 910, 80,
              "python_function"),
            X("loop.py(6): <genexpr>", t0 + 915, 60, "python_function"),
            X(f"<built-in method numpy of Tensor object at {address}>", t0 + 920, 50,
              "python_function")]
    host = {r["name"]: r for r in
            build_tables({"traceEvents": events}, {"python_path": [str(tmp_path)]})["host"]}
    loop = tmp_path / "loop.py"
    tolist = host["<built-in method tolist of Tensor object>"]
    assert (tolist["calls"], tolist["time_us"], tolist["source"]) == (2, 2 * 297.0, f"{loop}:4")
    drained = host["<built-in method numpy of Tensor object>"]
    assert (drained["calls"], drained["time_us"], drained["source"]) == (2, 2 * 50.0, f"{loop}:6")
    listed = host["<built-in method list of type object>"]
    assert (listed["calls"], listed["time_us"], listed["source"]) == (2, 2 * 20.0, f"{loop}:6")
    relu = host["<built-in method relu of type object>"]
    assert (relu["calls"], relu["time_us"], relu["source"]) == (2, 2 * 4.0, f"{loop}:3")
    sleep = host["<built-in function sleep>"]
    assert (sleep["calls"], sleep["time_us"], sleep["source"]) == (2, 2 * 400.0, f"{loop}:5")
    assert len(host) == 5
