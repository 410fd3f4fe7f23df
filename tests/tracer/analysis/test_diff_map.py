"""Module mapping between two codebases (tracer.analysis._map, `sleuth map`, `diff --map`).

A is Hugging Face GPT-2 built from a config (nothing downloaded); B is a port of it written
here as a user would: nn.Linear instead of GPT-2's Conv1D (so every projection weight is stored
transposed), fused qkv, other module names, tied embedding. B gets A's weights and the same
batch. Record names never match; the map pairs the modules, and the diff then compares them.
The port's bug: attention without the 1/sqrt(head_dim) scale, in every block.

The second half runs faithful ports with containers of their own (tests/tracer/ports.py: GPT-2
with `attn` and `mlp` containers against Hugging Face's, whose dropouts at p = 0 output what
the container outputs; Llama with one fused qkv) at level mix, and ports with one fault in
block 1.
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


def _train(model: nn.Module, path: Path, hf: bool, level: str = "module", io: str = "both",
           reference: tracer.LiveReference | None = None) -> Path:
    ids = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with tracer.Dumper(model, {"path": str(path), "level": level, "mode": "statistics",
                               "io": io}, reference=reference):
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


# -- faithful ports with containers of their own (tests/tracer/ports.py) ----------------------

@pytest.fixture(scope="module")
def ported(tmp_path_factory) -> dict[str, Path]:
    from tests.tracer import ports

    root = tmp_path_factory.mktemp("ported")
    gpt2, llama = ports.hf_gpt2(), ports.hf_llama()
    fresh = ports.hf_gpt2(trained=False)  # every LayerNorm holds ones and zeros
    models = {"gpt2_port": ports.GPT2Port.of(gpt2), "scale": ports.GPT2Port.of(gpt2, "scale"),
              "bias": ports.GPT2Port.of(gpt2, "bias"), "llama_port": ports.LlamaPort.of(llama),
              "llama_scale": ports.LlamaPort.of(llama, "scale"),
              "fresh_port": ports.GPT2Port.of(fresh),
              "fresh_scale": ports.GPT2Port.of(fresh, "scale")}
    out = {name: _train(m, root / name, False, "mix") for name, m in models.items()}
    for name, m in (("gpt2", gpt2), ("llama", llama), ("fresh", fresh)):
        out[name] = _train(m, root / name, True, "mix")
    return out


def test_dropouts_at_p0_never_take_a_containers_place(ported):
    """HF's resid_dropout outputs what its attention container outputs; paired by output
    alone it took the port's `attn`, and the diff compared a dropout's input with the
    attention's. Inputs and outputs together, and the tree, pair container with container."""
    m = map_modules(ported["gpt2"], ported["gpt2_port"])
    pairs = {a: b for a, b, _ in m.pairs}
    for i in range(3):
        assert pairs[f"transformer.h.{i}.attn"] == f"blocks.{i}.attn"
        assert pairs[f"transformer.h.{i}.mlp"] == f"blocks.{i}.mlp"
        assert pairs[f"transformer.h.{i}.mlp.act"] == f"blocks.{i}.mlp.act"
        assert {f"transformer.h.{i}.attn.resid_dropout",
                f"transformer.h.{i}.mlp.dropout"} <= set(m.only_a)
    assert "transformer.drop" in m.only_a and m.only_b == []
    assert set(m.confidence.values()) == {"high"} and m.ambiguous == []
    why = {a: w for a, _, w in m.pairs}
    assert why["transformer.h.1.attn"] == ("forward input and output compare the same; its "
                                           "place in the tree agrees")


def test_without_inputs_the_tree_keeps_dropouts_out(tmp_path):
    """A dump of outputs only: a dropout's output is its container's, and no input tells them
    apart; the place in the tree still does."""
    from tests.tracer import ports

    gpt2 = ports.hf_gpt2()
    port = ports.GPT2Port.of(gpt2)
    a, b = (_train(gpt2, tmp_path / "a", True, io="output"),
            _train(port, tmp_path / "b", False, io="output"))
    m = map_modules(a, b)
    pairs = {x: y for x, y, _ in m.pairs}
    assert [pairs[f"transformer.h.{i}.{c}"] for i in range(3) for c in ("attn", "mlp")] == \
        [f"blocks.{i}.{c}" for i in range(3) for c in ("attn", "mlp")]
    assert m.confidence["transformer.h.1.attn"] == "medium"
    assert "transformer.h.1.attn.resid_dropout" in m.only_a and m.only_b == []
    assert tracer.diff(a, b, module_map=m).exit_code == 0


def test_a_faithful_port_diffs_same_through_the_generated_map(ported):
    for a, b in (("gpt2", "gpt2_port"), ("llama", "llama_port")):
        result = tracer.diff(ported[a], ported[b], module_map=map_modules(ported[a], ported[b]))
        assert result.status == "same" and result.exit_code == 0, result.first_divergence
        # ops inside paired modules differ between codebases (`x + attn` against
        # `attn + residual`): not compared, never a divergence
        rows = result.records
        aside = rows[rows["reason"].str.startswith("not compared: inside modules")]
        assert len(aside) and ((aside["op"] != "") | (aside["index"] > 0)).all()
        assert (rows["verdict"] == "same").sum() > 1000


