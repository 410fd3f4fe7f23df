"""`profiler.diff_profiles` names the line of a new top-level module call: B calls the model a
second time (a no_grad forward) from another line of the same loop. The ops of both calls are
given both lines (a frame names only its function), so the first cause says which of them B
alone calls from (the collector's record of each top-level call's line)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import profiler

REPO = Path(__file__).resolve().parents[2]

EXTRA = '''import sys, torch
import profiler

model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(32, 64)
extra = sys.argv[2] == "slow"
cfg = profiler.CollectorConfig(wait=0, warmup=1, active=5, with_stack=True)
with profiler.Collector(sys.argv[1], config=cfg) as c:
    for _ in range(6):
        loss = model(x).square().mean()
        loss.backward()
        if extra:
            with torch.no_grad():
                model(x)
        opt.step()
        opt.zero_grad()
        c.step()
'''


@pytest.mark.slow
def test_a_second_model_call_is_named_at_its_line(tmp_path):
    script = tmp_path / "extra.py"
    script.write_text(EXTRA)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for run, variant in (("a", "base"), ("b", "slow")):
        out = subprocess.run([sys.executable, str(script), str(tmp_path / run), variant],
                             env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
    lines = EXTRA.splitlines()
    new = f"{script}:{lines.index('                model(x)') + 1}"
    d = profiler.diff_profiles(tmp_path / "a", tmp_path / "b")
    assert d.new_call_sites == [("<root>", new)]
    if d.verdict != "slower":
        pytest.skip(f"the machine was too busy to time the steps: {d.headline()}")
    first = d.causes[0]
    assert "calls <root> in B only (calls 1 -> 2 a step)" in first and \
        f"extra.py:{lines.index('                model(x)') + 1} calls" in first, d.causes
    # the same run against itself: no new call site
    assert profiler.diff_profiles(tmp_path / "a", tmp_path / "a").new_call_sites == []
