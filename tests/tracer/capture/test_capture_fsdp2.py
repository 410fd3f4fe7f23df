"""FSDP2 (`fully_shard`): parameters and gradients are DTensors, which hold no memory of their
own. The dump records each rank's local shard and never stops the run: the statistics kernels
read memory through a data pointer, which only the local shard has."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import tracer

REPO = Path(__file__).resolve().parents[3]


def _run_one_rank(script: str, port: int, *args: str) -> None:
    """Run `script` as rank 0 of a one-process gloo group (its own process: the group is
    process-wide) and fail with its stderr when it does not finish cleanly."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    res = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                         env=env, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]

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
    # torch's gloo threads abort a rank now and then as the interpreter finalizes
    # (docs/frameworks.md, "An abort at exit"): exit handlers, then no C++ teardown
    import atexit, os, sys; atexit._run_exitfuncs(); sys.stdout.flush(); os._exit(0)
""")


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(torch.distributed, "init_process_group"),
                    reason="torch built without distributed")
@pytest.mark.parametrize("level", ["module", "op", "mix"])
def test_fsdp2_dump_records_local_shards(tmp_path, level, free_port):
    _run_one_rank(SCRIPT, free_port(), str(tmp_path / "run"), level, str(tmp_path / "w.pt"))
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
    ops = df[df.op != ""]
    if level == "module":
        assert ops.empty
    else:  # the model's forward and backward ops, through the dispatch mode
        assert {"forward", "backward"} <= set(ops.phase)
        assert (ops.op == "aten.addmm").any() and set(ops.module) >= {"0", "2"}


TP_SCRIPT = textwrap.dedent("""
    import sys
    import torch, torch.distributed as dist
    from torch.distributed.tensor import Replicate, distribute_module, distribute_tensor
    from torch.distributed.tensor import init_device_mesh
    import tracer

    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    if sys.argv[3] == "dtensor":
        distribute_module(model, mesh)  # every parameter a DTensor, as tensor parallelism has
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracer.Dumper(model, {"path": sys.argv[1], "level": sys.argv[2], "writer": "sync"}):
        for _ in range(2):
            x = torch.randn(4, 8)
            if sys.argv[3] == "dtensor":
                x = distribute_tensor(x, mesh, [Replicate()])
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    dist.destroy_process_group()
    # torch's gloo threads abort a rank now and then as the interpreter finalizes
    # (docs/frameworks.md, "An abort at exit"): exit handlers, then no C++ teardown
    import atexit, os, sys; atexit._run_exitfuncs(); sys.stdout.flush(); os._exit(0)
""")


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(torch.distributed, "init_process_group"),
                    reason="torch built without distributed")
@pytest.mark.parametrize("level", ["op", "mix"])
def test_dtensor_activations_are_recorded_as_their_local_values(tmp_path, level, free_port):
    """Parameters and activations that are DTensors inside the ops (tensor parallelism,
    `distribute_module`): every op and module record holds the local values, the same as the
    plain model's (one rank: the whole tensor)."""
    stats = {}
    for kind in ("plain", "dtensor"):
        _run_one_rank(TP_SCRIPT, free_port(), str(tmp_path / kind), level, kind)
        d = tracer.open_dump(tmp_path / kind)
        assert d.steps(0) == [0, 1] and not d.problems
        stats[kind] = d.stats(0, 1).set_index("name")
    plain, dt = stats["plain"], stats["dtensor"]
    # DTensor adds ops of its own (the input's broadcast, redistributions); the model's agree
    for name in [n for n in plain.index if n.startswith(("0::aten.addmm.", "1::aten.relu."))
                 or "::" not in n]:
        assert name in dt.index, name
        for column in ("shape", "checksum", "norm"):
            assert plain.loc[name, column] == dt.loc[name, column], (name, column)
    assert (dt.op == "aten.addmm").any()


OFFSET_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch, torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard, init_device_mesh
    import tracer

    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(0)
    flat = torch.randn(2048)
    # FSDP2's gradients: views into one reduce-scatter buffer, wrapped with the view's offset
    grad = DTensor.from_local(flat[1024:].view(32, 32), mesh, [Shard(0)])
    assert grad.storage_offset() == 1024 and grad.data_ptr() != 0  # a pointer to nothing
    model = torch.nn.Identity()
    with tracer.Dumper(model, {"path": sys.argv[1], "level": sys.argv[2], "writer": "sync"}) as d:
        model(torch.ones(1))
        (grad * 2).to_local()
        d.step()
    json.dump({"norm": float(flat[1024:].norm())}, open(sys.argv[3], "w"))
    dist.destroy_process_group()
    # torch's gloo threads abort a rank now and then as the interpreter finalizes
    # (docs/frameworks.md, "An abort at exit"): exit handlers, then no C++ teardown
    import atexit, os, sys; atexit._run_exitfuncs(); sys.stdout.flush(); os._exit(0)
""")


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(torch.distributed, "init_process_group"),
                    reason="torch built without distributed")
@pytest.mark.parametrize("level", ["op", "mix"])
def test_a_dtensor_at_an_offset_is_read_from_its_local_shard(tmp_path, level, free_port):
    """A DTensor whose wrapper carries its shard's storage offset has a data pointer that is
    null plus the offset: reading it killed the run with SIGSEGV (FSDP2 with GradScaler). The
    record holds the local shard's values instead."""
    _run_one_rank(OFFSET_SCRIPT, free_port(), str(tmp_path / "run"), level,
                  str(tmp_path / "want.json"))
    want = json.loads((tmp_path / "want.json").read_text())["norm"]
    df = tracer.open_dump(tmp_path / "run").stats(0, 0).set_index("name")
    record = df.loc["<none>::aten.mul.forward.0.input.0"]
    assert record["shape"] == "32,32"
    assert record["norm"] == pytest.approx(want, rel=1e-6)
