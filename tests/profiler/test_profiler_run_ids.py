"""The profiler's files carry the run id ($SLEUTH_RUN_ID), and its readers refuse to combine the
windows or summary segments of two runs, with one line naming both (`sleuth profile` exits 2)."""
from __future__ import annotations

import json

import h5py
import pytest

import profiler
from sleuth.cli import main

_EVENT = {"ph": "X", "name": "aten::mm", "ts": 1, "dur": 5, "tid": 1, "pid": 1, "cat": "cpu_op"}


def _window(run, rank: int, k: int, run_id: str | None) -> None:
    d = run / "profile" / f"rank{rank}"
    d.mkdir(parents=True, exist_ok=True)
    meta = {"format_version": "1.0", **({"run_id": run_id} if run_id is not None else {})}
    (d / f"window{k}.json").write_text(json.dumps(meta))
    (d / f"window{k}.trace.json").write_text(json.dumps({"traceEvents": [_EVENT]}))


def test_windows_of_two_runs_are_refused(tmp_path, capsys):
    run = tmp_path / "run"
    _window(run, 0, 0, "new-run")
    _window(run, 0, 1, "old-run")  # left by an earlier run that profiled longer
    with pytest.raises(profiler.ProfileFormatError, match="holds the profiles of 2 runs"):
        profiler.read_profile(run)
    assert main(["profile", str(run)]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "new-run" in line and "old-run" in line and "--overwrite" in line


def test_windows_of_one_run_and_windows_without_an_id_read(tmp_path):
    run = tmp_path / "run"
    _window(run, 0, 0, "one-run")
    _window(run, 1, 0, "one-run")
    _window(run, 1, 1, None)  # written before run ids
    assert profiler.read_profile(run).summary["windows"] == 3


def test_summary_segments_of_two_runs_are_refused(tmp_path):
    for run_id in ("first-run", "second-run"):  # the second finds rank0.h5: a new segment
        w = profiler.SummaryWriter(tmp_path, rank=0, run_id=run_id)
        w.add_scalar("loss", 1.0, 0)
        w.close()
    with h5py.File(tmp_path / "summary" / "rank0.seg1.h5", "r") as f:
        assert f.attrs["run_id"] == "second-run"
    with pytest.raises(profiler.ProfileFormatError, match="rank0.seg1.h5 belongs to run "
                                                          "second-run, but rank0.h5 to run first-run"):
        profiler.read_scalars(tmp_path)


def test_writers_take_the_run_id_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("SLEUTH_RUN_ID", "env-run")
    w = profiler.SummaryWriter(tmp_path, rank=0)
    w.close()
    with h5py.File(tmp_path / "summary" / "rank0.h5", "r") as f:
        assert f.attrs["run_id"] == "env-run"
    assert profiler.Collector(tmp_path).run_id == "env-run"
    w = profiler.SummaryWriter(tmp_path, rank=1)  # another rank of that run: read together
    w.add_scalar("loss", 2.0, 1)
    w.close()
    assert len(profiler.read_scalars(tmp_path)) == 1
