"""A profiled run prints nothing of torch's own routine lines (kineto's `USDT ...
profiler_start`/`profiler_stop`, c10's `CPUAllocator ... Memory block of unknown size`), while
the user's output and real errors still come through; and a run directory whose path holds a
quote or a backslash still gets its trace (torch's exporter wrote the path unescaped)."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parents[2]

_SCRIPT = """
import sys, torch
m = torch.nn.Linear(8, 8)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
for step in range(6):
    m(torch.randn(4, 8)).sum().backward()
    opt.step(); opt.zero_grad()
    print(f"user stdout {step}", flush=True)
    print(f"user stderr {step}", file=sys.stderr, flush=True)
"""


def _sleuth_run(tmp_path: Path, run_dir: Path) -> subprocess.CompletedProcess:
    script = tmp_path / "loop.py"
    script.write_text(_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("SLEUTH_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "sleuth", "run", "--run-dir", str(run_dir),
                           "--profile", "--", "python", str(script)], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=300)


@pytest.mark.slow
def test_a_profiled_run_prints_no_profiler_noise(tmp_path):
    r = _sleuth_run(tmp_path, tmp_path / "run")
    assert r.returncode == 0, r.stderr
    for noise in ("USDT", "profiler_start", "CPUAllocator", "Memory block of unknown size"):
        assert noise not in r.stderr, r.stderr
    assert all(f"user stdout {i}" in r.stdout for i in range(6)), r.stdout
    assert all(f"user stderr {i}" in r.stderr for i in range(6)), r.stderr
    assert list((tmp_path / "run" / "profile" / "rank0").glob("window0.trace.json.gz"))


@pytest.mark.slow
@pytest.mark.parametrize("name", ['quo"te', "back\\slash"])
def test_a_run_dir_with_a_quote_or_backslash_keeps_its_trace(tmp_path, name):
    run = tmp_path / name
    r = _sleuth_run(tmp_path, run)
    assert r.returncode == 0, r.stderr
    assert "ERROR" not in r.stderr and "FLOP counting failed" not in r.stderr, r.stderr
    trace = run / "profile" / "rank0" / "window0.trace.json.gz"
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    assert any(e.get("name") == "aten::addmm" for e in events)
    assert not [p.name for p in (run / "profile" / "rank0").iterdir() if "tmp" in p.name]


def test_the_filter_keeps_everything_but_the_routine_lines():
    from profiler._kineto import drop_noise

    noise = (b"USDT:2026-12-05 06:09:27 19527:19527 SyncActivityProfilerHandler.cpp:52] "
             b"profiler_start\n"
             b"[W1205 06:09:27.516670828 CPUAllocator.cpp:245] Memory block of unknown size was "
             b"allocated before the profiling started, profiler results will not include the "
             b"deallocation event\n"
             b"STAGE:2026-12-05 06:09:58 20651:20651 SyncActivityProfilerHandler.cpp:51] "
             b"Completed Stage: Warm Up\n")
    real = (b"ERROR:2026-12-05 06:11:37 23837:23837 output_json.cpp:1040] Failed to rename\n"
            b"Traceback (most recent call last):\n"
            b"user: profiler_start is my own word\n")
    assert drop_noise(noise + real) == real


def test_quiet_native_stderr_passes_real_output_through():
    code = ("import os, sys\n"
            "from profiler._kineto import quiet_native_stderr\n"
            "print('before', file=sys.stderr)\n"
            "with quiet_native_stderr():\n"
            "    os.write(2, b'USDT:x 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\\n')\n"
            "    os.write(2, b'a real error\\n')\n"
            "    print('a python warning', file=sys.stderr)\n"
            "print('after', file=sys.stderr)\n")
    env = {k: v for k, v in os.environ.items() if k != "SLEUTH_DEBUG"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                       env=env, timeout=60)
    assert r.stderr == "before\na real error\na python warning\nafter\n", r.stderr
