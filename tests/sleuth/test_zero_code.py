"""Zero-code attach: scripts nobody edited get dumped, through the installed .pth start-up hook
and through `sleuth run` around torchrun (every rank)."""
from __future__ import annotations

import json
import os
import site
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_DDP_SCRIPT = textwrap.dedent("""
    import torch
    import torch.distributed as dist
    from torch import nn

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.Tanh(),
                                                              nn.Linear(8, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1 + dist.get_rank())
    for _ in range(3):
        x = torch.randn(16, 4)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    dist.destroy_process_group()
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_sleuth_run_dumps_every_torchrun_rank(tmp_path, sleuth_cli):
    import tracer

    (tmp_path / "ddp.py").write_text(_DDP_SCRIPT)
    (tmp_path / "dump.json").write_text(json.dumps({"steps": "all", "mode": "statistics"}))
    run = tmp_path / "run"
    proc = sleuth_cli("run", "--run-dir", str(run), "--dump", "dump.json", "--strict", "--",
                      "python", "-m", "torch.distributed.run", "--nproc_per_node=2",
                      f"--master_port={_free_port()}", "ddp.py", cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    dump = tracer.open_dump(run)
    assert dump.ranks == [0, 1]
    for rank in (0, 1):
        assert dump.steps(rank=rank) == [0, 1, 2]
    # DDP averages gradients: both ranks hold the same weights after step 0, not the same inputs.
    assert tracer.diff(run, run, step=1, rank=0, b_rank=1).status == "diverged"
    grads = [dump.stats(rank=r, step=0).query("direction == 'grad'")["checksum"].tolist()
             for r in (0, 1)]
    assert grads[0] == grads[1]


def _installed_pth() -> Path | None:
    for d in site.getsitepackages():
        p = Path(d) / "sleuth_autoattach.pth"
        if p.exists():
            return p
    return None


@pytest.mark.skipif(_installed_pth() is None,
                    reason="sleuth is not installed (bash scripts/install.sh installs the .pth)")
def test_installed_pth_dumps_a_plain_python_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import torch
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            model(torch.ones(4, 3)).sum().backward()
            opt.step()
            opt.zero_grad()
    """))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(SLEUTH_DUMP_CONFIG='{"steps": "1"}', SLEUTH_RUN_DIR=str(tmp_path / "run"),
               SLEUTH_STRICT="1")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (tmp_path / "run" / "dump" / "rank0").iterdir()) == ["step1.h5"]


def test_no_variable_means_nothing_is_imported(tmp_path):
    code = "import sys; print(sorted(m for m in ('sleuth', 'tracer', 'torch') if m in sys.modules))"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLEUTH_")}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                         text=True, check=True).stdout.strip()
    assert out == "[]"
