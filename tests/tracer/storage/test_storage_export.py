"""`sleuth dump export`: one Parquet dataset of every rank's and step's statistics, equal to the
step files it came from, and never quiet about a step it could not read."""
from __future__ import annotations

import json
import os
from pathlib import Path

import h5py
import pandas as pd
import pytest
import torch

import tracer
from sleuth.cli import main
from tests.tracer.storage.test_dump_cli import damage_records
from tracer._config import DumpConfig
from tracer.storage import RecordMeta, make_writer


@pytest.fixture
def run(tmp_path: Path) -> Path:
    for rank in (0, 1, 2):
        w = make_writer(DumpConfig(path=str(tmp_path), writer="sync"), rank=rank, world_size=3)
        for step in (1, 2, 3):
            w.begin_step(step)
            for i in range(4):
                value = float(i + 10 * step + 100 * rank)
                w.add(RecordMeta(f"layers.{i}.forward.0.output.0", f"layers.{i}", "", "forward",
                                 "output", 0, 0, "model.py:7"), torch.full((4, 4), value))
            w.end_step()
        w.close()
    return tmp_path


def test_dataset_equals_the_step_files(run, capsys):
    assert main(["dump", "export", str(run)]) == 0
    assert "36 record(s) from 9 step file(s), 3 rank(s), steps 1-3" in capsys.readouterr().out
    out = run / "export.parquet"
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*.parquet")) == [
        f"rank={r}/step={s}/part-0.parquet" for r in range(3) for s in (1, 2, 3)]
    data = tracer.read_export(out)
    dump = tracer.open_dump(run)
    for rank in (0, 1, 2):
        for step in (1, 2, 3):
            got = data[(data["rank"] == rank) & (data["step"] == step)]
            want = dump.stats(rank, step)
            pd.testing.assert_frame_equal(
                got.drop(columns=["rank", "step", "status"]).reset_index(drop=True), want,
                check_dtype=True)
            assert set(got["status"]) == {"complete"}
    # a query across ranks, as a user would write it: the largest max per rank
    top = data.groupby("rank")["max"].max().to_dict()
    assert top == {0: 33.0, 1: 133.0, 2: 233.0}
    manifest = json.loads((out / "_sleuth_export.json").read_text())
    assert manifest["files"] == 9 and manifest["problems"] == [] and manifest["ranks"] == [0, 1, 2]


def test_pyarrow_reads_it_as_a_hive_dataset(run):
    import pyarrow.dataset as ds

    out = run / "out"
    tracer.export_parquet(run, out)
    table = ds.dataset(out, partitioning="hive").to_table(
        filter=(ds.field("rank") == 2) & (ds.field("step") == 3))
    assert table.num_rows == 4 and set(table.column("max").to_pylist()) == {230.0, 231.0, 232.0,
                                                                             233.0}


def test_unreadable_and_cut_short_steps_are_named(run, capsys):
    rank1 = run / "dump" / "rank1"
    damage_records(rank1 / "step2.h5")
    with h5py.File(run / "dump" / "rank2" / "step3.h5", "r+") as f:
        f.attrs["status"] = "interrupted"
        f.attrs["status_reason"] = "KeyboardInterrupt"
    (rank1 / "step3.h5").write_bytes((rank1 / "step3.h5").read_bytes()[:3000])
    assert main(["dump", "export", str(run), "--out", str(run / "x")]) == 1
    err = capsys.readouterr().err
    assert "rank 1 step 2 not exported (damaged)" in err
    assert "rank 1 step 3 not exported (truncated)" in err
    assert "rank 2 step 3 exported, cut short (interrupted)" in err
    data = tracer.read_export(run / "x")
    pairs = set(zip(data["rank"], data["step"]))
    assert pairs == {(r, s) for r in range(3) for s in (1, 2, 3)} - {(1, 2), (1, 3)}
    assert set(data[(data["rank"] == 2) & (data["step"] == 3)]["status"]) == {"interrupted"}
    problems = json.loads((run / "x" / "_sleuth_export.json").read_text())["problems"]
    assert sorted((p["rank"], p["step"], p["state"]) for p in problems) == [
        (1, 2, "damaged"), (1, 3, "truncated"), (2, 3, "interrupted")]


