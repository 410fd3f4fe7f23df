"""One run per dump through the CLI: `sleuth train` resumes into its own dump, a re-run is
refused with the fix, `--overwrite` replaces the old dump; `sleuth run` gives all its processes
one run id and passes --overwrite on."""
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

    assert main(common) == 2  # a new run into the same directory
    err = capsys.readouterr().err
    assert "holds the dump of another run" in err and "--overwrite" in err
    assert "Traceback" not in err
    assert _ids(run) == resumed  # nothing of the old dump was touched

    assert main([*common, "--overwrite"]) == 0
    new = _ids(run)
    assert {"step0.h5", "step1.h5", "step2.h5"} <= set(new)
    assert len(set(new.values())) == 1 and set(new.values()) != set(first.values())
    assert (run / "metrics.jsonl").exists()  # not a dump file: kept


def test_overwrite_without_a_dump_is_an_error(tmp_path, capsys):
    assert main(["train", "--set", "steps=1", "--run-dir", str(tmp_path), "--overwrite"]) == 2
    assert "--overwrite replaces an old dump" in capsys.readouterr().err


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


@pytest.mark.slow
def test_demo_runs_again_into_its_own_folder(tmp_path, capsys):
    out = tmp_path / "demo"
    for _ in range(2):
        assert main(["demo", "--out", str(out), "--steps", "1", "--no-serve"]) == 0
    for name in ("baseline", "bf16"):
        ids = _ids(out / name)
        assert "step0.h5" in ids and len(set(ids.values())) == 1


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
    assert "holds the dump of an earlier run" in err and "--overwrite" in err
    assert not marker.exists() and _ids(tmp_path) == before  # never started, nothing touched
    cmd.insert(1, "--overwrite")
    assert main(cmd) == 0 and marker.exists()
