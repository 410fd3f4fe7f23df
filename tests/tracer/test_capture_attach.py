"""Zero-code attach: an unmodified training script dumped through $SLEUTH_DUMP_CONFIG."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

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
