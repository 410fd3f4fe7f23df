"""FSDP2 (`fully_shard`): parameters and gradients are DTensors, which hold no memory of their
own. The dump records each rank's local shard and never stops the run (it segfaulted in the op
observer's parameter path, and raised in the statistics kernels, before)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import tracer

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import sys
    import torch, torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    import tracer

    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracer.Dumper(model, {"path": sys.argv[1], "level": sys.argv[2]}):
        for _ in range(2):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
    torch.save({k: v.full_tensor() for k, v in model.state_dict().items()}, sys.argv[3])
    dist.destroy_process_group()
""")


@pytest.mark.skipif(not hasattr(torch.distributed, "init_process_group"),
                    reason="torch built without distributed")
@pytest.mark.parametrize("level", ["module", "op"])
def test_fsdp2_dump_records_local_shards(tmp_path, level, free_port):
    env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    res = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "run"), level,
                          str(tmp_path / "w.pt")], capture_output=True, text=True, env=env,
                         timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    d = tracer.open_dump(tmp_path / "run")
    assert d.steps(0) == [0, 1] and not d.problems
    df = d.stats(0, 1)
    params = df[df.phase == "optimizer"]
    # param, grad and update of both weights and biases, measured on the local shard (the whole
    # tensor with one rank)
    assert set(params.direction) == {"param", "grad", "update"}
    w = params[params.name == "0.weight.optimizer.0.param.0"].iloc[0]
    assert w["shape"] == "8,8" and w["nan"] == 0
    assert (df.phase == "forward").any()
