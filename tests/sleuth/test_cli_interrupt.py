"""Ctrl-C: every command stops with exit code 130 and one line, never a traceback, whether the
SIGINT comes to the whole process group (a terminal's Ctrl-C) or to sleuth's pid alone (`kill
-INT`, a scheduler). `sleuth run` used to exit 254 (the child's -2 through sys.exit), and
ignored a SIGINT sent to its pid alone."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

_LOOP = """
import time, torch
m = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
print("ready", flush=True)
while True:
    m(torch.randn(3, 4)).sum().backward()
    opt.step(); opt.zero_grad()
    time.sleep(0.02)
"""


def _interrupt(args: list[str], ready: str, *, group: bool, cwd: Path) -> tuple[int, str]:
    """Start `python -m sleuth ARGS` in a session of its own, wait for `ready` on its stdout,
    send SIGINT (to the group, as a terminal does, or to the pid), return (code, stderr)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.Popen([sys.executable, "-m", "sleuth", *args], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env, cwd=cwd,
                         start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = p.stdout.readline()
            if not line or ready in line:
                break
        time.sleep(0.5)
        if group:
            os.killpg(p.pid, signal.SIGINT)
        else:
            os.kill(p.pid, signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return p.returncode, err


@pytest.mark.slow
@pytest.mark.parametrize("group", [True, False], ids=["group", "pid"])
def test_sleuth_run_exits_130(tmp_path, group):
    script = tmp_path / "loop.py"
    script.write_text(_LOOP)
    code, err = _interrupt(["run", "--run-dir", str(tmp_path / "run"), "--", "python",
                            str(script)], "ready", group=group, cwd=tmp_path)
    assert code == 130, err
    assert "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("sleuth run: interrupted"), err
    # the child says where it stopped, in the user's script, in one line
    assert f"KeyboardInterrupt at {script}:" in err, err


@pytest.mark.slow
@pytest.mark.parametrize("group", [True, False], ids=["group", "pid"])
def test_sleuth_train_exits_130(tmp_path, group):
    code, err = _interrupt(["train", "--run-dir", str(tmp_path / "run"), "--set", "steps=100000"],
                           "step 1", group=group, cwd=tmp_path)
    assert code == 130, err
    assert "Traceback" not in err and err.strip() == "sleuth train: interrupted", err
