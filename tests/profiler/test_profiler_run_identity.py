"""The profile carries the run id the dump carries, by the one rule every tool imports
(`sleuth.common.inherited_run_id`), also where the launcher names no run: plain torchrun (its
rendezvous id is "none") and `mp.spawn` without $SLEUTH_RUN_ID give every rank the parent's id,
and the readers check the profile's windows against the dump's run."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import profiler
import trainer
from sleuth.common import inherited_run_id, resolve_run_id

REPO = Path(__file__).resolve().parents[2]


def test_the_collector_and_the_dump_find_one_id_under_torchrun_without_a_rendezvous_id(
        monkeypatch, tmp_path):
    monkeypatch.delenv("SLEUTH_RUN_ID", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # plain torchrun's default
    monkeypatch.setenv("WORLD_SIZE", "2")
    dump_id = resolve_run_id(2)
    assert dump_id.startswith("parent-")
    assert profiler.Collector(tmp_path).run_id == dump_id
    assert profiler.SummaryWriter(tmp_path).run_id == dump_id


def test_one_process_started_alone_inherits_no_id(monkeypatch):
    for name in ("SLEUTH_RUN_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert inherited_run_id() == ""
    assert resolve_run_id() != resolve_run_id()  # the dump: a fresh id per writer
    monkeypatch.setenv("SLEUTH_RUN_ID", "given")
    assert inherited_run_id() == resolve_run_id() == "given"


_TRAIN = """
    import atexit
    import os
    import sys

    import torch
    import torch.distributed as dist
    from torch import nn

    import profiler
    import tracer


    def train(run):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        config = profiler.CollectorConfig(wait=0, warmup=0, active=1, profile_memory=False,
                                          activities=("cpu",))
        with tracer.Dumper(model, {"path": run, "writer": "sync"}), \\
                profiler.Collector(run, config=config) as collector:
            for _ in range(2):
                model(torch.randn(3, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
                collector.step()
        dist.barrier()
        dist.destroy_process_group()
        # gloo's threads may abort a rank while the interpreter finalizes
        # (docs/frameworks.md): run the exit handlers, then leave without the C++ teardown
        atexit._run_exitfuncs()
        sys.stdout.flush()
        os._exit(0)
"""
_TORCHRUN = textwrap.dedent(_TRAIN + """
    dist.init_process_group("gloo")
    train(sys.argv[1])
""")
# mp.spawn sets no $WORLD_SIZE nor $RANK: the ranks are told by the process group
_SPAWN = textwrap.dedent(_TRAIN + """
    def worker(rank, run, port):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        dist.init_process_group("gloo", rank=rank, world_size=2)
        os.environ["RANK"] = str(rank)  # the tools' rank (their folder), never the run's id
        train(run)


    if __name__ == "__main__":
        torch.multiprocessing.spawn(worker, args=(sys.argv[1], sys.argv[2]), nprocs=2)
""")


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "mp.spawn"])
def test_two_ranks_without_a_run_id_write_one_run(tmp_path, free_port, launcher):
    script = tmp_path / "train.py"
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLEUTH_", "TORCHELASTIC_")) and k not in ("RANK", "WORLD_SIZE")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    if launcher == "torchrun":
        script.write_text(_TORCHRUN)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
               f"--master_port={free_port()}", str(script), str(run)]
    else:
        script.write_text(_SPAWN)
        cmd = [sys.executable, str(script), str(run), str(free_port())]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    dump_id = json.loads((run / "dump" / "dump.json").read_text())["run_id"]
    assert dump_id.startswith("parent-")
    windows = sorted(run.glob("profile/rank*/window*.json"))
    assert len(windows) == 2
    assert {json.loads(w.read_text())["run_id"] for w in windows} == {dump_id}
    # the readers: the run directory holds one run, and the profile reads as that run's
    found = trainer.claim_run_dir(run, dump_id)
    assert list(found.by_run) == [dump_id]
    assert sorted(profiler.read_profile(run).steps["rank"].unique()) == [0, 1]
