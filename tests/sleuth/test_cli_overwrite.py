"""One run per run directory through the CLI: `sleuth train` resumes into its own dump, a
re-run is refused with the fix, `--overwrite` replaces the old run; `sleuth run` gives all its
processes one run id, refuses another run's folder (and a finished run's reused id) before the
command starts, and passes --overwrite on."""
from __future__ import annotations

import argparse
import json

import h5py
import pytest

from sleuth._cmd_run import child_env
from sleuth.cli import main


def _ids(run) -> dict[str, str]:
    out = {}
    for p in sorted((run / "dump" / "rank0").glob("step*.h5")):
        with h5py.File(p, "r") as f:
            out[p.name] = f.attrs["run_id"]
    return out


@pytest.fixture(autouse=True)
def _no_run_id(monkeypatch):
    monkeypatch.delenv("SLEUTH_RUN_ID", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)


def test_train_resumes_into_its_dump_and_a_rerun_needs_overwrite(tmp_path, capsys):
    cfg = tmp_path / "dump.json"
    cfg.write_text(json.dumps({"steps": "all", "level": "module", "writer": "sync"}))
    run = tmp_path / "run"
    common = ["train", "--set", "steps=3", "--set", "eval_every=0", "--run-dir", str(run),
              "--dump", str(cfg)]
    assert main([*common, "--set", "stop_after=2"]) == 0
    first = _ids(run)
    assert len(first) >= 2 and len(set(first.values())) == 1
    # the documented workflow: the same run continues, no --overwrite
    assert main([*common, "--resume", "latest"]) == 0
    resumed = _ids(run)
    assert len(resumed) >= 2 and set(resumed.values()) == set(first.values())
    capsys.readouterr()

    metrics = (run / "metrics.jsonl").read_bytes()
    assert main(common) == 2  # a new run into the same directory
    err = capsys.readouterr().err
    assert "holds the files of another run" in err and "--overwrite" in err
    assert "Traceback" not in err
    assert _ids(run) == resumed  # nothing of the old dump was touched
    assert (run / "metrics.jsonl").read_bytes() == metrics

    assert main([*common, "--overwrite"]) == 0
    new = _ids(run)
    assert {"step0.h5", "step1.h5", "step2.h5"} <= set(new)
    assert len(set(new.values())) == 1 and set(new.values()) != set(first.values())
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines[1:]] == [0, 1, 2]  # the old run's lines: gone


def test_overwrite_without_a_dump_replaces_the_old_runs_dump_too(tmp_path, capsys):
    cfg = tmp_path / "dump.json"
    cfg.write_text(json.dumps({"steps": "0", "level": "module", "writer": "sync"}))
    run = tmp_path / "run"
    common = ["train", "--set", "steps=1", "--set", "eval_every=0", "--run-dir", str(run)]
    assert main([*common, "--dump", str(cfg)]) == 0
    assert main([*common, "--overwrite"]) == 0
    assert not (run / "dump").exists()  # no old dump left beside the new run

def test_sleuth_run_gives_its_processes_one_run_id_and_passes_overwrite_on(tmp_path):
    def args(*extra):
        ns = argparse.Namespace(run_dir=str(tmp_path), dump=None, profile=None, summary=False,
                                save_graphs=False, strict=False, overwrite=False)
        for key in extra:
            setattr(ns, key, True)
        return ns

    env = child_env(args(), base={})
    assert env["SLEUTH_RUN_ID"] and "SLEUTH_DUMP_OVERWRITE" not in env
    assert child_env(args(), base={})["SLEUTH_RUN_ID"] != env["SLEUTH_RUN_ID"]  # one per run
    assert child_env(args(), base={"SLEUTH_RUN_ID": "mine"})["SLEUTH_RUN_ID"] == "mine"
    assert child_env(args("overwrite"), base={})["SLEUTH_DUMP_OVERWRITE"] == "1"


