"""`sleuth demo`: a re-run replaces its own earlier runs (without --overwrite, each run's files
then carry its one new id), its diff says first that B ran in bfloat16, it ends with `sleuth
explain`'s verdict before the dashboard, and stopping the dashboard writes nothing into the runs
it serves (they finished cleanly before it started)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_demo_starts_clean_and_stopping_it_writes_nothing(tmp_path):
    out = tmp_path / "demo"
    stale = out / "baseline" / "dump" / "rank0" / "step7.h5"  # a step this demo does not dump
    stale.parent.mkdir(parents=True)
    (out / "baseline" / "run.json").write_text("{}")
    stale.write_bytes(b"from an earlier demo")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "sleuth", "demo", "--steps", "1", "--out",
                             str(out), "--port", "0"], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "dashboard on http://" in line:
                break
        served = time.time()
        assert proc.poll() is None, "".join(lines)
        time.sleep(1.5)  # past any file-system timestamp granularity
        proc.send_signal(signal.SIGTERM)  # how a service manager or `kill` stops it
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = "".join(lines)
    assert f"removing the previous demo runs: {out / 'baseline'}" in text
    # what changed, said first; then the verdict on it, before the dashboard starts
    diff_at = text.index("== sleuth diff baseline bf16")
    explain_at = text.index("== sleuth explain baseline bf16")
    said = text[diff_at:explain_at].splitlines()
    assert said[1] == "status: diverged"
    assert said[2].startswith("B ran in bfloat16 where A ran in float32: "), said
    verdict = text[explain_at:].splitlines()[1]
    assert verdict.startswith("precision: the difference comes from rounding"), verdict
    assert f"op by op: sleuth explain {out / 'baseline'} {out / 'bf16'} --step 0" in text
    assert not stale.exists()
    files = [p for p in out.rglob("*") if p.is_file()]
    assert {"baseline", "bf16"} <= {p.relative_to(out).parts[0] for p in files}
    assert not [p for p in files if p.name == "flight_recorder.h5"], text
    late = [p for p in files if p.stat().st_mtime > served]
    assert not late, f"written after the dashboard started: {late}"
    # run again into the same folder: the demo replaces its own runs (no --overwrite asked),
    # and each run's step files carry that run's one new id
    before = {name: _ids(out / name) for name in ("baseline", "bf16")}
    again = subprocess.run([sys.executable, "-m", "sleuth", "demo", "--steps", "1", "--out",
                            str(out), "--no-serve"], cwd=tmp_path, env=env, text=True,
                           capture_output=True, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    for name in ("baseline", "bf16"):
        ids = _ids(out / name)
        assert "step0.h5" in ids and len(set(ids.values())) == 1
        assert set(ids.values()).isdisjoint(before[name].values())


def _ids(run: Path) -> dict[str, str]:
    """{step file name: the run id it carries} of rank 0's dump in `run`."""
    import h5py

    out = {}
    for p in sorted((run / "dump" / "rank0").glob("step*.h5")):
        with h5py.File(p, "r") as f:
            out[p.name] = f.attrs["run_id"]
    return out


def test_demo_leaves_a_folder_that_is_not_a_run_alone(tmp_path, sleuth_cli):
    mine = tmp_path / "demo" / "bf16" / "notes.txt"
    mine.parent.mkdir(parents=True)
    mine.write_text("mine")
    proc = sleuth_cli("demo", "--out", str(tmp_path / "demo"), "--no-serve")
    assert proc.returncode == 2
    assert f"{mine.parent} exists and is not a run directory (no run.json)" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert mine.read_text() == "mine"


@pytest.mark.slow
@pytest.mark.parametrize("command", ["demo", "dashboard"])
def test_a_busy_port_is_one_line_before_any_work(tmp_path, sleuth_cli, command):
    """The demo trained for 30-60 s before finding its port taken, then printed Werkzeug's
    text; now the port is checked first and named with the option that changes it."""
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        args = (["demo", "--out", str(tmp_path / "demo")] if command == "demo"
                else ["dashboard", str(tmp_path), "--no-browser"])
        (tmp_path / "run.json").write_text("{}")
        started = time.monotonic()
        r = sleuth_cli(*args, "--port", str(port), timeout=60)
        took = time.monotonic() - started
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.strip().splitlines() == [r.stderr.strip()], r.stderr
    assert f"port {port}" in r.stderr and "--port" in r.stderr and "Traceback" not in r.stderr
    assert took < 20 and not (tmp_path / "demo").exists()
