"""Module mapping between two codebases (tracer.analysis._map, `sleuth map`, `diff --map`).

A is Hugging Face GPT-2 built from a config (nothing downloaded); B is a port of it written
here as a user would: nn.Linear instead of GPT-2's Conv1D (so every projection weight is stored
transposed), fused qkv, other module names, tied embedding. B gets A's weights and the same
batch. Record names never match; the map pairs the modules, and the diff then compares them.
The port's bug: attention without the 1/sqrt(head_dim) scale, in every block.
"""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn

import tracer
from tracer.analysis import map_modules, read_module_map

pytest.importorskip("transformers")

D, HEADS, LAYERS, VOCAB, T = 32, 2, 2, 64, 8


class Block(nn.Module):
    def __init__(self, scale: float | None) -> None:
        super().__init__()
        self.scale = scale
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.gelu = nn.GELU(approximate="tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(D, dim=2)
        q, k, v = (z.view(b, t, HEADS, D // HEADS).transpose(1, 2) for z in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        x = x + self.out(y.transpose(1, 2).reshape(b, t, D))
        return x + self.down(self.gelu(self.up(self.norm2(x))))


class Port(nn.Module):
    def __init__(self, scale: float | None = None, block: type | None = None,
                 **kw: float) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, D), nn.Embedding(16, D)
        self.blocks = nn.ModuleList((block(**kw) if block else Block(scale))
                                    for _ in range(LAYERS))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.tokens.weight

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB),
                                           labels[:, 1:].reshape(-1))


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=D, n_layer=LAYERS,
                        n_head=HEADS, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    return GPT2LMHeadModel(config)


def _port_of(gpt2: nn.Module, scale: float | None = None, port: nn.Module | None = None
             ) -> nn.Module:
    """`port` (default a Port) with GPT-2's weights; a block whose attention projection is not
    one `qkv` Linear copies `c_attn` itself (see test_diff_fused)."""
    port = Port(scale) if port is None else port
    h = gpt2.transformer
    with torch.no_grad():
        port.tokens.weight.copy_(h.wte.weight)
        port.positions.weight.copy_(h.wpe.weight)
        port.norm.load_state_dict(h.ln_f.state_dict())
        for block, theirs in zip(port.blocks, h.h):
            block.norm1.load_state_dict(theirs.ln_1.state_dict())
            block.norm2.load_state_dict(theirs.ln_2.state_dict())
            pairs = [(block.out, theirs.attn.c_proj), (block.up, theirs.mlp.c_fc),
                     (block.down, theirs.mlp.c_proj)]
            if hasattr(block, "qkv"):
                pairs.append((block.qkv, theirs.attn.c_attn))
            for mine, conv in pairs:
                mine.weight.copy_(conv.weight.t())  # Conv1D stores (in, out)
                mine.bias.copy_(conv.bias)
    return port


def _train(model: nn.Module, path: Path, hf: bool) -> Path:
    ids = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with tracer.Dumper(model, {"path": str(path), "level": "module", "mode": "statistics"}):
        loss = model(input_ids=ids, labels=ids).loss if hf else model(ids, ids)
        loss.backward()
        opt.step()
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("map")
    gpt2 = _gpt2()
    port, buggy = _port_of(gpt2), _port_of(gpt2, scale=1.0)  # before A's step changes them
    return {"a": _train(gpt2, root / "a", True), "port": _train(port, root / "port", False),
            "buggy": _train(buggy, root / "buggy", False)}


def test_modules_pair_by_their_weights_and_outputs(runs):
    m = map_modules(runs["a"], runs["port"])
    pairs = {a: b for a, b, _ in m.pairs}
    why = {a: w for a, _, w in m.pairs}
    assert pairs["transformer.h.0.attn.c_attn"] == "blocks.0.qkv"
    assert pairs["transformer.h.1.mlp.c_proj"] == "blocks.1.down"
    assert pairs["transformer.h.1.ln_2"] == "blocks.1.norm2"
    assert pairs["transformer.wte"] == "tokens" and pairs["transformer.ln_f"] == "norm"
    assert "stored transposed" in why["transformer.h.0.attn.c_attn"]
    assert "weight equal" in why["transformer.h.0.ln_1"]
    # no parameters of their own: paired by what they compute
    assert pairs["transformer.h.0.mlp.act"] == "blocks.0.gelu"
    assert why["transformer.h.0.mlp.act"].startswith("forward input and output compare the same")
    assert m.confidence["transformer.h.0.mlp.act"] == "high"
    assert pairs["<root>"] == "<root>"
    assert len(set(pairs.values())) == len(pairs)  # one B module per A module


