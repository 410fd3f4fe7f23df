"""Zero-code attach: an unmodified training script dumped through $SLEUTH_DUMP_CONFIG."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

SCRIPT = textwrap.dedent("""
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(4, 8)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    print("trained")
""")


def run_attached(tmp_path: Path, config: str, extra_env: dict | None = None):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLEUTH_")}
    env.update({"SLEUTH_DUMP_CONFIG": config, "PYTHONPATH": str(REPO),
                "SLEUTH_RUN_DIR": str(tmp_path / "run"), **(extra_env or {})})
    code = ("import tracer; tracer.attach_from_env(); import runpy; "
            "runpy.run_path('script.py', run_name='__main__')")
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


def test_attach_from_env_unset_returns_none(monkeypatch):
    import tracer

    monkeypatch.delenv("SLEUTH_DUMP_CONFIG", raising=False)
    assert tracer.attach_from_env() is None


@pytest.mark.slow
def test_attach_from_env_before_torch_is_imported(tmp_path):
    """A script that calls `attach_from_env()` itself before importing torch, with the start-up
    hook installed: importing torch inside the call runs the hook's attach, which must leave
    the attaching to the call (attaching from the hook on the half-imported tracer would warn,
    or crash with SLEUTH_STRICT=1)."""
    code = textwrap.dedent("""
        import tracer
        dumper = tracer.attach_from_env()
        import torch
        print("attached", type(dumper).__name__)
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLEUTH_")}
    env.update({"SLEUTH_DUMP_CONFIG": json.dumps({"level": "module"}), "SLEUTH_STRICT": "1",
                "PYTHONPATH": str(REPO), "SLEUTH_RUN_DIR": str(tmp_path / "run")})
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "attached Dumper" in proc.stdout and "could not attach" not in proc.stderr


