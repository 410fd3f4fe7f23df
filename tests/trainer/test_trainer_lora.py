"""LoRA: only adapters train, adapters save and load, merging keeps the output."""
from __future__ import annotations

import pytest
import torch

from trainer import (GPT, CheckpointError, ConfigError, LoRAConfig, LoRALinear, ModelConfig,
                     apply_lora, load_lora, load_model, lora_state_dict, merge_lora, save_lora, train)


def _model(seed=0):
    torch.manual_seed(seed)
    return GPT(ModelConfig())


def test_apply_selects_by_regex_and_freezes_the_rest():
    model = _model()
    names = apply_lora(model, LoRAConfig(enabled=True, targets=r"mlp\.c_fc$", rank=4))
    assert names == ["transformer.h.0.mlp.c_fc", "transformer.h.1.mlp.c_fc"]
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == [f"transformer.h.{i}.mlp.c_fc.lora_{m}" for i in (0, 1) for m in "AB"]
    with pytest.raises(ConfigError, match="matches no Linear layer"):
        apply_lora(_model(), LoRAConfig(targets="nothing_here"))


def test_training_changes_only_adapters(make_config, tmp_path):
    base_run = train(make_config("steps=1", "checkpoint_every=1", run="base"))
    base_state = {k: v.clone() for k, v in base_run.model.state_dict().items()}
    tuned = train(make_config("steps=3", "lora.enabled=true", "lora.rank=4", "optim.lr=1e-2",
                              f"lora.base_checkpoint={tmp_path / 'base'}", "checkpoint_every=3", run="tuned"))
    for key, value in tuned.model.state_dict().items():
        plain = key.replace(".base.", ".")
        if "lora_" in key:
            continue
        assert torch.equal(value, base_state[plain]), f"{key} changed although frozen"
    lora_b = [v for k, v in tuned.model.state_dict().items() if k.endswith("lora_B")]
    assert len(lora_b) == 4 and all(b.abs().sum() > 0 for b in lora_b)  # B starts at zero
    fresh = _model()
    apply_lora(fresh, LoRAConfig(enabled=True, rank=4))
    load_lora(fresh, tmp_path / "tuned" / "checkpoints" / "step3" / "adapter.pt")
    for key, value in lora_state_dict(tuned.model).items():
        assert torch.equal(lora_state_dict(fresh)[key], value)
    # the generation loader merges the adapters back into plain Linear layers
    merged = load_model(tmp_path / "tuned")
    assert not any(isinstance(m, LoRALinear) for m in merged.modules())
    x = torch.randint(0, 256, (1, 16))
    tuned.model.eval()
    torch.testing.assert_close(merged(x)[0], tuned.model(x)[0], rtol=1e-4, atol=1e-5)


def test_merge_equals_adapter_output():
    model = _model()
    apply_lora(model, LoRAConfig(enabled=True, rank=4, targets=r"(attn|mlp)\.c_"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)  # a non-zero update, or the test would prove nothing
    model.eval()
    x = torch.randint(0, 256, (2, 20))
    before = model(x)[0]
    merge_lora(model)
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    torch.testing.assert_close(model(x)[0], before, rtol=1e-4, atol=1e-5)


def test_save_and_load_adapters(tmp_path):
    source = _model()
    cfg = LoRAConfig(enabled=True, rank=2)
    apply_lora(source, cfg)
    with torch.no_grad():
        for n, p in source.named_parameters():
            if "lora_" in n:
                p.uniform_()
    path = save_lora(source, tmp_path / "adapter.pt")
    blob = torch.load(path, weights_only=True)
    assert set(blob["adapters"]) == set(lora_state_dict(source))
    target = _model()
    apply_lora(target, cfg)
    load_lora(target, path)
    for k, v in lora_state_dict(source).items():
        assert torch.equal(lora_state_dict(target)[k], v)
    other = _model()
    apply_lora(other, LoRAConfig(enabled=True, rank=3))
    with pytest.raises(CheckpointError, match="different lora.rank"):
        load_lora(other, path)
