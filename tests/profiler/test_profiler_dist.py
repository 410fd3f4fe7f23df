"""Several ranks (a 2-process gloo run under torch.distributed.run) and zero-code attach."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import profiler

REPO = Path(__file__).resolve().parents[2]

DIST = textwrap.dedent("""
    import sys, time, torch, torch.distributed as dist
    import profiler
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 64)
    cfg = profiler.CollectorConfig(wait=0, warmup=1, active=2, activities=("cpu",),
                                   tokens_per_step=16, count_flops=False)
    with profiler.Collector(sys.argv[1], config=cfg) as c:
        for step in range(4):
            model(x).square().mean().backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
            if rank == 1:
                time.sleep(0.01)
            opt.step()
            opt.zero_grad()
            c.step()
    dist.destroy_process_group()
    # torch's gloo threads abort a rank now and then as the interpreter finalizes
    # (docs/frameworks.md, "An abort at exit"): exit handlers, then no C++ teardown
    import atexit, os, sys; atexit._run_exitfuncs(); sys.stdout.flush(); os._exit(0)
""")


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for var in ("SLEUTH_PROFILE", "SLEUTH_SUMMARY", "SLEUTH_DUMP_CONFIG", "SLEUTH_SAVE_GRAPHS"):
        env.pop(var, None)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_rank_cluster_table(tmp_path, capsys):
    script = tmp_path / "dist.py"
    script.write_text(DIST)
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
                        "--nproc_per_node=2", "--master_addr=127.0.0.1",
                        f"--master_port={_free_port()}", str(script), str(run)],
                       capture_output=True, text=True, env=_env(), timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    prof = profiler.read_profile(run)
    assert sorted(prof.cluster["rank"]) == [0, 1]
    assert (prof.cluster["comm_share"] > 0).all()
    assert prof.cluster["slowest"].sum() >= 1 and (prof.cluster["slowdown"] >= 1).all()
    assert prof.summary["ranks"] == 2 and prof.summary["slowest_rank"] in (0, 1)
    assert prof.summary["step_time_spread"] >= 0 and 0 < prof.summary["comm_share"] < 1
    assert len(prof.traces) == 2
    assert prof.steps.groupby("rank").size().tolist() == [2, 2]
    from sleuth.cli import main
    assert main(["profile", str(run)]) == 0
    out = capsys.readouterr().out
    assert "ranks:" in out and "slowest rank" in out


ATTACHED = textwrap.dedent("""
    import torch, profiler
    handle = profiler.attach_from_env()
    assert handle is not None
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(6):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    # no close: flushed at exit
""")


@pytest.mark.slow
def test_attach_from_env_profiles_and_summarizes(tmp_path):
    script = tmp_path / "user_script.py"
    script.write_text(ATTACHED)
    config = tmp_path / "profile.json"
    config.write_text('{"wait": 1, "warmup": 1, "active": 2, "activities": ["cpu"]}')
    run = tmp_path / "run"
    env = {**_env(), "SLEUTH_PROFILE": str(config), "SLEUTH_SUMMARY": "1",
           "SLEUTH_RUN_DIR": str(run)}
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                       timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    prof = profiler.read_profile(run)
    assert len(prof.traces) == 1 and len(prof.steps) == 2
    assert {"0", "1", "2"} <= set(prof.modules["module"])  # the Sequential's children
    scalars = profiler.read_scalars(run)
    assert set(scalars.tag) == {"lr/group0", "param_norm", "grad_norm"}
    assert sorted(scalars[scalars.tag == "grad_norm"].step) == list(range(6))
    hist = profiler.read_histograms(run)
    assert set(hist.step) == {0} and "weights/0.weight" in set(hist.tag)