@pytest.mark.parametrize("fault, first, in_b", [
    ("scale", "transformer.h.1.attn.c_proj.forward.0.input.0",
     "blocks.1.attn.proj.forward.0.input.0"),
    ("bias", "transformer.h.1.mlp.c_proj.forward.0.output.0",
     "blocks.1.mlp.proj.forward.0.output.0"),
    ("llama_scale", "model.layers.1.self_attn.o_proj.forward.0.input.0",
     "blocks.1.o.forward.0.input.0")])
def test_a_fault_in_block_1_is_named_in_block_1(ported, fault, first, in_b):
    """The map made from the faulty port's own dump: what lies after the fault computes other
    values, so containers there pair by their place in the tree (medium), the same pairs as
    the faithful port's map."""
    a = "llama" if fault.startswith("llama") else "gpt2"
    m = map_modules(ported[a], ported[fault])
    faithful = map_modules(ported[a], ported[f"{a}_port"])
    assert [(x, y) for x, y, _ in m.pairs] == [(x, y) for x, y, _ in faithful.pairs]
    assert m.fused == faithful.fused
    block = "model.layers.2" if a == "llama" else "transformer.h.2"
    assert m.confidence[block] == "medium"
    assert "holds the pairs of its" in dict((x, w) for x, _, w in m.pairs)[block]
    result = tracer.diff(ported[a], ported[fault], module_map=m)
    assert result.exit_code == 1
    assert (result.first_divergence["name"], result.first_divergence["b_name"]) == (first, in_b)


def test_the_llama_port_fuses_what_llama_splits(ported):
    m = map_modules(ported["llama"], ported["llama_port"])
    assert [(a, b) for a, b, _ in m.fused] == [
        ([f"model.layers.{i}.self_attn.{p}_proj" for p in "qkv"], [f"blocks.{i}.qkv"])
        for i in range(3)]
    pairs = {a: b for a, b, _ in m.pairs}
    assert pairs["model.layers.0"] == "blocks.0" and pairs["model.layers.1.mlp.down_proj"] == \
        "blocks.1.down"
    # Llama's attention and MLP containers and its SiLU module have nothing to stand for
    assert {"model.layers.0.self_attn", "model.layers.0.mlp", "model.layers.0.mlp.act_fn",
            "model.rotary_emb"} <= set(m.only_a) and m.only_b == []


def test_values_held_alike_are_told_apart_or_listed_as_ambiguous(ported, tmp_path, capsys):
    """Fresh LayerNorms all hold ones and zeros: inputs and outputs tell them apart in a
    faithful port; after a fault they no longer compare, the recorded order pairs them, and
    the map says so."""
    from sleuth.cli import main

    m = map_modules(ported["fresh"], ported["fresh_port"])
    why = {a: w for a, _, w in m.pairs}
    assert m.ambiguous == [] and m.confidence["transformer.h.2.ln_1"] == "high"
    assert why["transformer.h.2.ln_1"].endswith("input and output compare the same")
    out = tmp_path / "map.yaml"
    assert main(["map", str(ported["fresh"]), str(ported["fresh_scale"]), "-o", str(out)]) == 0
    err = capsys.readouterr().err
    m = read_module_map(out)
    assert [a for a, _, _ in m.ambiguous] == ["transformer.h.1.ln_2", "transformer.h.2.ln_1",
                                              "transformer.h.2.ln_2"]
    assert m.ambiguous[0][1] == ["blocks.2.ln1", "blocks.2.ln2", "ln_f"]
    assert '"transformer.h.1.ln_2": "blocks.1.ln2"  # low: parameters: weight equal' in \
        out.read_text()
    assert "3 low), " in err and "3 ambiguous pair(s)" in err
    assert "ambiguous: transformer.h.1.ln_2 -> blocks.1.ln2 (as good: blocks.2.ln1, " in err


