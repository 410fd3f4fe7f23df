"""A process killed with SIGKILL while the async writer works leaves only complete step files
(every one readable, with the right content) plus partial files the reader ignores."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from tracer.storage._reader import open_dump

REPO = Path(__file__).resolve().parents[3]
RECORDS = 12

WRITER = f"""
import sys, torch
from tracer._config import DumpConfig
from tracer.storage import RecordMeta, make_writer
w = make_writer(DumpConfig(path=sys.argv[1], writer="async", mode="full",
                           async_max_queued_mb=8), rank=0, world_size=1)
step = 0
while True:  # until killed
    w.begin_step(step)
    for i in range({RECORDS}):
        w.add(RecordMeta(f"m{{i}}.forward.0.output.0", f"m{{i}}", "", "forward", "output", 0, 0,
                         "k.py:1"), torch.full((100_000,), float(step * 1000 + i)))
    w.end_step()
    step += 1
"""


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.0, 0.37])
def test_sigkill_leaves_complete_files_and_partials(tmp_path, delay):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("SLEUTH_DUMP_CONFIG", None)
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], env=env,
                            stderr=subprocess.PIPE)
    rank0 = tmp_path / "dump" / "rank0"
    deadline = time.monotonic() + 120
    try:
        while len(list(rank0.glob("step*.h5"))) < 3:
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "the writer made no files"
            time.sleep(0.02)
        time.sleep(delay)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        d = open_dump(tmp_path)
    for path, reason in d.skipped:
        assert path.endswith(".partial"), (path, reason)  # nothing complete-looking is broken
    steps = d.steps(0)
    assert len(steps) >= 3 and steps == list(range(len(steps)))
    for step in steps:
        df = d.stats(0, step)
        assert len(df) == RECORDS and d.attrs(0, step)["complete"] == 1
        for i, name in enumerate(df.name):
            t = d.tensor(0, step, name)
            assert t.shape == (100_000,) and np.all(t == step * 1000 + i)
            assert df["max"][i] == step * 1000 + i