def test_an_existing_dataset_is_replaced_only_when_asked(run, capsys):
    out = run / "export.parquet"
    assert main(["dump", "export", str(run)]) == 0
    (run / "dump" / "rank0" / "step1.h5").unlink()
    assert main(["dump", "export", str(run)]) == 2
    assert "exists" in capsys.readouterr().err
    assert len(tracer.read_export(out)) == 36  # untouched
    assert main(["dump", "export", str(run), "--force"]) == 0
    assert len(tracer.read_export(out)) == 32
    assert not [p for p in run.iterdir() if p.name.startswith(".export")]


def test_a_crash_leaves_no_half_dataset(run, monkeypatch):
    import pyarrow.parquet as pq

    calls = []
    real = pq.write_table

    def failing(table, where, **kw):
        calls.append(where)
        if len(calls) == 4:
            raise OSError(28, "No space left on device")
        return real(table, where, **kw)

    monkeypatch.setattr(pq, "write_table", failing)
    with pytest.raises(OSError):
        tracer.export_parquet(run, run / "out")
    assert not (run / "out").exists()
    assert not [p for p in os.listdir(run) if "out" in p]


def test_bad_input_is_a_clear_error(tmp_path, capsys):
    assert main(["dump", "export", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert "Traceback" not in capsys.readouterr().err
    assert main(["dump", "export", str(tmp_path)]) == 2
    assert "--out" in capsys.readouterr().err
    with pytest.raises(tracer.TracerError, match="not a sleuth Parquet export"):
        tracer.read_export(tmp_path)


def test_exported_dump_reads_as_the_dump_does(run):
    """What the dashboard's Dumps page reads from an export: ranks, steps, one step's table
    (as the HDF5 reader gives it), a rank's every step, and a clear error for the rest."""
    from tracer.storage import ExportedDump, export_parquet, is_export

    out = run / "export.parquet"
    export_parquet(run, out)
    assert is_export(out) and not is_export(run)
    got, dump = ExportedDump(out), tracer.open_dump(run)
    assert got.ranks == [0, 1, 2] and got.steps(1) == [1, 2, 3] and got.skipped == []
    pd.testing.assert_frame_equal(got.stats(2, 3).drop(columns=["status"]), dump.stats(2, 3))
    pd.testing.assert_frame_equal(got.stats(rank=1).drop(columns=["status"]),
                                  dump.stats(rank=1))
    assert got.status(0, 1) == ("complete", "")
    with pytest.raises(tracer.DumpFormatError, match=r"no rank 0 step 9 .*steps of rank 0: "
                                                     r"\[1, 2, 3\]"):
        got.stats(0, 9)
    with pytest.raises(tracer.DumpFormatError, match="statistics only"):
        got.tensor(0, 1, "layers.0.forward.0.output.0")
    with pytest.raises(tracer.TracerError, match="not a sleuth Parquet export"):
        ExportedDump(run)


def test_an_out_that_holds_or_lies_in_the_dump_is_refused(run, capsys):
    """--out the run itself, its dump/ folder or a folder inside it: the dataset would
    replace the step files (--force) or mix with them. Refused; every step file stays."""
    files = sorted(p.relative_to(run) for p in run.rglob("*.h5"))
    for out in (run, run / "dump", run / "dump" / "rank0" / "x", run.parent):
        assert main(["dump", "export", str(run), "--out", str(out), "--force"]) == 2
        err = capsys.readouterr().err
        assert "is a folder of the dump, holds it or lies in it" in err, out
        assert f"--out {run / 'export.parquet'}" in err
    assert sorted(p.relative_to(run) for p in run.rglob("*.h5")) == files
    assert main(["dump", "export", str(run)]) == 0  # RUN/export.parquet, beside the dump


def test_a_step_file_of_another_run_is_named_not_dropped(run, tmp_path, capsys):
    """A step file another run wrote where this run's step would be: the export names it
    (exit 1), and the diff calls that step not read (exit 2), never "missing" or "same"."""
    import shutil

    other = tmp_path / "other"
    w = make_writer(DumpConfig(path=str(other), writer="sync"), rank=0, world_size=1)
    w.begin_step(4)
    w.add(RecordMeta("layers.0.forward.0.output.0", "layers.0", "", "forward", "output", 0, 0,
                     "model.py:7"), torch.ones(4))
    w.end_step()
    w.close()
    mixed = tmp_path / "mixed"
    shutil.copytree(run, mixed)
    shutil.copy(next(other.rglob("step4.h5")), mixed / "dump" / "rank0" / "step4.h5")
    assert main(["dump", "export", str(mixed), "--out", str(tmp_path / "x.parquet")]) == 1
    assert "rank 0 step 4 not exported (other_run)" in capsys.readouterr().err
    assert main(["diff", str(run), str(mixed), "--rank", "0"]) == 2
    out = capsys.readouterr().out
    assert "status: INCOMPLETE" in out and "written by another run" in out


def test_nothing_exported_is_an_error_and_a_left_out_step_says_why(run, tmp_path, capsys):
    from tracer.storage import ExportedDump

    damage_records(run / "dump" / "rank1" / "step2.h5")
    out = tmp_path / "part.parquet"
    assert main(["dump", "export", str(run), "--out", str(out)]) == 1
    capsys.readouterr()
    with pytest.raises(tracer.DumpFormatError, match=r"no rank 1 step 2 .*the export left it "
                                                     r"out \(damaged"):
        ExportedDump(out).stats(1, 2)
    for f in run.rglob("step*.h5"):
        if f != run / "dump" / "rank1" / "step2.h5":  # damaged already
            damage_records(f)
    assert main(["dump", "export", str(run), "--out", str(tmp_path / "none.parquet")]) == 2
    assert "nothing was exported" in capsys.readouterr().err


def test_a_forged_export_is_read_through_the_door(run, tmp_path_factory):
    """An export is read as untrusted as a dump: a partition named like a step it holds
    (`step=01`) never stands in for it, a partition that is a soft link out of the export is
    never read as its rows (it is named in `skipped`), a part that is a FIFO is refused
    without waiting on it, a manifest that is no object or whose problems are no objects is a
    TracerError, and a damaged part is a DumpFormatError from both readers."""
    import shutil

    from tracer.storage import ExportedDump, export_parquet

    out = run / "export.parquet"
    export_parquet(run, out)
    before = tracer.read_export(out)
    rows = len(before[(before["rank"] == 0) & (before["step"] == 1)])
    # a look-alike partition with other rows: step 1 stays the real one
    fake = out / "rank=0" / "step=01"
    shutil.copytree(out / "rank=1" / "step=1", fake)
    got = ExportedDump(out)
    assert got.steps(0) == [1, 2, 3]
    assert (got.stats(0, 1)["max"] == before[(before["rank"] == 0) & (before["step"] == 1)]
            ["max"].to_numpy()).all()
    shutil.rmtree(fake)
    # a partition leading out of the export
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    shutil.copytree(out / "rank=2" / "step=3", elsewhere / "p")
    os.symlink(elsewhere / "p", out / "rank=0" / "step=7")
    got = ExportedDump(out)
    assert got.steps(0) == [1, 2, 3] and any("step=7" in p for p, _ in got.skipped)
    assert len(tracer.read_export(out)) == len(before)
    (out / "rank=0" / "step=7").unlink()
    # a FIFO as a part
    part = out / "rank=0" / "step=2" / "part-0.parquet"
    saved = part.read_bytes()
    part.unlink()
    os.mkfifo(part)
    with pytest.raises(tracer.DumpFormatError, match="FIFO"):
        ExportedDump(out).stats(0, 2)
    part.unlink()
    # a damaged part
    part.write_bytes(saved[: len(saved) // 2])
    with pytest.raises(tracer.DumpFormatError, match="does not read"):
        ExportedDump(out).stats(0, 2)
    with pytest.raises(tracer.DumpFormatError, match="does not read"):
        tracer.read_export(out)
    part.write_bytes(saved)
    assert len(ExportedDump(out).stats(0, 1)) == rows
    # manifests of the wrong shape
    manifest = out / "_sleuth_export.json"
    good = json.loads(manifest.read_text())
    for forged in ([1, 2], {**good, "problems": [1]}, {**good, "problems": "none"}):
        manifest.write_text(json.dumps(forged))
        with pytest.raises(tracer.TracerError, match="not a sleuth Parquet export"):
            ExportedDump(out)
        with pytest.raises(tracer.TracerError, match="not a sleuth Parquet export"):
            tracer.read_export(out)
