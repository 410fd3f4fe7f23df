"""torchrun: a 2-process DDP (and FSDP) run matches a 1-process run with the same global batch.

Tolerance: losses agree to 1e-5 relative and weights to 1e-5 absolute; the only difference is
the order of floating-point sums in the gradient all-reduce.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer import load_model, read_metrics, train
from trainer._checkpoint import load_model_state

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(run_dir: Path, *overrides: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master_addr=127.0.0.1", f"--master_port={_free_port()}", "-m", "trainer", "--run-dir", str(run_dir)]
    for o in overrides:
        cmd += ["--set", o]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    if out.returncode != 0 and "received by PID" in out.stderr:
        # Once in about twenty full-suite runs a gloo worker died of SIGABRT on this 2-core
        # machine (not reproduced in isolation); a worker killed by a signal gets one more try,
        # a worker that fails on its own does not.
        first = out.stderr[-1500:]
        cmd[cmd.index(next(a for a in cmd if a.startswith("--master_port=")))] = \
            f"--master_port={_free_port()}"
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
        assert out.returncode == 0, f"failed twice; first: {first}\nsecond: {out.stderr[-3000:]}"
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


def _compare(one: Path, two: Path) -> None:
    a, b = read_metrics(one), read_metrics(two)
    assert [m["step"] for m in a] == [m["step"] for m in b]
    for x, y in zip(a, b):
        for key in ("loss", "grad_norm", "eval_loss"):
            if key in x:
                assert y[key] == pytest.approx(x[key], rel=1e-5), (key, x, y)
    sa, sb = load_model_state(one / "checkpoints" / "step3"), load_model_state(two / "checkpoints" / "step3")
    for name, value in sa.items():
        torch.testing.assert_close(sb[name], value, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def single(tmp_path_factory, corpus):
    run = tmp_path_factory.mktemp("single")
    train(_cfg(run, corpus, "batch_size=4"))
    return run


def _settings(corpus):
    return [f"data.train_files={corpus[0]}", f"data.val_files={corpus[1]}", "steps=3",
            "eval_every=3", "checkpoint_every=3", "grad_accum=2"]


def _cfg(run, corpus, *extra):
    from trainer import load_config

    return load_config(overrides=[f"run_dir={run}", *_settings(corpus), *extra])


@pytest.mark.slow
def test_ddp_two_processes_match_one(tmp_path, single, corpus):
    _torchrun(tmp_path / "ddp", *_settings(corpus), "batch_size=2", "checkpoint_every=1")
    _compare(single, tmp_path / "ddp")
    info = json.loads((tmp_path / "ddp" / "run.json").read_text())
    assert info["world_size"] == 2
    assert (tmp_path / "ddp" / "metrics.rank1.jsonl").is_file()  # each rank its own metrics file
    assert sorted(p.name for p in (tmp_path / "ddp" / "checkpoints").iterdir()) == ["step1", "step2", "step3"]
    # a DDP checkpoint resumes in one process (same global batch) and lands on the same weights
    resumed = train(_cfg(tmp_path / "resumed", corpus, "batch_size=4",
                         f"resume={tmp_path / 'ddp' / 'checkpoints' / 'step2'}"))
    assert [m["step"] for m in resumed.history if "loss" in m] == [2]
    for name, value in load_model_state(single / "checkpoints" / "step3").items():
        torch.testing.assert_close(resumed.model.state_dict()[name], value, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_fsdp_two_processes_match_one(tmp_path, single, corpus):
    _torchrun(tmp_path, *_settings(corpus), "batch_size=2", "parallel=fsdp")
    _compare(single, tmp_path)
    # the checkpoint holds full, unsharded tensors: it loads without any process group
    assert load_model(tmp_path).transformer.wte.weight.shape == (264, 64)