@pytest.mark.parametrize("writer", ["sync", pytest.param("async", marks=pytest.mark.slow)])
def test_leaving_by_exit_handlers_and_os_exit_keeps_the_last_step(tmp_path, writer):
    """A torchrun worker steps past torch's gloo abort at exit with `atexit._run_exitfuncs()`
    then `os._exit(0)` (docs/frameworks.md), which skips threading's exit hooks: the dump's
    last step, written when the dump closes, must be written all the same."""
    script = tmp_path / "script.py"
    # tensors of some megabytes: the last step's write is still going when the script ends
    script.write_text(SCRIPT.replace("16", "1024").replace("(4, 8)", "(256, 8)")
                      + "import atexit, os, sys\natexit._run_exitfuncs()\n"
                      "sys.stdout.flush()\nos._exit(0)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLEUTH_")}
    env.update({"SLEUTH_DUMP_CONFIG": json.dumps({"level": "module", "writer": writer,
                                                  "mode": "full"}),
                "PYTHONPATH": str(REPO), "SLEUTH_RUN_DIR": str(tmp_path / "run")})
    code = ("import tracer; tracer.attach_from_env(); import runpy; "
            "runpy.run_path('script.py', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "trained" in proc.stdout, proc.stderr
    files = sorted(p.name for p in (tmp_path / "run" / "dump" / "rank0").iterdir()
                   if p.name.startswith("step"))
    assert files == ["step0.h5", "step1.h5", "step2.h5"], proc.stderr  # no step2.h5.partial


@pytest.mark.slow
def test_unmodified_script_is_dumped(tmp_path):
    config = tmp_path / "dump.json"
    config.write_text(json.dumps({"steps": "0|2", "writer": "sync", "level": "mix"}))
    proc = run_attached(tmp_path, str(config), {"RANK": "0", "WORLD_SIZE": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "trained" in proc.stdout
    files = sorted(p.name for p in (tmp_path / "run" / "dump" / "rank0").glob("step*.h5"))
    assert files == ["step0.h5", "step2.h5"]
    import tracer

    dump = tracer.open_dump(tmp_path / "run")
    assert dump.steps(0) == [0, 2]
    stats = dump.stats(0, 2)
    names = list(stats["name"])
    assert names[0] == "<none>::aten.randn.forward.0.output.0"  # the batch, made outside modules
    assert names[1] == "<root>.forward.0.input.0"
    assert "0.forward.0.output.0" in names and "0::aten.addmm.forward.0.output.0" in names
    assert "2.weight.optimizer.0.update.0" in names
    assert set(stats["source"][stats["phase"] == "forward"].str.split(":").str[0]) <= \
        {"script.py"}


@pytest.mark.slow
def test_inline_json_and_rank_selection(tmp_path):
    proc = run_attached(tmp_path, '{"ranks": "1", "writer": "sync"}', {"RANK": "0"})
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "run" / "dump").exists()
    proc = run_attached(tmp_path, '{"ranks": "1", "writer": "sync", "steps": "1"}',
                        {"RANK": "1", "WORLD_SIZE": "2"})
    assert proc.returncode == 0, proc.stderr
    assert [p.name for p in (tmp_path / "run" / "dump" / "rank1").glob("*.h5")] == ["step1.h5"]


LOADER_SCRIPT = textwrap.dedent("""
    import sys
    import tracer
    tracer.attach_from_env()  # what the .pth start-up hook does, in spawned workers too
    import torch
    import torch.nn as nn
    from torch.utils.data import DataLoader, Dataset

    class Normalize(nn.Module):  # a transform that is an nn.Module (torchvision v2 style)
        def forward(self, x):
            return (x - x.mean()) / (x.std() + 1e-6)

    class Data(Dataset):
        def __init__(self):
            self.transform = Normalize()

        def __len__(self):
            return 32

        def __getitem__(self, i):
            g = torch.Generator().manual_seed(i)
            return self.transform(torch.randn(8, generator=g)), torch.tensor(i % 2)

    if __name__ == "__main__":
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = DataLoader(Data(), batch_size=8, num_workers=2,
                            multiprocessing_context=sys.argv[1])
        for x, y in loader:
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        print("trained")
""")


@pytest.mark.slow
@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_dataloader_workers_leave_the_dump_to_the_trainer(tmp_path, start):
    """DataLoader workers running nn.Module transforms under the zero-code attach: a forked
    worker inherits the trainer's Dumper (hooks, writer, file helper) and a spawned one makes
    its own; either would record the transforms into the trainer's step files (rank 0 too),
    and a spawned one could crash the run at exit. Workers record nothing, the run ends
    normally and each step file holds the trainer's records only."""
    (tmp_path / "train.py").write_text(LOADER_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLEUTH_")}
    config = {"level": "module"}
    env.update({"SLEUTH_DUMP_CONFIG": json.dumps(config), "PYTHONPATH": str(REPO),
                "SLEUTH_RUN_DIR": str(tmp_path / "run")})
    proc = subprocess.run([sys.executable, "train.py", start], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trained" in proc.stdout and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "flight recorder" not in proc.stderr and "could not attach" not in proc.stderr
    import tracer

    dump = tracer.open_dump(tmp_path / "run")
    assert dump.steps(0) == [0, 1, 2, 3]
    for step in dump.steps(0):
        stats = dump.stats(0, step)
        assert set(stats.module) == {"<root>", "0", "1", "2"}, step
        assert (stats.call == 0).all()


@pytest.mark.slow
def test_op_level_runs_with_dataloader_workers_diff_the_same(tmp_path):
    """The trainer rebuilds each batch a worker sent (aten.empty, aten.set_ under
    torch/multiprocessing/reductions.py) whenever it arrives, so how many fall in a step
    depends on prefetching: those ops are not records, and two identical runs diff the same."""
    (tmp_path / "train.py").write_text(LOADER_SCRIPT)
    import tracer

    for run in ("a", "b"):
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLEUTH_")}
        env.update({"SLEUTH_DUMP_CONFIG": json.dumps({"level": "mix", "mode": "full"}),
                    "PYTHONPATH": str(REPO), "SLEUTH_RUN_DIR": str(tmp_path / run)})
        proc = subprocess.run([sys.executable, "train.py", "fork"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
    stats = tracer.open_dump(tmp_path / "a").stats(0, 1)
    assert not stats.source.str.contains("received").any()
    assert not stats.op.isin(["aten.set_", "aten.empty"]).any()
    result = tracer.diff(tmp_path / "a", tmp_path / "b")
    assert result.status == "same", result.first_divergence
