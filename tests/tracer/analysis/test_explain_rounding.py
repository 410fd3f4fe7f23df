"""`sleuth explain` on a bug inside rounding: A in float32, B in bf16 autocast and with a bug
(an MLP's output scaled by 1.5, a norm's epsilon changed). bf16's tolerance lets the diff judge
the record where the bug begins "same" (small values, within the absolute tolerance), and the
ops the diff's chain re-runs all stay within their rounding; the verdict must still be "bug" at
the faulty op, module and line, saying that bf16 rounding is there too. bf16 alone stays
precision. Two families: the hand-written decoder of tests/tracer/models.py and a Hugging Face
Qwen2 built from a config."""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import tracer
from tracer.analysis import explain

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import TinyCausalLM, TinyConfig  # noqa: E402

HERE = "tests/tracer/analysis/test_explain_rounding.py"


def _line(mark: str) -> str:
    """FILE:LINE of the line of this file that holds `mark`: where B's bug is."""
    text = Path(__file__).read_text()
    return f"{HERE}:{text[:text.index(mark)].count(chr(10)) + 1}"


def _qwen2() -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    logging.getLogger("transformers").setLevel(logging.ERROR)
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        attn_implementation="eager"))


def _layers(model: nn.Module) -> nn.ModuleList:
    return model.model.layers if hasattr(model, "model") else model.layers


def _scaled(mlp: nn.Module) -> None:
    """B's bug: the MLP's output comes out half as large again."""
    inner = mlp.forward

    def forward(*args, **kwargs):
        return inner(*args, **kwargs) * 1.5  # THE SCALE

    mlp.forward = forward


def _centred(mlp: nn.Module, swapped: bool) -> None:
    """The MLP's output less its mean; B's bug: the operands of the subtraction swapped."""
    inner = mlp.forward

    def forward(*args, **kwargs):
        out = inner(*args, **kwargs)
        mean = out.mean(-1, keepdim=True)
        return torch.sub(mean, out) if swapped else torch.sub(out, mean)  # THE SWAP

    mlp.forward = forward


