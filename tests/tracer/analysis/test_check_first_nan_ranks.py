"""`check --first-nan` over ranks: in the step where non-finite values first appear, the rank
whose NaN comes first in execution order is blamed (the one that made it), not the lowest rank
number; the ranks that received it are listed after it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import tracer
from models import torchrun_ddp
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
    # module-level records hold no collective: the order across ranks is said to be a guess
    assert origin["ranks_ordered_by"] == "execution order"
    assert "hold no collective call" in out and "execution order alone" in out
    assert main(["check", str(run), "--first-nan", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["first_nan"]["rank"] == 1
    assert data["first_nan"]["other_ranks"][0]["rank"] == 0
    assert data["first_nan"]["ranks_ordered_by"] == "execution order"


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


def test_a_nan_received_through_a_collective_is_blamed_on_its_sender(tmp_path, capsys):
    """Rank 1 runs 6 ops of its own before it makes the NaN and all-reduces it; rank 0 runs
    none and receives it from the all-reduce. By seq alone rank 0's record comes first; by the
    collectives each had begun (the c10d records) rank 1 made it."""
    root = tmp_path / "run"
    for rank in (0, 1):
        w = make_writer(DumpConfig(path=str(root), writer="sync"), rank=rank, world_size=2)
        w.begin_step(0)
        own = 6 if rank == 1 else 0
        for i in range(own):  # rank 1's extra work (a pipeline stage, a rank-only branch)
            w.add(RecordMeta(f"<none>::aten.mul.forward.{i}.output.0", "<none>", "aten.mul",
                             "forward", "output", 0, i, "model.py:5"), torch.ones(4))
        made = float("nan") if rank == 1 else 1.0
        w.add(RecordMeta("<none>::aten.div.forward.0.output.0", "<none>", "aten.div", "forward",
                         "output", 0, 0, "model.py:9"), torch.full((4,), made))
        for direction in ("input", "output"):
            value = made if direction == "input" else float("nan")
            w.add(RecordMeta(f"<none>::c10d.allreduce_.forward.0.{direction}.0", "<none>",
                             "c10d.allreduce_", "forward", direction, 0, 0, "model.py:10"),
                  torch.full((4,), value))
        w.end_step()
        w.close()
    origin = tracer.first_nan_origin(root)
    assert (origin["rank"], origin["name"], origin["collective"]) == (
        1, "<none>::aten.div.forward.0.output.0", 0)
    [other] = origin["other_ranks"]
    assert (other["rank"], other["collective"], other["received"]) == (0, 1, True)
    assert other["name"] == "<none>::c10d.allreduce_.forward.0.output.0"
    assert other["seq"] < origin["seq"]  # by seq alone, rank 0 would have been blamed
    assert origin["ranks_ordered_by"] == "collectives"
    assert main(["check", str(root), "--first-nan"]) == 1
    assert ("rank 0 at <none>::c10d.allreduce_.forward.0.output.0 (after 1 collective(s) of "
            "the step, rank 1's after 0): received from rank 1 through a collective"
            ) in capsys.readouterr().out


RANK_SCRIPT = """
import sys
import torch, torch.distributed as dist
import tracer

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with tracer.Dumper(model, {"path": sys.argv[1], "level": "op", "writer": "sync"}):
    for step in range(2):
        scale = torch.ones(4)
        if rank == 1:
            for _ in range(8):  # work of its own, a pipeline stage or a rank-only branch
                scale = scale * 1.0
            if step == 1:
                scale = scale / 0.0  # +Inf, made here
        dist.all_reduce(scale)  # every rank gets it
        loss = model(torch.randn(2, 4) * scale).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
dist.barrier()
dist.destroy_process_group()
# torch's gloo threads abort a rank now and then as the interpreter finalizes
# (docs/frameworks.md, "An abort at exit"): exit handlers, then no C++ teardown
import atexit, os, sys; atexit._run_exitfuncs(); sys.stdout.flush(); os._exit(0)
"""


@pytest.mark.slow
def test_a_real_two_rank_run_names_the_rank_that_sent_the_nan(tmp_path):
    """torchrun, gloo, DDP: rank 1 makes an Inf after ops rank 0 does not run and all-reduces
    it. Rank 0's first non-finite record (the first op that reads the all-reduce's result) has
    the smaller seq; the collective count names rank 1, and rank 0 is listed as having
    received it."""
    run = torchrun_ddp(RANK_SCRIPT, tmp_path)
    origin = tracer.first_nan_origin(run)
    assert (origin["rank"], origin["step"]) == (1, 1)
    assert origin["op"] == "aten.div" and origin["collective"] == 0
    received = [o for o in origin["other_ranks"] if o["rank"] == 0]
    assert received and received[0]["received"] and received[0]["collective"] == 1
    d = tracer.open_dump(run)
    seq0 = int(d.record(0, 1, received[0]["name"])["seq"])
    assert seq0 < origin["seq"]  # by seq alone, rank 0 would have been blamed
