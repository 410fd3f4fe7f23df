"""Fixtures for the trainer tests: a demo corpus written once per session, tiny configs."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> tuple[Path, Path]:
    from trainer._corpus import write_demo_corpus

    return write_demo_corpus(tmp_path_factory.mktemp("corpus"), "pretrain")


@pytest.fixture
def make_config(tmp_path, corpus):
    """`make_config("steps=4", ..., run="a")` -> a tiny TrainConfig on the session corpus."""
    from trainer import load_config

    def make(*overrides: str, run: str = "run"):
        base = [f"run_dir={tmp_path / run}", f"data.train_files={corpus[0]}",
                f"data.val_files={corpus[1]}", "eval_every=0", "steps=4"]
        return load_config(overrides=base + list(overrides))

    return make


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    # the tiny models gain nothing from threads, and on a shared 2-core machine threads fight
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
