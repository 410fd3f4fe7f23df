"""`sleuth diff` over every rank: each rank pair diffed (in this process, a local pool or a real
Dask cluster), the earliest divergence across ranks named, every rank accounted for."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import tracer
from sleuth.cli import main
from models import torchrun_ddp
from tests.tracer.storage.test_dump_cli import damage_records
from tracer._config import DumpConfig
from tracer.storage import RecordMeta, make_writer


def write_run(root: Path, ranks: int, steps=(1, 2, 3), bump: dict | None = None) -> Path:
    """A statistics dump of `ranks` ranks; `bump` maps (rank, step, layer) to a value added to
    that record and to every later layer of that step (as an error carries forward)."""
    bump = bump or {}
    for rank in range(ranks):
        w = make_writer(DumpConfig(path=str(root), writer="sync"), rank=rank, world_size=ranks)
        for step in steps:
            w.begin_step(step)
            extra = 0.0
            for i in range(4):
                extra += bump.get((rank, step, i), 0.0)
                w.add(RecordMeta(f"layers.{i}.forward.0.output.0", f"layers.{i}", "", "forward",
                                 "output", 0, 0, f"model.py:{10 + i}"),
                      torch.full((4, 4), float(i + step) + extra))
            w.end_step()
        w.close()
    return root


@pytest.fixture
def pair(tmp_path: Path) -> tuple[Path, Path]:
    a = write_run(tmp_path / "a", 4)
    # rank 1 goes wrong at step 3, rank 2 earlier (step 2, layers.1): rank 2 is the answer
    b = write_run(tmp_path / "b", 4, bump={(1, 3, 0): 1.0, (2, 2, 1): 0.5})
    return a, b


def test_earliest_divergence_across_ranks(pair):
    res = tracer.diff_ranks(*pair, workers=1)
    assert res.status == "diverged" and res.exit_code == 1
    fd = res.earliest
    assert (fd["rank"], fd["step"], fd["name"], fd["source"]) == (
        2, 2, "layers.1.forward.0.output.0", "model.py:11")
    status = {r["rank"]: r["status"] for r in res.ranks}
    assert status == {0: "same", 1: "diverged", 2: "diverged", 3: "same"}
    assert res.table() == {0: {1: "same", 2: "same", 3: "same"},
                           1: {1: "same", 2: "same", 3: "diverged"},
                           2: {1: "same", 2: "diverged", 3: "same"},
                           3: {1: "same", 2: "same", 3: "same"}}


@pytest.mark.slow
def test_local_pool_equals_in_process(pair):
    one = tracer.diff_ranks(*pair, workers=1).to_dict()
    pool = tracer.diff_ranks(*pair, workers=2).to_dict()
    assert one.pop("engine") == "in-process" and pool.pop("engine") == "local (2 processes)"
    assert pool == one


@pytest.mark.slow
def test_dask_cluster_equals_local(pair):
    distributed = pytest.importorskip("distributed")
    local = tracer.diff_ranks(*pair, workers=1).to_dict()
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=None) as cluster:
        on_dask = tracer.diff_ranks(*pair, scheduler=cluster.scheduler_address).to_dict()
        workers = len(cluster.scheduler_info["workers"])
    assert workers == 2
    assert on_dask.pop("engine").startswith("dask tcp://127.0.0.1:")
    local.pop("engine")
    assert on_dask == local


def test_cli_reports_every_rank(pair, capsys):
    assert main(["diff", str(pair[0]), str(pair[1]), "--workers", "1"]) == 1
    out = capsys.readouterr().out
    assert "status: DIVERGED   ranks: 4 compared (2 same, 2 diverged, 0 incomplete)" in out
    assert "earliest divergence (compute): rank 2 step 2: layers.1.forward.0.output.0" in out
    assert "source model.py:11" in out
    assert main(["diff", str(pair[0]), str(pair[1]), "--workers", "1", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["earliest"]["rank"] == 2 and data["table"]["1"]["3"] == "diverged"
    # one rank chosen: the one-pair report, as before
    assert main(["diff", str(pair[0]), str(pair[1]), "--rank", "3"]) == 0
    assert capsys.readouterr().out.startswith("status: SAME")


def test_a_rank_on_one_side_or_unreadable_is_never_same(tmp_path, capsys):
    a = write_run(tmp_path / "a", 3)
    b = write_run(tmp_path / "b", 2)
    res = tracer.diff_ranks(a, b, workers=1)
    assert res.only_a == [2] and res.status == "diverged" and res.exit_code == 1
    assert main(["diff", str(a), str(b), "--workers", "1"]) == 1
    assert "rank(s) only in A, not compared: 2" in capsys.readouterr().out
    c = write_run(tmp_path / "c", 3)
    for step in (1, 2, 3):
        damage_records(c / "dump" / "rank1" / f"step{step}.h5")
    res = tracer.diff_ranks(a, c, workers=1)
    assert res.status == "incomplete" and res.exit_code == 2
    bad = next(r for r in res.ranks if r["rank"] == 1)
    assert bad["status"] == "incomplete" and (bad["error"] or bad["problems"])
    assert [r["status"] for r in res.ranks if r["rank"] != 1] == ["same", "same"]


@pytest.mark.slow
def test_a_scheduler_that_is_not_there_is_a_clear_error(pair, capsys):
    pytest.importorskip("distributed")
    assert main(["diff", str(pair[0]), str(pair[1]), "--scheduler", "tcp://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert "cannot reach the Dask scheduler at tcp://127.0.0.1:9" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("address", ["garbage://x", "tcp://", "tcp://host name:8786"])
def test_a_scheduler_address_that_does_not_read_is_one_line(pair, address, capsys):
    assert main(["diff", str(pair[0]), str(pair[1]), "--scheduler", address]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"Dask scheduler address {address!r}" in err and "tcp://127.0.0.1:8786" in err


@pytest.mark.slow
def test_workers_that_keep_dying_are_one_clear_error(tmp_path):
    """A task whose worker dies (killed for memory, say) until the scheduler gives up
    (KilledWorker) is a TracerError naming the rank and the likely cause."""
    import functools
    import os

    distributed = pytest.importorskip("distributed")
    import dask

    from tracer.analysis._rank_tasks import run_per_rank

    task = functools.partial(os._exit, 3)  # the worker process dies, as one killed would
    with dask.config.set({"distributed.scheduler.allowed-failures": 0}):
        with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                                      dashboard_address=None) as cluster:
            with pytest.raises(tracer.TracerError, match="lost rank 0's task.*memory"):
                run_per_rank(lambda r: task(), [0], {}, scheduler=cluster.scheduler_address)


def test_each_rank_task_reads_its_own_rank(pair, monkeypatch):
    """A task opens its rank's folder, never the other ranks' files (n ranks must not cost n^2
    file opens), and a step missing on one rank is still named with its full path."""
    from tracer.storage import _scan

    a, b = pair
    (b / "dump" / "rank1" / "step3.h5").unlink()
    opened: list[str] = []
    real = _scan._probe

    def probe(path, rank, step):
        opened.append(str(path))
        return real(path, rank, step)

    monkeypatch.setattr(_scan, "_probe", probe)
    from tracer.analysis._ranks import diff_one_rank

    res = diff_one_rank(2, str(a), str(b), None, tracer.Tolerance(), False)
    assert opened and all("/rank2/" in p for p in opened)
    res = diff_one_rank(1, str(a), str(b), None, tracer.Tolerance(), False)
    assert res["status"] == "diverged" and res["exit_code"] == 1
    missing = [p for p in res["problems"] if p["state"] == "missing"]
    assert [(p["side"], p["step"], p["path"]) for p in missing] == [
        ("B", 3, str(b / "dump" / "rank1" / "step3.h5"))]


def test_streamed_diff_says_what_the_whole_diff_says(pair, tmp_path):
    """keep_records=False (one step at a time, as every rank task runs) gives the same status,
    first divergence, counts, steps, problems and notes as the diff that keeps every row."""
    a, b = pair
    (b / "dump" / "rank1" / "step1.h5").unlink()
    for rank in (0, 1, 2):
        whole = tracer.diff(a, b, rank=rank)
        streamed = tracer.diff(a, b, rank=rank, keep_records=False)
        assert streamed.records.empty and len(whole.records)
        assert streamed.to_dict(records=False) == whole.to_dict(records=False), rank
    assert tracer.diff(a, b, rank=2, keep_records=False).first_divergence["step"] == 2


DDP_BATCHES = """
import sys
import torch, torch.distributed as dist
import tracer

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
    torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.Generator().manual_seed(100 + rank)  # each rank its own shard of the data
