"""`sleuth dashboard`: errors in-process, and a real server process that prints its address,
answers on loopback and stops on Ctrl-C."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from dashboard_helpers import REPO, free_port, write_run
from sleuth.cli import main


def test_missing_run_is_exit_2(tmp_path, capsys):
    assert main(["dashboard", str(tmp_path / "nope"), "--no-browser"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_help_names_the_options(capsys):
    try:
        main(["dashboard", "--help"])
    except SystemExit as e:
        assert e.code == 0
    out = capsys.readouterr().out
    for opt in ("--host", "--port", "--no-browser", "127.0.0.1"):
        assert opt in out


@pytest.mark.slow
def test_serves_and_stops_on_ctrl_c(tmp_path):
    run = write_run(tmp_path / "r", name="r", steps=10)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-m", "sleuth", "dashboard", str(run), "--port", str(port),
                             "--no-browser"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=REPO)
    try:
        line = proc.stdout.readline()
        assert f"http://127.0.0.1:{port}/" in line, line + proc.stderr.read()
        deadline = time.monotonic() + 20
        while True:
            try:
                body = urllib.request.urlopen(f"http://127.0.0.1:{port}/_sleuth/file/0/run.json", timeout=5).read()
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        assert b'"name": "r"' in body
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
