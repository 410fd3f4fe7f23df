"""Config: presets, JSON files, dotted overrides, type checks and did-you-mean messages."""
from __future__ import annotations

import dataclasses
import json

import pytest

from trainer import ConfigError, TrainConfig, load_config, small, tiny


def test_presets_are_valid_and_frozen():
    assert tiny().model.n_layer == 2 and small().model.n_embd == 256
    with pytest.raises(dataclasses.FrozenInstanceError):
        tiny().steps = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        TrainConfig(3)  # type: ignore[misc]  # keyword-only


def test_round_trip_through_dict():
    cfg = load_config(overrides=["data.train_files=a.jsonl,b.parquet", "lora.enabled=true"])
    assert cfg.data.train_files == ("a.jsonl", "b.parquet")
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg


def test_file_then_overrides(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"steps": 7, "optim": {"lr": 0.01, "min_lr": 0.001}}))
    cfg = load_config(path, overrides=["optim.lr=2e-3", "precision=bf16", "stop_after=null"])
    assert cfg.steps == 7 and cfg.optim.lr == 2e-3 and cfg.optim.min_lr == 0.001
    assert cfg.precision == "bf16" and cfg.stop_after is None


@pytest.mark.parametrize("overrides, message", [
    (["optim.lrr=1"], "unknown key 'optim.lrr'; did you mean 'optim.lr'?"),
    (["stepz=3"], "did you mean 'steps'?"),
    (["optimm.lr=3"], "did you mean 'optim'?"),
    (["optim.lr=fast"], "optim.lr must be a number"),
    (["steps=2.5"], "steps must be an integer"),
    (["recompute=yes"], "recompute must be true or false"),
    (["precision=fp16"], "is not one of ['fp32', 'bf16']"),
    (["optim=3"], "'optim' is a section"),
    (["steps"], "is not KEY=VALUE"),
    (["data.seq_len=128"], "exceeds model.block_size=64"),
    (["model.n_head=3"], "not divisible"),
])
def test_override_errors(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides)
    assert message in str(info.value)


def test_file_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model": {"n_layers": 3}}))
    with pytest.raises(ConfigError, match=r"unknown key 'model.n_layers'; did you mean 'model.n_layer'\?"):
        load_config(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must hold a JSON object"):
        load_config(bad)
    bad.write_text("{oops")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(bad)
    with pytest.raises(ConfigError, match="did you mean 'tiny'"):
        load_config(preset="tiy")


def test_tiny_step_is_well_under_a_second(make_config):
    from trainer import train

    state = train(make_config("steps=3"))
    assert len(state.history) == 3
    times = sorted(m["step_time_s"] for m in state.history)
    assert times[1] < 0.5  # the median step; typically about 10 ms on one core


def test_cuda_without_a_gpu_is_a_clear_error(make_config):
    import torch

    from trainer import train

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(ConfigError, match="device=cuda but torch sees no CUDA device"):
        train(make_config("device=cuda"))


@pytest.mark.parametrize("overrides, message", [
    (["optim.lr=NaN"], "optim.lr must be a finite number, got nan"),
    (["optim.grad_clip=Infinity"], "optim.grad_clip must be a finite number, got inf"),
    (["lora.alpha=-Infinity"], "lora.alpha must be a finite number"),
])
def test_non_finite_numbers_are_refused(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides)
    assert message in str(info.value)


def test_nan_is_refused_when_built_directly():
    from trainer.config import OptimConfig

    with pytest.raises(ConfigError, match="optim.min_lr <= optim.lr"):
        OptimConfig(lr=float("nan"))


def test_a_key_given_twice_is_refused(tmp_path):
    bad = tmp_path / "twice.json"
    bad.write_text('{"steps": 4, "optim": {"lr": 0.1, "lr": 0.001}}')
    with pytest.raises(ConfigError, match=r"twice\.json: key 'lr' appears twice"):
        load_config(bad)
