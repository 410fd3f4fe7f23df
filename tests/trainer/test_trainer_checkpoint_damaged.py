"""Damaged checkpoints (meta.json, model.pt, trainer.pt) give one CheckpointError naming the
file and what to do, for resume and for generate, and the CLI exits 2 without a traceback."""
from __future__ import annotations

import shutil

import pytest

from sleuth.cli import main
from trainer import CheckpointError, train
from trainer.generate import load_model


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus):
    from trainer import load_config

    run = tmp_path_factory.mktemp("ckpt") / "run"
    train(load_config(overrides=[f"run_dir={run}", f"data.train_files={corpus[0]}",
                                 f"data.val_files={corpus[1]}", "eval_every=0", "steps=2",
                                 "checkpoint_every=2"]))
    return run


_DAMAGE = {
    "meta_garbage": ("meta.json", b"\xff\xfe garbage"),
    "meta_list": ("meta.json", b"[1, 2, 3]"),
    "meta_no_config": ("meta.json", b'{"format_version": "1.0", "step": 2}'),
    "model_truncated": ("model.pt", None),
    "model_garbage": ("model.pt", b"not a torch file at all"),
    "model_missing": ("model.pt", b""),
    "trainer_truncated": ("trainer.pt", None),
}


def _damaged_copy(trained, tmp_path, case):
    ckpt = tmp_path / "run" / "checkpoints" / "step2"
    shutil.copytree(trained / "checkpoints" / "step2", ckpt)
    name, data = _DAMAGE[case]
    target = ckpt / name
    if case == "model_missing":
        target.unlink()
    elif data is None:
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    else:
        target.write_bytes(data)
    return ckpt, target


@pytest.mark.parametrize("case", sorted(c for c in _DAMAGE if not c.startswith("trainer")))
def test_generate_from_a_damaged_checkpoint(trained, tmp_path, capsys, case):
    ckpt, target = _damaged_copy(trained, tmp_path, case)
    with pytest.raises(CheckpointError) as e:
        load_model(ckpt)
    assert str(target) in str(e.value)
    assert main(["generate", "--checkpoint", str(ckpt), "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert str(target) in err and "Traceback" not in err


@pytest.mark.parametrize("case", ["meta_garbage", "model_truncated", "trainer_truncated"])
def test_resume_from_a_damaged_checkpoint(trained, tmp_path, corpus, case):
    from trainer import load_config

    ckpt, target = _damaged_copy(trained, tmp_path, case)
    config = load_config(overrides=[f"run_dir={tmp_path / 'run'}", f"data.train_files={corpus[0]}",
                                    f"data.val_files={corpus[1]}", "eval_every=0", "steps=4",
                                    f"resume={ckpt}"])
    with pytest.raises(CheckpointError) as e:
        train(config)
    assert str(target) in str(e.value)
