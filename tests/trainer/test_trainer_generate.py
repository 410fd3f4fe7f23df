"""Generation: seeded determinism, greedy, top-k, top-p, repetition penalty, the CLI."""
from __future__ import annotations

import pytest
import torch

from sleuth.cli import main
from trainer import GPT, ModelConfig, generate, stream_generate, train
from trainer.generate import apply_repetition_penalty, filter_logits


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return GPT(ModelConfig()).eval()


def test_seed_fixes_the_sample(model):
    a = generate(model, [256, 65], max_new_tokens=12, temperature=1.0, top_k=50, seed=7)
    b = generate(model, [256, 65], max_new_tokens=12, temperature=1.0, top_k=50, seed=7)
    c = generate(model, [256, 65], max_new_tokens=12, temperature=1.0, top_k=50, seed=8)
    assert a == b and a != c and len(a) == 12
    assert list(stream_generate(model, [256, 65], max_new_tokens=12, temperature=1.0, top_k=50, seed=7)) == a


def test_greedy_is_argmax_and_ignores_seed(model):
    g1 = generate(model, [256], max_new_tokens=5, temperature=0, seed=1)
    g2 = generate(model, [256], max_new_tokens=5, temperature=0, seed=2)
    assert g1 == g2
    logits = model(torch.tensor([[256]]))[0][0, -1]
    assert g1[0] == int(logits.argmax())


def test_top_k_and_top_p_filter():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.isfinite(filter_logits(logits, top_k=2)).tolist() == [True, True, False, False]
    assert torch.isfinite(filter_logits(logits, top_p=0.7)).tolist() == [True, True, False, False]
    assert torch.isfinite(filter_logits(logits, top_p=0.85)).tolist() == [True, True, True, False]
    assert torch.isfinite(filter_logits(logits, top_p=0.1)).tolist() == [True, False, False, False]
    shuffled = logits[[2, 0, 3, 1]]  # order must not matter
    assert torch.isfinite(filter_logits(shuffled, top_p=0.7)).tolist() == [False, True, False, True]


def test_top_k_one_sampling_equals_greedy(model):
    greedy = generate(model, [256, 70], max_new_tokens=8, temperature=0)
    assert generate(model, [256, 70], max_new_tokens=8, temperature=0.9, top_k=1, seed=3) == greedy


def test_repetition_penalty():
    logits = torch.tensor([2.0, -1.0, 0.5])
    out = apply_repetition_penalty(logits, torch.tensor([0, 1]), 2.0)
    assert out.tolist() == [1.0, -2.0, 0.5]


def test_stop_id_and_errors(model):
    first = generate(model, [256], max_new_tokens=1, temperature=0)[0]
    assert generate(model, [256], max_new_tokens=10, temperature=0, stop_ids=(first,)) == [first]
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        generate(model, [])


def test_cli_generate_streams_text(make_config, tmp_path, capsys):
    train(make_config("steps=2", "checkpoint_every=2", run="g"))
    capsys.readouterr()
    args = ["generate", "--checkpoint", str(tmp_path / "g"), "--prompt", "The ", "--max-new-tokens", "20",
            "--seed", "1"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert first.startswith("The ") and len(first) > 5
    assert main(args) == 0
    assert capsys.readouterr().out == first
    assert main(["generate", "--checkpoint", str(tmp_path / "nothing")]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err
