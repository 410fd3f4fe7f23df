"""The flight recorder: a run that dies (uncaught exception, SIGTERM) leaves
RUN/dump/rank0/flight_recorder.h5 with the statistics of its last steps."""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tracer.storage import FlightRecorder, read_flight_recorder

REPO = Path(__file__).resolve().parents[3]

SCRIPT = textwrap.dedent("""
    import os, signal, sys
    import torch, tracer
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = {{"path": sys.argv[1], "writer": "sync", "watch": [{{"condition": "nan_inf"}}]}}
    with tracer.Dumper(model, config):
        for step in range(5):
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            if step == 3:
                {action}
""")


def _run(tmp_path: Path, action: str, *, watch: bool = True) -> subprocess.CompletedProcess:
    import os

    env = {**os.environ, "PYTHONPATH": str(REPO), "SLEUTH_FLIGHT_STEPS": "2"}
    script = SCRIPT.format(action=action)
    if not watch:
        script = script.replace(', "watch": [{"condition": "nan_inf"}]', "")
        assert "watch" not in script
    return subprocess.run([sys.executable, "-c", script, str(tmp_path)],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=180)


@pytest.mark.slow
def test_uncaught_exception_writes_flight_recorder(tmp_path):
    res = _run(tmp_path, 'raise RuntimeError("loss exploded")')
    assert res.returncode == 1 and "loss exploded" in res.stderr  # the original error survives
    path = tmp_path / "dump" / "rank0" / "flight_recorder.h5"
    assert "flight recorder written to" in res.stderr
    df = read_flight_recorder(path)
    assert df.attrs["reason"] == "uncaught RuntimeError: loss exploded"
    assert sorted(set(df["step"])) == [2, 3]  # the last two steps, as configured
    assert (df["name"] == "0.forward.0.output.0").sum() == 2
    assert not list(path.parent.glob("*.partial"))


@pytest.mark.slow
def test_flight_recorder_runs_without_watchpoints(tmp_path):
    res = _run(tmp_path, 'raise RuntimeError("loss exploded")', watch=False)
    assert res.returncode == 1 and "loss exploded" in res.stderr
    df = read_flight_recorder(tmp_path / "dump" / "rank0" / "flight_recorder.h5")
    assert sorted(set(df["step"])) == [2, 3]
    assert {"forward", "backward", "optimizer"} <= set(df["phase"])


@pytest.mark.slow
def test_a_clean_close_disarms_the_flight_recorder(tmp_path):
    """A process that goes on after its dump closed cleanly (a notebook, a dashboard served
    from it) writes no flight recorder into the finished run when it later dies."""
    script = SCRIPT.format(action="pass") + textwrap.dedent("""
        print("closed", flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        """)
    env = {**__import__("os").environ, "PYTHONPATH": str(REPO), "SLEUTH_FLIGHT_STEPS": "2"}
    res = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True,
                         text=True, env=env, cwd=REPO, timeout=180)
    assert res.returncode == -signal.SIGTERM and "closed" in res.stdout, res.stderr
    assert not (tmp_path / "dump" / "rank0" / "flight_recorder.h5").exists()
    assert sorted(p.name for p in (tmp_path / "dump" / "rank0").glob("step*.h5")) == [
        f"step{i}.h5" for i in range(5)]


@pytest.mark.slow
def test_sigterm_writes_flight_recorder_and_still_terminates(tmp_path):
    res = _run(tmp_path, "os.kill(os.getpid(), signal.SIGTERM)")
    assert res.returncode == -signal.SIGTERM, res.stderr
    df = read_flight_recorder(tmp_path / "dump" / "rank0" / "flight_recorder.h5")
    assert df.attrs["reason"] == "SIGTERM" and 3 in set(df["step"])


def test_ring_buffer_keeps_last_steps_and_chains_hooks(tmp_path):
    rec = FlightRecorder(tmp_path / "f.h5", steps=2)
    for step in range(4):
        for seq in range(3):
            rec({"step": step, "seq": seq, "name": f"r{seq}", "min": 0.0, "numel": 1})
    assert [s for s, _ in rec.steps] == [2, 3] and len(rec.rows()) == 6
    from tracer import _crash

    # (another test's Dumper left open in this process may hold the hooks already: what this
    # recorder adds and takes away is its own listener)
    before_hook, before_sig = sys.excepthook, signal.getsignal(signal.SIGTERM)
    with rec.install():
        assert sys.excepthook is _crash._excepthook and rec._listener._key in _crash._listeners
        key = rec._listener._key
    assert key not in _crash._listeners
    assert sys.excepthook == before_hook and signal.getsignal(signal.SIGTERM) == before_sig
    rec.remove()  # idempotent
    df = read_flight_recorder(rec.save("test"))
    assert list(df["step"]) == [2, 2, 2, 3, 3, 3] and df.attrs["reason"] == "test"


def test_row_tuples_and_row_dicts_are_kept_alike(tmp_path):
    """A tracer writer hands the recorder /records tuples (no dict per record); other writers
    hand it observer dicts. Both end up as the same saved row."""
    from tracer.storage._format import RECORD_FIELDS

    row = (7, "fc.forward.0.output.0", "fc", "", "forward", "output", 0, 0, "float32", "3,4", 12,
           -1.5, 2.5, 0.25, 3.0, 0, 1, 0, 2, 12345, "train.py:9", -1, 0, "")
    by_tuple = FlightRecorder(tmp_path / "a.h5")
    by_tuple.add_row(row, 4)
    by_dict = FlightRecorder(tmp_path / "b.h5")
    by_dict({**dict(zip(RECORD_FIELDS, row)), "step": 4, "rank": 0})
    assert by_tuple.rows() == by_dict.rows()
    assert by_tuple.rows()[0][:3] == (4, 7, "fc.forward.0.output.0")
