"""`sleuth train` in-process and through a subprocess; the trainer imports none of the tools."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from sleuth.cli import main
from trainer import read_metrics

TRAINER = Path(__file__).resolve().parents[2] / "trainer"


def test_sleuth_train_in_process(tmp_path, corpus, capsys):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"steps": 2, "data": {"train_files": [str(corpus[0])],
                                                    "val_files": [str(corpus[1])]}}))
    code = main(["train", "--config", str(cfg), "--set", "optim.lr=2e-3", "--set", "eval_every=2",
                 "--run-dir", str(tmp_path / "r")])
    out = capsys.readouterr().out
    assert code == 0
    assert re.search(r"step 1/1 loss \d+\.\d+ lr 1\.33e-03 grad_norm \d+\.\d+ tok/s", out)
    assert "eval step 1: loss" in out
    metrics = read_metrics(tmp_path / "r")
    assert [m["step"] for m in metrics] == [0, 1, 1]
    # the console numbers each step as metrics.jsonl (and the dump) do, from 0
    printed = [int(s) for s in re.findall(r"^step (\d+)/\d+ loss", out, re.M)]
    assert printed == [m["step"] for m in metrics if "loss" in m] == [0, 1]
    assert "steps 0-1 of 2" in out
    run = json.loads((tmp_path / "r" / "run.json").read_text())
    assert run["config"]["optim"]["lr"] == 2e-3 and run["argv"][0] == "sleuth"


def test_sleuth_train_errors(capsys):
    assert main(["train", "--set", "optim.lrr=1"]) == 2
    assert "did you mean 'optim.lr'?" in capsys.readouterr().err
    assert main(["train", "--set", "data.train_files=/nonexistent.jsonl", "--run-dir", "/tmp/x"]) == 2
    assert "/nonexistent.jsonl does not exist" in capsys.readouterr().err


def test_print_config(capsys):
    assert main(["train", "--preset", "small", "--set", "steps=5", "--print-config"]) == 0
    cfg = json.loads(capsys.readouterr().out)
    assert cfg["steps"] == 5 and cfg["model"]["n_embd"] == 256


@pytest.mark.slow
def test_sleuth_train_subprocess(sleuth_cli, tmp_path, corpus):
    out = sleuth_cli("train", "--set", "steps=1", "--set", f"data.train_files={corpus[0]}",
                     "--set", f"data.val_files={corpus[1]}", "--run-dir", str(tmp_path / "s"))
    assert out.returncode == 0, out.stderr
    assert "step 0/0 loss" in out.stdout and (tmp_path / "s" / "run.json").is_file()


def test_trainer_imports_no_tool():
    """The tools attach from outside; the rules every package shares (sleuth.common: run
    identity) are no tool."""
    pattern = re.compile(r"^\s*(from|import)\s+(tracer|profiler|irdump|dashboard|sleuth)\b"
                         r"(?!\.common\b)", re.M)
    offenders = [p.name for p in TRAINER.glob("*.py") if pattern.search(p.read_text())]
    assert offenders == []


@pytest.mark.slow
def test_nproc_refuses_before_starting_and_trains_on_two_ranks(sleuth_cli, tmp_path, corpus):
    """`sleuth train --nproc 2` starts torchrun's workers itself: into another run's folder it
    refuses in one line, exit 2, before any process starts (no torchrun report); otherwise
    both ranks train one run."""
    common = ["train", "--set", "steps=1", "--set", "batch_size=2", "--set", "eval_every=0",
              "--set", f"data.train_files={corpus[0]}", "--set", f"data.val_files={corpus[1]}",
              "--nproc", "2", "--run-dir", str(tmp_path / "r")]
    first = sleuth_cli(*common, env={"OMP_NUM_THREADS": "1"})
    assert first.returncode == 0, first.stderr[-3000:]
    run_id = json.loads((tmp_path / "r" / "run.json").read_text())["run_id"]
    for name in ("metrics.jsonl", "metrics.rank1.jsonl"):
        header = json.loads((tmp_path / "r" / name).read_text().splitlines()[0])
        assert header["run_id"] == run_id  # one run id, checked before the workers started
    again = sleuth_cli(*common)
    assert again.returncode == 2
    [line] = again.stderr.strip().splitlines()
    assert line.startswith("sleuth train: error:") and f"another run (run {run_id}" in line
    assert again.stdout == ""  # no worker started
    assert sleuth_cli("train", "--nproc", "0", "--run-dir", str(tmp_path / "z")).returncode == 2
