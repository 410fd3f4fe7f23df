"""GPU time on hand-made Chrome traces with kernels: idle time per step and why, compute and
communication overlap, kernel time by module (through correlation ids and flow events), the
same figures through read_profile, diff_profiles and the CLI; and CPU traces, which have none."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from profiler._gpu_time import NO_GPU, intersect, step_rows, subtract, union
from profiler._tables import build_tables

REPO = Path(__file__).resolve().parents[2]


def X(name, ts, dur, cat="cpu_op", pid=1, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur,
            "args": args}


def K(name, ts, dur, cat="kernel", stream=7, **args):
    """A device event on stream `stream` of GPU 0."""
    return X(name, ts, dur, cat=cat, pid=0, tid=stream, **args)


def gpu_trace(idle_gap: float = 0.0) -> dict:
    """Two steps. Step 0 (0-1000 us): data 0-100 with an H2D copy 50-70; module fc launches
    gemm 170-300 (correlation id in the kernel's args), module head launches gemv 330-380
    (linked by flow events only); backward's bwd_gemm 450-600 overlaps the all-reduce kernel
    500-700 on the comm stream, whose host call runs 600-650; the optimizer's adam 800-900.
    Step 1 (1000-1500 + idle_gap us): one kernel 1100-1200, the host busy elsewhere."""
    u = "user_annotation"
    end1 = 1500 + idle_gap
    return {"traceEvents": [
        X("ProfilerStep#0", 0, 1000, cat=u), X("ProfilerStep#1", 1000, 500 + idle_gap, cat=u),
        X("sleuth.data", 0, 100, cat=u),
        X("sleuth.forward", 100, 300, cat=u),
        X("sleuth.module::fc", 110, 190, cat=u),
        X("aten::addmm", 120, 80, **{"External id": 11}),
        X("cudaLaunchKernel", 150, 10, cat="cuda_runtime", correlation=1),
        X("sleuth.module::head", 300, 90, cat=u),
        X("aten::mm", 310, 70, **{"External id": 12}),
        X("cudaLaunchKernel", 320, 5, cat="cuda_runtime"),
        {"ph": "s", "cat": "ac2g", "id": 2, "pid": 1, "tid": 1, "ts": 320, "name": "ac2g"},
        {"ph": "f", "cat": "ac2g", "id": 2, "pid": 0, "tid": 7, "ts": 330, "bp": "e",
         "name": "ac2g"},
        X("sleuth.backward", 400, 300, cat=u),
        X("nccl:all_reduce", 600, 50),
        X("sleuth.optimizer", 700, 300, cat=u),
        X("aten::add_", 1010, end1 - 1020),
        K("Memcpy HtoD (Pageable -> Device)", 50, 20, cat="gpu_memcpy"),
        K("gemm", 170, 130, correlation=1, **{"External id": 11}),
        K("gemv", 330, 50),
        K("bwd_gemm", 450, 150),
        K("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 500, 200, stream=8),
        K("adam", 800, 100),
        K("late", 1100, 100),
        K("after the window", end1 + 10, 100),
    ]}


def test_interval_arithmetic():
    a = union([(5, 8), (0, 2), (1, 3), (9, 9)])
    assert a == [(0, 3), (5, 8)]
    assert intersect(a, [(2, 6)]) == [(2, 3), (5, 6)]
    assert subtract([(0, 10)], a) == [(3, 5), (8, 10)]
    assert step_rows([(0, 0, 10)], [], [], []) == []  # no device events: no GPU rows


def test_idle_split_overlap_and_copies_per_step():
    t = build_tables(gpu_trace())
    s0, s1 = t["gpu"]
    # busy: copy 20 + gemm 130 + gemv 50 + bwd_gemm 150 + adam 100; the comm kernel is not
    assert s0["step"] == 0 and s0["step_us"] == 1000 and s0["gpu_busy_us"] == 450
    assert s0["gpu_idle_us"] == 550
    # idle while communication runs: 600-700 (bwd_gemm ended, all-reduce still running)
    assert s0["comm_wait_us"] == 100
    # idle in the data phase: 0-50 and 70-100 (the copy ran 50-70)
    assert s0["data_wait_us"] == 80
    # the rest: 100-170, 300-330, 380-450, 700-800, 900-1000
    assert s0["host_wait_us"] == 370
    assert s0["host_wait_us"] + s0["data_wait_us"] + s0["comm_wait_us"] == s0["gpu_idle_us"]
    assert s0["compute_us"] == 430 and s0["comm_kernel_us"] == 200 and s0["copy_us"] == 20
    assert s0["overlap_us"] == 100  # bwd_gemm 450-600 under the all-reduce 500-700
    assert s1 == {"step": 1, "step_us": 500, "gpu_busy_us": 100, "gpu_idle_us": 400,
                  "host_wait_us": 400, "data_wait_us": 0, "comm_wait_us": 0, "compute_us": 100,
                  "comm_kernel_us": 0, "overlap_us": 0, "copy_us": 0}
    assert t["summary"]["gpu"] is True


def test_ranges_repeated_on_a_gpu_stream_are_no_second_step():
    trace = gpu_trace()
    trace["traceEvents"] += [K("ProfilerStep#0", 50, 850, cat="gpu_user_annotation"),
                             K("sleuth.forward", 170, 210, cat="gpu_user_annotation")]
    t = build_tables(trace)
    assert [r["step"] for r in t["steps"]] == [0, 1] and len(t["gpu"]) == 2
    assert t["steps"][0]["forward_us"] == 300 and t["gpu"][0]["gpu_idle_us"] == 550


def test_kernel_time_by_module_through_correlation_and_flow_events():
    mods = {r["module"]: r for r in build_tables(gpu_trace())["modules"]}
    assert mods["fc"]["forward_device_us"] == 130  # the kernel's correlation id
    assert mods["head"]["forward_device_us"] == 50  # the flow event's id only
    ops = {r["name"]: r for r in build_tables(gpu_trace())["ops"]}
    assert ops["aten::mm"]["device_us"] == 50


def test_cpu_trace_has_no_gpu_figures_and_keeps_the_cpu_ones():
    events = [e for e in gpu_trace()["traceEvents"] if e.get("pid") != 0]
    t = build_tables({"traceEvents": events})
    assert t["gpu"] == [] and t["summary"]["gpu"] is False
    step = t["steps"][0]
    assert step["data_us"] == 100 and step["forward_us"] == 300 and step["comm_us"] == 50
    assert {r["module"] for r in t["modules"]} == {"fc", "head"}


def _run(root: Path, trace: dict) -> Path:
    d = root / "profile" / "rank0"
    d.mkdir(parents=True)
    (d / "window0.trace.json").write_text(json.dumps(trace))
    return root


def test_read_profile_summary_and_words(tmp_path):
    import profiler

    p = profiler.read_profile(_run(tmp_path / "g", gpu_trace()))
    assert list(p.gpu["step"]) == [0, 1] and list(p.gpu["rank"]) == [0, 0]
    g = p.summary["gpu"]
    assert g["gpu_idle_us"] == 475 and g["host_wait_us"] == 385  # means of the two steps
    assert g["idle_share"] == pytest.approx(950 / 1500)
    assert g["overlap_share"] == 0.5
    text = "\n".join(profiler.summary_lines(p.summary))
    assert ("GPU idle 0.475 ms a step (63.3 % of it): host-bound 0.385 ms, data-bound 0.04 ms, "
            "waiting on communication 0.05 ms") in text
    assert "communication kernels 0.1 ms a step, 50 % overlapped by compute" in text
    cpu = profiler.read_profile(_run(tmp_path / "c", {"traceEvents": [
        e for e in gpu_trace()["traceEvents"] if e.get("pid") != 0]}))
    assert cpu.gpu.empty and cpu.summary["gpu"] is None
    assert NO_GPU in profiler.summary_lines(cpu.summary)


def test_diff_puts_gpu_figures_side_by_side(tmp_path):
    import profiler

    a = _run(tmp_path / "a", gpu_trace())
    b = _run(tmp_path / "b", gpu_trace(idle_gap=1000))  # step 1 waits 1 ms more on the host
    d = profiler.diff_profiles(a, b)
    g = d.gpu.set_index("key")
    assert g.loc["host_wait_us", "a"] == 385 and g.loc["host_wait_us", "b"] == 885
    assert g.loc["host_wait_us", "delta"] == 500
    assert g.loc["overlap_share", "a"] == g.loc["overlap_share", "b"] == 0.5
    k = d.kernels.set_index("module")
    assert k.loc["fc", "kernel_a_us"] == 65 and k.loc["head", "kernel_b_us"] == 25  # per step
    assert any(c.startswith("GPU idle: host-bound: +500 us a step") for c in d.causes)
    out = d.to_dict()
    assert out["gpu"][0]["figure"] == "GPU busy" and out["kernels"]
    cpu = _run(tmp_path / "c", {"traceEvents": [e for e in gpu_trace()["traceEvents"]
                                                if e.get("pid") != 0]})
    one = profiler.diff_profiles(a, cpu)
    assert f"B: {NO_GPU}; GPU figures are shown for A only" in one.notes
    assert math.isnan(one.gpu.set_index("key").loc["gpu_idle_us", "b"])


@pytest.mark.slow
def test_cli_diff_prints_gpu_time_or_says_cpu_trace(tmp_path):
    a = _run(tmp_path / "a", gpu_trace())
    b = _run(tmp_path / "b", gpu_trace(idle_gap=1000))
    cpu = _run(tmp_path / "c", {"traceEvents": [e for e in gpu_trace()["traceEvents"]
                                                if e.get("pid") != 0]})
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}

    def sleuth(*argv):
        return subprocess.run([sys.executable, "-m", "sleuth", "profile", *map(str, argv)],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=120)

    r = sleuth("diff", a, b, "--csv", tmp_path / "csv")
    assert r.returncode in (0, 1), r.stderr
    assert "GPU time (us per step; idle = host-bound" in r.stdout and "idle: host-bound" in r.stdout
    assert "kernel time by module" in r.stdout
    assert (tmp_path / "csv" / "gpu.csv").exists() and (tmp_path / "csv" / "kernels.csv").exists()
    r = sleuth("diff", cpu, cpu)
    assert r.returncode == 0, r.stderr
    assert f"{NO_GPU} on either side" in r.stdout
    r = sleuth(cpu)
    assert r.returncode == 0 and NO_GPU in r.stdout
    r = sleuth(a)
    assert r.returncode == 0 and "GPU idle 0.475 ms a step" in r.stdout


# ---- a trace shaped like torch.profiler 2.x's CUDA export (tests/profiler/cuda_trace.py) ------
DATA = Path(__file__).resolve().parent / "data"
# per step, worked out by hand from cuda_trace.py's timeline (us)
BASE = {"step_us": 1000, "gpu_busy_us": 570, "gpu_idle_us": 430,
        # idle: 0-85, 105-215, 515-520, 700-850, 880-890, 930-1000; of it, comm 700-800 (the
        # all-reduce runs, nothing else), data 0-60 (the DataLoader range), the rest the host's
        "host_wait_us": 270, "data_wait_us": 60, "comm_wait_us": 100,
        "compute_us": 550, "comm_kernel_us": 150, "overlap_us": 50, "copy_us": 20}
SLOW = {"step_us": 1300, "gpu_busy_us": 575, "gpu_idle_us": 725,
        # idle: 0-85, 105-215, 520-720, 820-840, 920-1150, 1180-1190, 1230-1300; comm: 920-940
        # (DDP's host call) and 950-1100 (the kernel); data 0-60; the rest the host's
        "host_wait_us": 495, "data_wait_us": 60, "comm_wait_us": 170,
        "compute_us": 550, "comm_kernel_us": 150, "overlap_us": 0, "copy_us": 25}


def fixture(name: str) -> dict:
    return json.loads((DATA / f"{name}.trace.json").read_text())


def test_fixture_is_what_the_generator_writes(tmp_path):
    import cuda_trace  # noqa: PLC0415 - beside this file

    cuda_trace.main(str(tmp_path))
    for name in cuda_trace.FIXTURES:
        assert (tmp_path / name).read_text() == (DATA / name).read_text(), name


@pytest.mark.parametrize("name,want", [("base_rank0", BASE), ("slow_rank1", SLOW)])
def test_cuda_fixture_every_gpu_figure(name, want):
    t = build_tables(fixture(name))
    assert [r["step"] for r in t["gpu"]] == [0, 1, 2]
    for row in t["gpu"]:
        assert {k: row[k] for k in want} == pytest.approx(want, abs=1e-3)
    # the CPU figures of the same steps: phases inferred from torch's own ranges
    step = t["steps"][0]
    assert step["data_us"] == pytest.approx(60, abs=1e-3)  # enumerate(DataLoader)
    assert step["forward_us"] == pytest.approx(240, abs=1e-3)  # fc1 + fc2's ranges
    assert step["backward_us"] == pytest.approx(200, abs=1e-3)  # the autograd thread's nodes
    assert step["optimizer_us"] == pytest.approx(155, abs=1e-3)  # step + zero_grad
    assert step["comm_us"] == pytest.approx(190, abs=1e-3)  # host call 40 + NCCL kernel 150
    assert t["summary"]["gpu"] is True


def test_cuda_fixture_kernels_by_module_and_op():
    t = build_tables(fixture("slow_rank1"))
    mods = {r["module"]: r for r in t["modules"]}
    # three steps: fc1's gemm 200 a step forward, its backward gemm 80; fc2's 100 and 100;
    # <root>'s forward holds both layers' (backward kernels are charged to the layer's node)
    assert (mods["fc1"]["forward_device_us"], mods["fc1"]["backward_device_us"]) == (600, 240)
    assert (mods["fc2"]["forward_device_us"], mods["fc2"]["backward_device_us"]) == (300, 300)
    assert mods["<root>"]["forward_device_us"] == 900
    ops = {(r["name"], r["module"]): r for r in t["ops"]}
    # the same op in two modules is two rows: the backward mm of each layer
    assert ops[("aten::mm", "fc1")]["device_us"] == 240 and ops[("aten::mm", "fc2")]["device_us"] == 300
    assert ops[("aten::copy_", "")]["device_us"] == pytest.approx(60)  # the H2D memcpy
    assert ops[("aten::_local_scalar_dense", "")]["device_us"] == pytest.approx(15)  # D2H
    assert ops[("nccl:all_reduce", "")]["device_us"] == pytest.approx(450)  # via ExC launches
    assert ops[("aten::_fused_adamw_", "")]["device_us"] == pytest.approx(120)


def _two_ranks(root: Path, rank1: str) -> Path:
    for rank, name in ((0, "base_rank0"), (1, rank1)):
        d = root / "profile" / f"rank{rank}"
        d.mkdir(parents=True)
        (d / "window0.trace.json").write_text((DATA / f"{name}.trace.json").read_text())
    return root


def test_cuda_fixture_per_rank_figures(tmp_path):
    import profiler

    p = profiler.read_profile(_two_ranks(tmp_path / "b", "slow_rank1"))
    r = p.gpu_ranks.set_index("rank")
    for rank, want in ((0, BASE), (1, SLOW)):
        assert {k: r.loc[rank, k] for k in want} == pytest.approx(want, abs=1e-3)
        assert r.loc[rank, "steps"] == 3
    assert r.loc[0, "idle_share"] == pytest.approx(0.43)
    assert r.loc[1, "idle_share"] == pytest.approx(725 / 1300)
    assert r.loc[0, "overlap_share"] == pytest.approx(1 / 3) and r.loc[1, "overlap_share"] == 0
    assert list(r["slowest"]) == [False, True] and p.summary["slowest_rank"] == 1
    k = p.kernels.set_index(["rank", "module"])
    assert k.loc[(1, "fc1"), "kernel_us"] == pytest.approx(280)  # per step of rank 1
    assert k.loc[(0, "fc2"), "forward_us"] == pytest.approx(100)
    pooled = p.summary["gpu"]  # all ranks' steps together
    assert pooled["host_wait_us"] == pytest.approx((270 + 495) / 2)


def test_cuda_fixture_diff_names_the_rank_that_got_slower(tmp_path):
    import profiler

    a = _two_ranks(tmp_path / "a", "base_rank1")
    b = _two_ranks(tmp_path / "b", "slow_rank1")
    d = profiler.diff_profiles(a, b)
    assert d.verdict == "slower" and d.slower_rank == 1
    assert d.sides["b"]["slowest_rank"] == 1
    g = d.gpu_ranks.set_index(["rank", "key"])
    assert g.loc[(1, "host_wait_us"), "delta"] == pytest.approx(225)
    assert g.loc[(1, "comm_wait_us"), "delta"] == pytest.approx(70)
    assert g.loc[(1, "overlap_share"), "a"] == pytest.approx(1 / 3)
    assert g.loc[(1, "overlap_share"), "b"] == 0
    assert g.loc[(0, "gpu_idle_us"), "delta"] == pytest.approx(0)
    assert any(c.startswith("GPU idle: host-bound on rank 1 (the rank that got slower the most): "
                            "+225 us a step (270 -> 495 us)") for c in d.causes), d.causes
    # the pooled figures stay: B's host-bound idle is the mean over both ranks' steps
    assert d.gpu.set_index("key").loc["host_wait_us", "b"] == pytest.approx(382.5)
    assert d.kernels_ranks.groupby("rank")["delta_us"].sum().abs().max() == pytest.approx(0)
    # the same op in two modules: two rows, each unchanged
    mm = d.ops[d.ops["name"] == "aten::mm"]
    assert sorted(mm["module"]) == ["fc1", "fc2"] and set(mm["side"]) == {"both"}
    assert set(d.ops[d.ops["side"] == "B only"]["name"]) == {"aten::item",
                                                            "aten::_local_scalar_dense"}


@pytest.mark.slow
def test_cuda_fixture_cli_prints_and_writes_every_table(tmp_path):
    a = _two_ranks(tmp_path / "a", "base_rank1")
    b = _two_ranks(tmp_path / "b", "slow_rank1")
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}

    def sleuth(*argv):
        return subprocess.run([sys.executable, "-m", "sleuth", "profile", *map(str, argv)],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=120)

    r = sleuth(b, "--csv", tmp_path / "one")
    assert r.returncode == 0, r.stderr
    assert "GPU time per rank" in r.stdout and "kernel time by module" in r.stdout
    for name in ("breakdown", "ops", "modules", "steps", "memory", "cluster", "gpu", "gpu_ranks",
                 "kernels", "host"):
        assert (tmp_path / "one" / f"{name}.csv").exists(), name
    import pandas as pd
    gpu = pd.read_csv(tmp_path / "one" / "gpu.csv")
    assert len(gpu) == 6 and gpu.loc[gpu["rank"] == 1, "host_wait_us"].tolist() == [495.0] * 3
    r = sleuth("diff", a, b, "--csv", tmp_path / "two")
    assert r.returncode == 1, r.stderr
    assert "GPU time per rank" in r.stdout
    assert "slowest rank in B: 1" in r.stdout
    assert "the rank that got slower the most: 1" in r.stdout
    for name in ("breakdown", "ops", "modules", "lines", "ranks", "sides", "gpu", "gpu_ranks",
                 "kernels", "kernels_ranks", "host"):
        assert (tmp_path / "two" / f"{name}.csv").exists(), name
    ranks = pd.read_csv(tmp_path / "two" / "gpu_ranks.csv")
    assert set(ranks["rank"]) == {0, 1}