with tracer.Dumper(model, {"path": sys.argv[1], "level": "mix", "mode": "full",
                           "writer": "sync"}):
    for step in range(2):
        x = torch.randn(4, 8, generator=data)
        y = torch.randn(4, 1, generator=data)
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_two_ddp_ranks_fed_different_batches_differ_in_the_data(tmp_path, capsys):
    """torchrun, gloo, DDP, each rank its own batch (torch.randn outside the model): diffing
    rank 0 with rank 1 says the data differs (the op that made the batch, where), never that
    aten.randn diverged in compute; explain says the inputs differ."""
    run = torchrun_ddp(DDP_BATCHES, tmp_path)
    assert main(["diff", str(run), str(run), "--rank", "0", "--b-rank", "1", "--step", "0",
                 "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    fd = doc["first_divergence"]
    assert fd["name"] == "<none>::aten.randn.forward.0.output.0" and fd["kind"] == "data", fd
    (change,) = doc["changes"]
    # the model's own batch differs too, by its fingerprint
    assert change.pop("batch") == "differs" and change.pop("batch_detail").startswith(
        "the model's call 0 is given argument 0 (float32 4x8)"), change
    assert change == {"kind": "data", "name": fd["name"], "dtype": "float32", "shape": "4,8",
                      "source": fd["source"], "step": 0, "made_by": "aten.randn"}
    assert fd["source"].endswith("ddp.py:16")  # x = torch.randn(...)
    assert main(["diff", str(run), str(run), "--rank", "0", "--b-rank", "1", "--step", "0"]) == 1
    out = capsys.readouterr().out
    assert "the two runs were fed different data: <none>::aten.randn" in out
    assert "made by aten.randn at" in out and "first divergence (data)" in out
    assert "(compute)" not in out
    # the same batches on both sides: the ranks agree (DDP keeps the weights in step)
    same = tracer.diff(run, run, step=0)
    assert same.status == "same"


def test_explain_says_inputs_differ_when_the_batch_made_outside_the_model_does(tmp_path):
    """Two runs whose batches differ (drawn by torch.randn outside the model, seeds apart):
    explain's verdict is "inputs", naming the op that made the batch, not a replay of it."""
    from models import MLP, train_and_dump

    def batches(seed):
        g = torch.Generator().manual_seed(seed)
        return lambda: (torch.randn(4, 8, generator=g),)

    for name, seed in (("a", 1), ("b", 2)):
        train_and_dump(MLP, batches(seed), tmp_path / name, level="mix", mode="full",
                       writer="sync")
    res = tracer.diff(tmp_path / "a", tmp_path / "b", step=0)
    assert res.first_divergence["kind"] == "data"
    verdict = tracer.analysis.explain(tmp_path / "a", tmp_path / "b", step=0)
    assert verdict.status == "inputs", verdict.verdict
    assert "made by aten.randn" in verdict.verdict and "outside the model" in verdict.verdict
