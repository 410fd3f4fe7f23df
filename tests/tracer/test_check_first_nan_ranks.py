"""`check --first-nan` over ranks: in the step where non-finite values first appear, the rank
whose NaN comes first in execution order is blamed (the one that made it), not the lowest rank
number; the ranks that received it are listed after it."""
from __future__ import annotations

import json
from pathlib import Path

import torch

import tracer
from sleuth.cli import main
from tracer.storage import RecordMeta, make_writer
from tracer._config import DumpConfig


def write(root: Path, nan_from: dict[int, int], nan_step: int = 2) -> Path:
    """Two ranks, four layers a step; on `nan_step`, rank r's outputs are NaN from layer
    nan_from[r] on (rank 1 makes it at layers.1; rank 0 receives it at layers.2, as through an
    all-reduce)."""
    for rank in (0, 1):
        w = make_writer(DumpConfig(path=str(root), writer="sync"), rank=rank, world_size=2)
        for step in (1, 2, 3):
            w.begin_step(step)
            for i in range(4):
                bad = step >= nan_step and i >= nan_from.get(rank, 99)
                value = float("nan") if bad else float(i + step)
                w.add(RecordMeta(f"layers.{i}.forward.0.output.0", f"layers.{i}", "", "forward",
                                 "output", 0, 0, f"model.py:{20 + i}"), torch.full((4,), value))
            w.end_step()
        w.close()
    return root


def test_the_rank_that_made_it_is_blamed_not_the_lowest(tmp_path, capsys):
    run = write(tmp_path / "run", {0: 2, 1: 1})
    origin = tracer.first_nan_origin(run)
    assert (origin["rank"], origin["step"], origin["name"], origin["source"]) == (
        1, 2, "layers.1.forward.0.output.0", "model.py:21")
    assert [(o["rank"], o["name"]) for o in origin["other_ranks"]] == [
        (0, "layers.2.forward.0.output.0")]
    assert main(["check", str(run), "--first-nan"]) == 1
    out = capsys.readouterr().out
    assert "layers.1.forward.0.output.0" in out and "rank 1)" in out
    assert "1 other rank(s) hold non-finite values" in out and "rank 0 at layers.2" in out
    assert main(["check", str(run), "--first-nan", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["first_nan"]["rank"] == 1
    assert data["first_nan"]["other_ranks"][0]["rank"] == 0


def test_an_earlier_step_on_a_higher_rank_still_wins(tmp_path):
    root = tmp_path / "run"
    write(root, {0: 0})  # rank 0: every layer NaN from step 2
    # rank 1 made its NaN a step earlier: rewrite rank 1 so that step 1 already has it
    for f in (root / "dump" / "rank1").glob("step*.h5"):
        f.unlink()
    w = make_writer(DumpConfig(path=str(root), writer="sync"), rank=1, world_size=2)
    for step in (1, 2, 3):
        w.begin_step(step)
        for i in range(4):
            value = float("nan") if i >= 3 else 1.0
            w.add(RecordMeta(f"layers.{i}.forward.0.output.0", f"layers.{i}", "", "forward",
                             "output", 0, 0, f"model.py:{20 + i}"), torch.full((4,), value))
        w.end_step()
    w.close()
    origin = tracer.first_nan_origin(root)
    assert (origin["rank"], origin["step"], origin["name"]) == (1, 1, "layers.3.forward.0.output.0")
    assert origin["other_ranks"] == []
