"""`sleuth check` never says clean about data it did not read: partial-only and empty rank
folders, a damaged earlier step under `--first-nan`, interrupted steps."""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import h5py
import pytest
import torch
import torch.nn as nn

import tracer
from sleuth.cli import main
from tests.tracer.storage.test_dump_cli import damage_records


def _mlp_run(path: Path, nan_step: int | None = 2, steps: int = 3) -> Path:
    """A plain loop over nn.Sequential; at `nan_step` a NaN enters through the batch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracer.Dumper(model, {"path": str(path), "level": "op", "writer": "sync"}):
        for step in range(steps):
            x = torch.randn(2, 4)
            if step == nan_step:
                x = torch.log(x - 10)  # NaN from finite inputs
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    return path


def test_partial_only_rank_folder_exits_2(tmp_path, capsys):
    run = _mlp_run(tmp_path / "run", nan_step=None, steps=1)
    rank0 = run / "dump" / "rank0"
    (rank0 / "step0.h5").rename(rank0 / "step0.h5.partial")
    for args in (["check", str(run)], ["check", str(run), "--first-nan"],
                 ["check", str(rank0), "--json"]):
        assert main(args) == 2
        out, err = capsys.readouterr()
        assert "step0.h5.partial" in out
        if "--json" in args:
            doc = json.loads(out)
            assert doc["status"] == "incomplete" and doc["read"] == 0
            assert doc["unread"][0]["reason"].startswith("partial file")
        else:
            assert "nothing was read" in err and "no watchpoint hit" not in out


def test_empty_rank_folder_exits_2(tmp_path, capsys):
    (tmp_path / "run" / "dump" / "rank0").mkdir(parents=True)
    assert main(["check", str(tmp_path / "run")]) == 2
    assert "nothing was read: no step file" in capsys.readouterr().err
    assert main(["check", str(tmp_path / "run"), "--first-nan"]) == 2


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_first_nan_names_a_damaged_earlier_step(tmp_path, capsys, damage):
    run = _mlp_run(tmp_path / "run", nan_step=2)
    assert main(["check", str(run), "--first-nan"]) == 1
    assert "step 2" in capsys.readouterr().out
    # step 1's file damaged: an earlier origin could hide there, and check must say that it
    # could not look
    bad = run / "dump" / "rank0" / "step1.h5"
    if damage == "truncated":
        bad.write_bytes(bad.read_bytes()[:4000])
    else:
        damage_records(bad)
    assert main(["check", str(run), "--first-nan"]) == 2
    out, err = capsys.readouterr()
    assert "aten.log" in out and "step 2" in out
    assert f"not read: {bad}" in out
    assert "origin may lie in 1 earlier step file" in err and str(bad) in err
    assert main(["check", str(run), "--first-nan", "--json"]) == 2
    doc = json.loads(capsys.readouterr().out)
    assert doc["first_nan"]["unread_before"][0]["path"] == str(bad)
    with pytest.warns(RuntimeWarning, match="skipped 1 partial, unreadable or other-run") if \
            damage == "truncated" else contextlib.nullcontext():
        coverage = tracer.check(run).attrs["coverage"]
    assert coverage["read"] == 2 and [u["path"] for u in coverage["unread"]] == [str(bad)]
    assert main(["check", str(run)]) == 2  # hits listed, but not over every file
    assert "1 of 3 step file(s) could not be read" in capsys.readouterr().err
    assert main(["check", str(run), "--step", "0"]) == 0  # what was asked was all read


def test_interrupted_step_is_searched_and_named(tmp_path, capsys):
    run = _mlp_run(tmp_path / "run", nan_step=2)
    with h5py.File(run / "dump" / "rank0" / "step2.h5", "r+") as f:
        f.attrs["status"] = "interrupted"
        f.attrs["status_reason"] = "RuntimeError: CUDA error"
    assert main(["check", str(run), "--first-nan"]) == 1
    out = capsys.readouterr().out
    assert "step 2 (step interrupted: RuntimeError: CUDA error)" in out
    assert "step 2 rank 0 is interrupted (RuntimeError: CUDA error): searched" in out
    clean = _mlp_run(tmp_path / "clean", nan_step=None, steps=2)
    with h5py.File(clean / "dump" / "rank0" / "step1.h5", "r+") as f:
        f.attrs["status"] = "interrupted"
        f.attrs["status_reason"] = "KeyboardInterrupt"
    assert main(["check", str(clean)]) == 2  # nothing found, but not called clean
    assert "1 step(s) were interrupted" in capsys.readouterr().err
    assert main(["check", str(clean), "--step", "0"]) == 0


def test_check_and_ls_classify_leftovers_as_the_reader_does(tmp_path, capsys):
    """check and `dump ls` read the reader's FileStates: a stale partial beside a complete
    step is read through its complete file (not unread), a spill file `*.data.partial` is
    placed at its own step (so an origin before it is not doubted), an empty rank folder beside
    a complete rank is named and keeps the answer from being called complete."""
    run = _mlp_run(tmp_path / "run", nan_step=1, steps=3)
    rank0 = run / "dump" / "rank0"
    (rank0 / "step0.h5.partial").write_bytes(b"left by a crash")  # beside complete step 0
    assert main(["check", str(run), "--first-nan"]) == 1
    out = capsys.readouterr().out
    assert "step 1" in out and "not read" not in out
    (rank0 / "step7.h5.data.partial").write_bytes(b"spilled bytes of a step never finished")
    assert main(["check", str(run), "--first-nan", "--json"]) == 1  # step 7 comes after step 1
    doc = json.loads(capsys.readouterr().out)
    assert [(u["step"], u["state"]) for u in doc["unread"]] == [(7, "partial_only")]
    assert doc["first_nan"]["unread_before"] == []
    assert main(["check", str(run)]) == 2  # a step file not read: hits, but not over all files
    capsys.readouterr()
    assert main(["dump", "ls", str(run), "--json"]) == 1
    rows = json.loads(capsys.readouterr().out)["files"]
    assert sorted((r["step"], r["status"]) for r in rows if r["status"] != "complete") == [
        (0, "partial"), (7, "partial")]
    (rank0 / "step7.h5.data.partial").unlink()
    (run / "dump" / "rank1").mkdir()
    assert main(["check", str(run)]) == 2
    err = capsys.readouterr().err
    assert "1 rank folder(s) hold no step file" in err and "rank1" in err
    assert main(["dump", "ls", str(run), "--json"]) == 1
    rows = json.loads(capsys.readouterr().out)["files"]
    assert [(r["rank"], r["step"]) for r in rows if r["status"] == "empty"] == [(1, None)]