def test_the_mapped_diff_compares_two_codebases(runs):
    plain = tracer.diff(runs["a"], runs["port"])
    assert plain.records["verdict"].isin(["only_a", "only_b"]).mean() > 0.8  # nothing matches
    m = map_modules(runs["a"], runs["port"])
    # every projection weight is stored transposed (the square ones keep their shape)
    assert set(m.permuted) == {f"transformer.h.{i}.{p}.weight" for i in range(LAYERS)
                               for p in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}
    result = tracer.diff(runs["a"], runs["port"], module_map=m)
    paired = result.records[~result.records["verdict"].isin(["only_a", "only_b"])]
    assert len(paired) > 100 and (paired["verdict"] == "same").all(), \
        paired[paired["verdict"] != "same"][["name", "b_name", "reason"]].to_string()
    row = paired.set_index("name").loc["transformer.h.0.mlp.c_fc.forward.0.output.0"]
    assert row["b_name"] == "blocks.0.up.forward.0.output.0"


def test_the_ports_bug_is_named_through_the_map(runs, tmp_path):
    """Attention without its scale: the first divergence is the attention's result, the input
    of the first block's output projection, named as A calls it and as B does."""
    mapping = tmp_path / "map.yaml"
    mapping.write_text(map_modules(runs["a"], runs["port"]).to_yaml())
    first = tracer.diff(runs["a"], runs["buggy"],
                        module_map=read_module_map(mapping)).first_divergence
    assert first["name"] == "transformer.h.0.attn.c_proj.forward.0.input.0"
    assert first["b_name"] == "blocks.0.out.forward.0.input.0"


def test_an_edited_map_is_read_and_a_bad_one_is_named(tmp_path):
    good = tmp_path / "map.yaml"
    good.write_text('modules:\n  "a.x": "b.y"  # edited\n  a.z: b.w\nonly_a: []\n')
    assert read_module_map(good).b_to_a() == {"b.y": "a.x", "b.w": "a.z"}
    for text, match in (("modules: [1, 2]\n", "expected a `modules:` mapping"),
                        ("modules: {a: b, c: b}\n", "paired with both"),
                        ("modules: {a: b}\npermuted: x\n", "must be a list"),
                        ("modules: {a: [\n", "not YAML")):
        good.write_text(text)
        with pytest.raises(tracer.ConfigError, match=match):
            read_module_map(good)
    with pytest.raises(tracer.ConfigError, match="cannot read it"):
        read_module_map(tmp_path / "missing.yaml")


def test_the_command_line_writes_and_reads_the_map(runs, tmp_path, capsys):
    from sleuth.cli import main

    mapping = tmp_path / "map.yaml"
    assert main(["map", str(runs["a"]), str(runs["port"]), "-o", str(mapping)]) == 0
    err = capsys.readouterr().err
    assert "module pair(s)" in err and "8 parameter(s) stored in another layout" in err
    text = mapping.read_text()
    assert '"transformer.h.0.attn.c_attn": "blocks.0.qkv"  # high: parameters: weight same ' \
        'values' in text
    assert main(["diff", "--map", str(mapping), str(runs["a"]), str(runs["port"])]) == 0
    assert "through a module map" in capsys.readouterr().out
    assert main(["diff", "--map", str(mapping), str(runs["a"]), str(runs["buggy"])]) == 1
    out = capsys.readouterr().out
    assert "first divergence (compute): transformer.h.0.attn.c_proj.forward.0.input.0" in out
    mapping.write_text("modules: [a]\n")
    assert main(["diff", "--map", str(mapping), str(runs["a"]), str(runs["port"])]) == 2
    assert "expected a `modules:` mapping" in capsys.readouterr().err
    assert main(["map", str(runs["a"]), str(tmp_path / "none")]) == 2


def test_two_codebases_without_a_map_are_not_called_the_same(runs):
    """Almost no record pairs by name: a "same" would speak for records never compared."""
    result = tracer.diff(runs["a"], runs["port"])
    assert result.status == "diverged" and result.exit_code == 1
    assert result.first_divergence is None
    assert result.notes[0].startswith("most records of each side have no partner")
    assert "sleuth map A B" in result.notes[0]