def test_a_hand_edited_map_stays_authoritative(ported, tmp_path, capsys):
    from sleuth.cli import main

    a, b = str(ported["gpt2"]), str(ported["gpt2_port"])
    path = tmp_path / "map.yaml"
    assert main(["map", a, b, "-o", str(path)]) == 0
    assert main(["map", a, b, "-o", str(path)]) == 0  # its own, unedited: written again
    text = path.read_text()
    text = text.replace('"blocks.0.mlp.act"  # high', '"blocks.0.mlp"  # high')  # a bad edit
    text = text.replace('  "transformer.h.0.mlp": "blocks.0.mlp"', '  "x": "y"')
    text = text.replace("only_a:\n", 'only_a:\n  - "transformer.h.1.mlp.act"\n')
    text = text.replace('  "transformer.h.1.mlp.act": "blocks.1.mlp.act"', '  "z": "w"')
    path.write_text(text)
    capsys.readouterr()
    assert main(["map", a, b, "-o", str(path)]) == 2
    assert "edited by hand" in capsys.readouterr().err and path.read_text() == text
    assert main(["map", a, b, "--keep", str(path), "-o", str(path)]) == 0
    m = read_module_map(path)
    pairs = {x: y for x, y, _ in m.pairs}
    assert pairs["transformer.h.0.mlp.act"] == "blocks.0.mlp"  # the edit stands
    assert "transformer.h.0.mlp" in m.only_a and "blocks.0.mlp.act" in m.only_b
    assert "transformer.h.1.mlp.act" in m.only_a and "blocks.1.mlp.act" in m.only_b
    assert pairs["x"] == "y" and pairs["transformer.h.1.mlp"] == "blocks.1.mlp"
    line = next(x for x in path.read_text().splitlines() if "transformer.h.0.mlp.act" in x)
    assert line.startswith('  "transformer.h.0.mlp.act": "blocks.0.mlp"  # given: ') and \
        line.endswith("the dumps alone pair transformer.h.0.mlp.act with blocks.0.mlp.act (high: "
                      "forward input and output compare the same; its place in the tree "
                      "agrees)")
    assert main(["map", a, b, "-o", str(path)]) == 2  # it holds the edits still
    capsys.readouterr()
    assert main(["diff", "--map", str(path), a, b]) == 1  # and the diff reads them as written
    assert "transformer.h.0.mlp.act.forward.0.input.0" in capsys.readouterr().out


def test_a_port_is_checked_live_against_its_reference_through_the_map(runs, tmp_path, capfd):
    """The live reference takes the map `diff --map` takes: the faithful port trains beside
    GPT-2's dump with no alarm, and the port without the attention's scale is named in the
    step it happens, at the record the mapped diff names, as A calls it and as B does."""
    mapping = tmp_path / "map.yaml"
    mapping.write_text(map_modules(runs["a"], runs["port"]).to_yaml())
    gpt2 = _gpt2()
    port, buggy = _port_of(gpt2), _port_of(gpt2, scale=1.0)
    live = tracer.LiveReference(runs["a"], module_map=mapping)
    _train(port, tmp_path / "port", False, reference=live)
    assert live.first_divergence is None and live.compared == [0]
    # (the setup line says what `diff --map` says too: GPT-2's config has no match in the port)
    assert "first divergence" not in capfd.readouterr().err
    live = tracer.LiveReference(runs["a"], module_map=mapping)
    _train(buggy, tmp_path / "buggy", False, reference=live)
    assert live.first_divergence["name"] == "transformer.h.0.attn.c_proj.forward.0.input.0"
    assert live.first_divergence["b_name"] == "blocks.0.out.forward.0.input.0"
    err = capfd.readouterr().err
    assert "first divergence at step 0: transformer.h.0.attn.c_proj" in err
    assert "; in this run blocks.0.out.forward.0.input.0" in err  # the port's own name
    # without the map the two codebases are never a silent pass
    live = tracer.LiveReference(runs["a"])
    _train(_port_of(_gpt2()), tmp_path / "unmapped", False, reference=live)
    assert "was not judged whole" in capfd.readouterr().err or live.first_divergence
    # a map made for other runs (A and B swapped) says so, where it said "Two codebases?"
    swapped = tmp_path / "swapped.yaml"
    swapped.write_text(map_modules(runs["port"], runs["a"]).to_yaml())
    result = tracer.diff(runs["a"], runs["port"], module_map=read_module_map(swapped))
    assert "the module map pairs few of these runs' modules" in result.notes[0], result.notes
    # a map that does not read is one error naming it
    (tmp_path / "bad.yaml").write_text("pairs: [")
    with pytest.raises(tracer.ConfigError, match=r"module map .*bad\.yaml: not YAML"):
        tracer.LiveReference(runs["a"], module_map=tmp_path / "bad.yaml")


def test_two_codebases_are_not_set_up_otherwise_by_the_shape_of_their_code(runs, ported):
    """GPT-2 and Llama keep their constants in a config and their ports in code: keys one
    side alone holds are the code's shape, never a setup difference, and explain never blames
    them for a port's bug (it said "setup: config activation_function only in A" whatever the
    fault)."""
    from tracer.analysis import explain

    m = map_modules(runs["a"], runs["port"])
    result = tracer.diff(runs["a"], runs["port"], module_map=m)
    assert not [c for c in result.changes if c["kind"] == "setup"], result.changes[:1]
    for a, fault in (("gpt2", "scale"), ("llama", "llama_scale")):
        e = explain(ported[a], ported[fault], module_map=map_modules(ported[a],
                                                                       ported[f"{a}_port"]))
        assert e.status != "setup" and not e.verdict.startswith("setup"), e.verdict