def _dump(path: Path, family: str, bug: str = "", bf16: bool = False) -> Path:
    torch.manual_seed(0)
    model = _qwen2() if family == "qwen2" else TinyCausalLM(TinyConfig())
    layer = _layers(model)[0]
    if bug == "scale":
        _scaled(layer.mlp)
    elif bug in ("centred", "swap"):
        _centred(layer.mlp, swapped=bug == "swap")
    elif bug == "eps":
        norm = layer.post_attention_layernorm
        setattr(norm, "eps" if hasattr(norm, "eps") else "variance_epsilon", 0.1)
    ids = torch.randint(1, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with tracer.Dumper(model, {"path": str(path), "level": "op", "mode": "tensor"}):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    return path


# the Hugging Face family under `slow`: the quick lane holds every rule on the tiny model
@pytest.fixture(scope="module", params=["tiny", pytest.param("qwen2", marks=pytest.mark.slow)])
def runs(request, tmp_path_factory) -> dict[str, Path]:
    family = request.param
    if family == "qwen2":
        pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp(f"rounding_{family}")
    out = {"family": family, "a": _dump(root / "a", family),
           "bf16": _dump(root / "bf16", family, bf16=True)}
    for bug in ("scale", "eps"):
        out[f"bf16_{bug}"] = _dump(root / f"bf16_{bug}", family, bug, bf16=True)
        out[bug] = _dump(root / bug, family, bug)
    return out


def test_a_scaled_mlp_output_under_bf16_is_a_bug_at_its_line_with_rounding_named(runs):
    e = explain(runs["a"], runs["bf16_scale"])
    assert e.status == "bug", e.verdict
    assert e.blamed["op"] == "aten.mul" and e.blamed["fault"] == "added", e.blamed
    assert e.blamed["module"] == "model.layers.0.mlp" if runs["family"] == "qwen2" \
        else e.blamed["module"] == "layers.0.mlp"
    assert e.blamed["source"] == _line("# THE SCALE")
    assert "bfloat16" in e.verdict and "rounding is present too" in e.verdict


def test_a_changed_norm_epsilon_under_bf16_is_a_bug_at_the_norm_with_rounding_named(runs):
    e = explain(runs["a"], runs["bf16_eps"])
    assert e.status == "bug", e.verdict
    assert e.blamed["module"].endswith("layers.0.post_attention_layernorm"), e.blamed
    assert e.blamed["fault"] == "arguments" and "0.1 in B" in e.verdict
    assert "bfloat16" in e.verdict and "rounding is present too" in e.verdict


def test_bf16_alone_is_still_precision(runs):
    e = explain(runs["a"], runs["bf16"])
    assert e.status == "precision" and e.blamed is None, e.verdict
    assert "bfloat16" in e.verdict


def test_two_bf16_runs_one_with_a_bug_name_it_where_the_diff_saw_none(runs):
    """No dtype differs: the difference the chain's first op receives was made upstream, in
    records the diff judged within bf16's tolerance, and the search finds where."""
    e = explain(runs["bf16"], runs["bf16_scale"])
    assert e.status == "bug", e.verdict
    assert e.blamed["op"] == "aten.mul" and e.blamed["source"] == _line("# THE SCALE")
    assert "rounding is present" not in e.verdict


@pytest.mark.parametrize("bug", ["scale", "eps"])
def test_the_same_bugs_in_float32_are_bugs_without_rounding_named(runs, bug):
    e = explain(runs["a"], runs[bug])
    assert e.status == "bug", e.verdict
    assert "rounding is present" not in e.verdict


def test_swapped_operands_under_bf16_are_a_bug_at_the_call(tmp_path):
    """Operands of two shapes swapped pair with nothing: re-run on A's tensors argument by
    argument B's call looks like A's, so the call is judged by its inputs' values."""
    a = _dump(tmp_path / "a", "tiny", "centred")
    e = explain(a, _dump(tmp_path / "b", "tiny", "swap", bf16=True))
    assert e.status == "bug", e.verdict
    assert e.blamed["op"] == "aten.sub" and e.blamed["source"] == _line("# THE SWAP")
    assert "rounding is present too" in e.verdict


def _float_loss(path: Path, bf16: bool) -> Path:
    """An MLP under autocast whose loss is taken on `out.float()` outside it, three steps:
    only B's `.float()` dispatches a cast (A's output is float32 already), and the next op's
    input is float32 on both sides."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with tracer.Dumper(model, {"path": str(path), "level": "mix", "mode": "tensor",
                               "steps": "0-2"}):
        for step in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                out = model(x)
            loss = out.float().pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return path


@pytest.mark.slow
def test_a_cast_up_of_what_autocast_made_is_precision_not_an_op_added(tmp_path):
    # the cast only B runs takes a bfloat16 value: the difference it passes on is that
    # precision's rounding, never "op added"
    e = explain(_float_loss(tmp_path / "a", False), _float_loss(tmp_path / "b", True))
    assert e.status == "precision", e.verdict
    assert "aten._to_copy" in e.verdict and "bfloat16 rounding" in e.verdict, e.verdict


class _Patches(nn.Module):
    """A ViT's embedding: a convolution's patches (bfloat16 under autocast) concatenated with
    a float32 class token, which autocast's `cat` promotes with a cast only B makes."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 4, stride=4)
        self.cls = nn.Parameter(torch.randn(1, 1, 16))
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x).flatten(2).transpose(1, 2)
        h = torch.cat((self.cls.expand(x.shape[0], -1, -1), h), dim=1)
        return self.head(h[:, 0] + h[:, 1:].mean(1))


@pytest.mark.parametrize("level", ["mix", pytest.param("op", marks=pytest.mark.slow)])
def test_a_cast_up_that_autocasts_cat_makes_is_precision(tmp_path, level):
    """bf16 autocast alone: `cat` casts the bfloat16 patches up to the class token's float32,
    an `aten._to_copy` only B runs whose output B's float32 tolerance then judges. The value is
    A's within bfloat16's rounding: precision, never "op added"."""
    def run(path, low):
        torch.manual_seed(0)
        model = _Patches()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
        with tracer.Dumper(model, {"path": str(path), "steps": "0", "level": level,
                                   "mode": "tensor"}):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=low):
                loss = nn.functional.cross_entropy(model(x), torch.tensor([0, 2]))
            loss.backward()
            opt.step()

    run(tmp_path / "a", False)
    run(tmp_path / "b", True)
    e = explain(tmp_path / "a", tmp_path / "b")
    assert e.status == "precision", e.verdict
    assert "within bfloat16 rounding" in e.verdict, e.verdict