def test_sleuth_run_refuses_before_starting_when_the_dump_holds_another_run(tmp_path, capsys):
    import torch

    import tracer
    from tests.tracer.models import MLP

    model = MLP()
    with tracer.Dumper(model, {"path": str(tmp_path), "writer": "sync"}):
        model(torch.randn(4, 8)).sum().backward()
    before = _ids(tmp_path)
    cfg = tmp_path / "dump.json"
    cfg.write_text(json.dumps({"writer": "sync"}))
    marker = tmp_path / "started"
    cmd = ["run", "--run-dir", str(tmp_path), "--dump", str(cfg), "--", "python", "-c",
           f"open({str(marker)!r}, 'w').close()"]
    assert main(cmd) == 2
    err = capsys.readouterr().err
    assert "holds the files of another run" in err and "--overwrite" in err
    assert not marker.exists() and _ids(tmp_path) == before  # never started, nothing touched
    cmd.insert(1, "--overwrite")
    assert main(cmd) == 0 and marker.exists()


_SCRIPT = """
import torch
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
"""


def _sleuth_run(sleuth_cli, tmp_path, *extra, env=None):
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    cfg = tmp_path / "dump.json"
    cfg.write_text(json.dumps({"steps": "all", "level": "module", "writer": "sync"}))
    return sleuth_cli("run", "--run-dir", str(tmp_path / "run"), "--dump", str(cfg), *extra,
                      "--", "python", str(script), env=env)


@pytest.mark.slow
def test_sleuth_run_refuses_a_reused_run_id_over_a_finished_dump(sleuth_cli, tmp_path):
    first = _sleuth_run(sleuth_cli, tmp_path)
    assert first.returncode == 0, first.stderr
    run = tmp_path / "run"
    run_id = json.loads((run / "run.json").read_text())["run_id"]
    before = {p.name: p.read_bytes() for p in (run / "dump" / "rank0").glob("step*.h5")}
    assert set(before) == {"step0.h5", "step1.h5"}

    again = _sleuth_run(sleuth_cli, tmp_path, env={"SLEUTH_RUN_ID": run_id})
    assert again.returncode == 2
    [line] = again.stderr.strip().splitlines()
    assert f"2 step file(s) of run {run_id}" in line and "would dump its steps from step 0" in line
    assert "--overwrite" in line and "Traceback" not in line
    assert {p.name: p.read_bytes() for p in (run / "dump" / "rank0").glob("step*.h5")} == before

    other = _sleuth_run(sleuth_cli, tmp_path, env={"SLEUTH_RUN_ID": "not-that-run"})
    assert other.returncode == 2 and f"another run (run {run_id}" in other.stderr

    replaced = _sleuth_run(sleuth_cli, tmp_path, "--overwrite", env={"SLEUTH_RUN_ID": run_id})
    assert replaced.returncode == 0, replaced.stderr
    assert "overwrite: removed" in replaced.stderr


def test_sleuth_run_refuses_a_folder_holding_another_runs_profile(tmp_path, capsys):
    window = tmp_path / "profile" / "rank0" / "window0.json"
    window.parent.mkdir(parents=True)
    window.write_text(json.dumps({"format_version": "1.0", "run_id": "old-run"}))
    marker = tmp_path / "started"
    cmd = ["run", "--run-dir", str(tmp_path), "--profile", "--", "python", "-c",
           f"open({str(marker)!r}, 'w').close()"]
    assert main(cmd) == 2
    err = capsys.readouterr().err
    assert "another run (run old-run: profile/)" in err and not marker.exists()
    assert not (tmp_path / "run.json").exists()


def test_sleuth_run_names_a_damaged_run_json_before_starting(tmp_path, capsys):
    (tmp_path / "run.json").write_text('{"run_id": "old-r')  # cut short
    marker = tmp_path / "started"
    cmd = ["run", "--run-dir", str(tmp_path), "--", "python", "-c",
           f"open({str(marker)!r}, 'w').close()"]
    assert main(cmd) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert f"{tmp_path / 'run.json'} is damaged (not JSON" in line and "--overwrite" in line
    assert "before run ids" not in line and not marker.exists()
    assert (tmp_path / "run.json").read_text() == '{"run_id": "old-r'


def test_a_command_that_cannot_start_leaves_no_run_behind(tmp_path, sleuth_cli):
    run = tmp_path / "y"
    proc = sleuth_cli("run", "--run-dir", str(run), "--", "no_such_command_here", cwd=tmp_path)
    assert proc.returncode == 2 and "cannot run 'no_such_command_here'" in proc.stderr
    assert not (run / "run.json").exists()  # a retry with the right command is not refused
    again = sleuth_cli("run", "--run-dir", str(run), "--", "python", "-c", "pass", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
