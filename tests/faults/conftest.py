"""The fault suite's one real run: the reference trainer with every tool on, made once per
session and copied for each case, so every damaged file is a file Sleuth really wrote."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def pristine(tmp_path_factory) -> Path:
    """RUN with dump (module level, statistics and tensors, steps 0-1), summary, one profiled
    window, IR graphs and a checkpoint at step 3."""
    from sleuth.cli import main

    root = tmp_path_factory.mktemp("pristine")
    (root / "dump.json").write_text(json.dumps({"steps": "0-1", "level": "module",
                                                "mode": "full"}))
    (root / "prof.json").write_text(json.dumps({"wait": 0, "warmup": 1, "active": 1}))
    run = root / "run"
    code = main(["train", "--preset", "tiny", "--set", "steps=3", "--set", "checkpoint_every=3",
                 "--set", "eval_every=0", "--run-dir", str(run), "--summary",
                 "--profile", str(root / "prof.json"), "--dump", str(root / "dump.json"),
                 "--save-graphs"])
    assert code == 0
    shutil.rmtree(run / "data", ignore_errors=True)
    return run


@pytest.fixture
def runs(pristine, tmp_path):
    """(good, bad): two copies of the pristine run; the test damages `bad`."""
    good = tmp_path / "good"
    bad = tmp_path / "bad"
    shutil.copytree(pristine, good)
    shutil.copytree(pristine, bad)
    return good, bad
