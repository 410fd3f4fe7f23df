"""The command line's foundation: fast help without torch, exit codes, README and CI agree."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

import sleuth
from sleuth.cli import main

REPO = Path(__file__).resolve().parents[2]


def test_sleuth_all_is_pinned():
    assert sleuth.__all__ == ["__version__"]


def test_help_imports_no_torch_and_is_fast():
    code = ("import sys, time; t = time.perf_counter(); from sleuth.cli import build_parser; "
            "build_parser().format_help(); print(time.perf_counter() - t); "
            "print(sorted(m for m in ('torch', 'pandas', 'dash', 'h5py') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout.split("\n")
    assert out[1] == "[]", f"`sleuth --help` imported heavy modules: {out[1]}"
    assert float(out[0]) < 0.5


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for command in ("demo", "train", "generate", "run", "dump", "diff", "check", "profile", "ir",
                    "dashboard"):
        assert f"    {command} " in text or f"    {command}\n" in text, command


def test_no_command_prints_help_and_returns_2(capsys):
    assert main([]) == 2
    assert "usage: sleuth" in capsys.readouterr().out


def test_run_without_command_is_a_clear_error(capsys):
    assert main(["run", "--run-dir", "unused"]) == 2
    assert "no command given" in capsys.readouterr().err


def test_readme_holds_the_ci_test_command():
    ci = (REPO / ".ci" / "run").read_text().strip().splitlines()[-1]
    readme = (REPO / "README.md").read_text()
    assert ci in readme, "the README's test command and .ci/run drifted apart"
    assert "bash scripts/install.sh && sleuth demo" in readme


@pytest.mark.slow
def test_sleuth_run_and_train_end_with_one_line_of_their_own(tmp_path, sleuth_cli):
    """`sleuth run` printed nothing of its own on success; now one line says what is where."""
    script = tmp_path / "loop.py"
    script.write_text("import torch\nm = torch.nn.Linear(2, 2)\n"
                      "opt = torch.optim.SGD(m.parameters(), 0.1)\nfor _ in range(3):\n"
                      "    m(torch.ones(1, 2)).sum().backward(); opt.step()\nprint('mine')\n")
    run = tmp_path / "run"
    r = sleuth_cli("run", "--run-dir", str(run), "--dump", '{"steps": "0-1"}', "--", "python",
                   str(script))
    assert r.returncode == 0 and r.stdout == "mine\n", r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        f"sleuth run: run written to {run}: dump (2 steps); next: sleuth dashboard {run}")
    t = sleuth_cli("train", "--run-dir", str(tmp_path / "t"), "--set", "steps=2")
    assert t.returncode == 0, t.stderr
    assert t.stderr.strip().splitlines()[-1] == (
        f"sleuth train: run written to {tmp_path / 't'}: metrics.jsonl; next: "
        f"sleuth dashboard {tmp_path / 't'}")  # no checkpoint was asked for: none named
