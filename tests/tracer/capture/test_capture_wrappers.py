"""Wrappers (DDP, FSDP, activation checkpointing, torch.compile) leave record names alone: a
wrapped run and a single-process eager run of the same model diff record for record."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import tracer
from tracer.capture._naming import module_names

REPO = Path(__file__).resolve().parents[3]

_SCRIPT = textwrap.dedent("""
    import os
    import torch
    import torch.distributed as dist
    from torch import nn

    ddp = "RANK" in os.environ
    if ddp:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    if ddp:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1)  # every rank the same batch: DDP's averaged gradient is the local one
    for _ in range(2):
        loss = model(torch.randn(16, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    if ddp:
        dist.destroy_process_group()
        # torch's gloo threads abort a rank now and then as the interpreter finalizes
        # (docs/frameworks.md, "An abort at exit"): exit handlers, then no C++ teardown
        import atexit, os, sys; atexit._run_exitfuncs(); sys.stdout.flush(); os._exit(0)
""")


@pytest.mark.slow
@pytest.mark.parametrize("level", ["mix", "module"])
def test_ddp_run_has_the_names_of_a_single_process_run(tmp_path, sleuth_cli, free_port, level):
    (tmp_path / "train.py").write_text(_SCRIPT)
    (tmp_path / "dump.json").write_text(json.dumps({"steps": "all", "level": level}))
    single = subprocess.Popen(  # side by side with the two ranks
        [sys.executable, "-m", "sleuth", "run", "--run-dir", "single", "--dump", "dump.json",
         "--strict", "--", sys.executable, "train.py"], cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc = sleuth_cli("run", "--run-dir", "ddp", "--dump", "dump.json", "--strict", "--",
                      sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                      f"--master_port={free_port()}", "train.py", cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _, err = single.communicate(timeout=240)
    assert single.returncode == 0, err[-3000:]
    one, two = tracer.open_dump(tmp_path / "single"), tracer.open_dump(tmp_path / "ddp")
    assert two.ranks == [0, 1]
    for step in (0, 1):
        names = list(one.stats(rank=0, step=step)["name"])
        assert "0.weight.optimizer.0.grad.0" in names and "2.forward.0.output.0" in names
        assert any("::aten.addmm" in n for n in names) == (level == "mix")
        for rank in (0, 1):  # no `module.` prefix, none of DDP's own ops (broadcast, buckets)
            assert list(two.stats(rank=rank, step=step)["name"]) == names
    result = tracer.diff(tmp_path / "single", tmp_path / "ddp", rank=0)
    assert result.status == "same"
    out = sleuth_cli("diff", str(tmp_path / "single"), str(tmp_path / "ddp"), "--rank", "0")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 only in A, 0 only in B" in out.stdout


def test_checkpoint_and_compile_wrappers_take_no_name():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    plain = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU(), nn.Linear(2, 1)))
    wrapped = nn.Sequential(plain[0], checkpoint_wrapper(plain[1]))
    assert [n for n in module_names(wrapped).values()] == ["<root>", "0", "1", "1.0", "1.1"]
    assert list(module_names(plain).values()) == list(module_names(wrapped).values())
    wrappers: dict = {}
    names = module_names(torch.compile(wrapped), wrappers=wrappers)
    assert list(names.values()) == ["<root>", "0", "1", "1.0", "1.1"]
    assert sorted(wrappers.values()) == ["1", "<root>"]
